"""The Horovod API for PyTorch: ``import sparkhvd.collective.torch as hvd``.

Works inside ``HorovodRunner``, under torchrun, and alone (a job of one). CPU tensors travel
over gloo, CUDA tensors over NCCL.
"""

from __future__ import annotations

from .._core import (
                     Adasum,
                     Average,
                     HorovodInternalError,
                     Max,
                     Min,
                     ProcessSet,
                     Product,
                     ReduceOp,
                     Sum,
                     add_process_set,
                     allgather_async,
                     allgather_object,
                     allreduce_,
                     allreduce_async,
                     allreduce_async_,
                     alltoall_async,
                     barrier,
                     broadcast_,
                     broadcast_async,
                     broadcast_async_,
                     broadcast_object,
                     ccl_built,
                     cross_rank,
                     cross_size,
                     cuda_built,
                     ddl_built,
                     global_process_set,
                     gloo_built,
                     gloo_enabled,
                     grouped_allgather_async,
                     grouped_allreduce_,
                     grouped_allreduce_async,
                     grouped_allreduce_async_,
                     grouped_reducescatter_async,
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
                     poll,
                     rank,
                     reducescatter_async,
                     remove_process_set,
                     rocm_built,
                     shutdown,
                     size,
                     sparse_allreduce_async,
                     start_timeline,
                     stop_timeline,
                     synchronize,
)
from . import elastic
from ._autograd import (
                     allgather,
                     allreduce,
                     alltoall,
                     broadcast,
                     grouped_allgather,
                     grouped_allreduce,
                     grouped_reducescatter,
                     reducescatter,
)
from ._compression import Compression
from ._functions import broadcast_optimizer_state, broadcast_parameters
from ._optimizer import DistributedOptimizer
from ._sync_batch_norm import SyncBatchNorm

__all__ = [
    "init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size",
    "cross_rank", "cross_size", "is_homogeneous", "nccl_built", "gloo_built", "mpi_built", "cuda_built",
    "mpi_enabled", "mpi_threads_supported", "gloo_enabled", "ddl_built", "ccl_built", "rocm_built",
    "allreduce", "allreduce_", "allreduce_async", "allreduce_async_", "sparse_allreduce_async",
    "grouped_allreduce", "grouped_allreduce_", "grouped_allreduce_async", "grouped_allreduce_async_",
    "allgather", "allgather_async", "grouped_allgather", "grouped_allgather_async",
    "broadcast", "broadcast_", "broadcast_async", "broadcast_async_",
    "alltoall", "alltoall_async", "reducescatter", "reducescatter_async", "grouped_reducescatter",
    "grouped_reducescatter_async",
    "synchronize", "poll", "barrier", "join",
    "broadcast_parameters", "broadcast_optimizer_state", "broadcast_object", "allgather_object",
    "ProcessSet", "global_process_set", "add_process_set", "remove_process_set",
    "Compression", "DistributedOptimizer", "SyncBatchNorm", "elastic", "start_timeline", "stop_timeline",
    "ReduceOp", "Average", "Sum", "Adasum", "Min", "Max", "Product", "HorovodInternalError",
]
