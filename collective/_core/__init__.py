"""The framework-neutral core under the torch, TensorFlow and Keras APIs.

Horovod's basics (``init``, ``rank``, ``size``, ``join``, ...), reduce ops, process sets,
handles, the asynchronous tensor ops on the background engine, objects across ranks, scaling
and fused buffers. Tensors here are torch tensors: c10d (gloo, NCCL) carries the data, so the
TensorFlow API hands its tensors over through DLPack (``collective/tensorflow/_bridge.py``).
Each framework's API adds only what is its own: differentiable ops, optimizers, compression of
its tensors, batch norm, callbacks.
"""

from __future__ import annotations

from .._engine.ops import HorovodInternalError
from ._allgather import allgather_async, grouped_allgather_async, sparse_allreduce_async
from ._allreduce import (
                      allreduce_,
                      allreduce_async,
                      allreduce_async_,
                      grouped_allreduce_,
                      grouped_allreduce_async,
                      grouped_allreduce_async_,
)
from ._barrier import barrier
from ._basics import (
                      ccl_built,
                      cross_rank,
                      cross_size,
                      cuda_built,
                      ddl_built,
                      gloo_built,
                      gloo_enabled,
                      init,
                      is_homogeneous,
                      is_initialized,
                      join,
                      local_rank,
                      local_size,
                      mpi_built,
                      mpi_enabled,
                      mpi_threads_supported,
                      nccl_built,
                      rank,
                      rocm_built,
                      shutdown,
                      size,
)
from ._broadcast import broadcast_, broadcast_async, broadcast_async_
from ._handles import poll, synchronize
from ._objects import allgather_object, broadcast_object
from ._process_sets import ProcessSet, add_process_set, global_process_set, remove_process_set
from ._reduction import Adasum, Average, Max, Min, Product, ReduceOp, Sum
from ._scatter import alltoall_async, grouped_reducescatter_async, reducescatter_async
from ._timeline_api import start_timeline, stop_timeline

__all__ = [
    "init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size",
    "cross_rank", "cross_size", "is_homogeneous", "nccl_built", "gloo_built", "mpi_built", "cuda_built",
    "mpi_enabled", "mpi_threads_supported", "gloo_enabled", "ddl_built", "ccl_built", "rocm_built", "join",
    "allreduce_", "allreduce_async", "allreduce_async_", "sparse_allreduce_async",
    "grouped_allreduce_", "grouped_allreduce_async", "grouped_allreduce_async_",
    "allgather_async", "grouped_allgather_async", "broadcast_", "broadcast_async", "broadcast_async_",
    "alltoall_async", "reducescatter_async", "grouped_reducescatter_async", "synchronize", "poll", "barrier",
    "broadcast_object", "allgather_object",
    "ProcessSet", "global_process_set", "add_process_set", "remove_process_set", "start_timeline", "stop_timeline",
    "ReduceOp", "Average", "Sum", "Adasum", "Min", "Max", "Product", "HorovodInternalError",
]
