"""The Horovod API for PyTorch: ``import sparkhvd.collective.torch as hvd``.

Works inside ``HorovodRunner``, under torchrun, and alone (a job of one). CPU tensors travel
over gloo, CUDA tensors over NCCL.
"""

from __future__ import annotations

import torch as _torch
import torch.distributed as _dist

from .. import _engine
from . import _check, _process_sets
from ._autograd import (allgather, allreduce, alltoall, broadcast, grouped_allgather, grouped_allreduce,
                        grouped_reducescatter, reducescatter)
from ._compression import Compression
from ._functions import allgather_object, broadcast_object, broadcast_optimizer_state, broadcast_parameters
from ._handles import poll, synchronize
from ._ops import (Adasum, Average, Max, Min, Product, ReduceOp, Sum, allgather_async, allreduce_,
                   allreduce_async, allreduce_async_, alltoall_async, barrier, broadcast_, broadcast_async,
                   broadcast_async_, grouped_allreduce_, grouped_allreduce_async, grouped_allreduce_async_,
                   reducescatter_async)
from ._optimizer import DistributedOptimizer
from ._process_sets import ProcessSet, add_process_set, global_process_set, remove_process_set
from ._sync_batch_norm import SyncBatchNorm
from ._timeline import start_timeline, stop_timeline

__all__ = [
    "init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size",
    "cross_rank", "cross_size", "is_homogeneous", "nccl_built", "gloo_built", "mpi_built", "cuda_built",
    "allreduce", "allreduce_", "allreduce_async", "allreduce_async_",
    "grouped_allreduce", "grouped_allreduce_", "grouped_allreduce_async", "grouped_allreduce_async_",
    "allgather", "allgather_async", "grouped_allgather",
    "broadcast", "broadcast_", "broadcast_async", "broadcast_async_",
    "alltoall", "alltoall_async", "reducescatter", "reducescatter_async", "grouped_reducescatter",
    "synchronize", "poll", "barrier", "join",
    "broadcast_parameters", "broadcast_optimizer_state", "broadcast_object", "allgather_object",
    "ProcessSet", "global_process_set", "add_process_set", "remove_process_set",
    "Compression", "DistributedOptimizer", "SyncBatchNorm", "start_timeline", "stop_timeline",
    "ReduceOp", "Average", "Sum", "Adasum", "Min", "Max", "Product",
]


def init(process_sets=None) -> None:
    """Join this process's job: HorovodRunner's, torchrun's, or a job of one.

    ``process_sets``: ProcessSets (or lists of ranks) to register on every rank.
    """
    _engine.init()
    for ps in process_sets or ():
        add_process_set(ps)


def join(device: int = -1) -> int:
    """This rank has run out of data: stand in for it, with zeros, in the other ranks' reductions.

    Blocks until every rank has called ``join()`` and returns the rank that called it last (the
    highest of those that joined together last). While some ranks have joined, the others may
    run ``allreduce`` / ``grouped_allreduce`` with ``op=Average`` or ``Sum``, DistributedOptimizer
    steps and SyncBatchNorm; the joined ranks contribute zeros, and Average still divides by
    ``size()``. Any other collective then fails on every rank with a clear error. ``device`` is
    accepted for Horovod compatibility (the zeros go where the others' tensors are).
    """
    return _check.join(global_process_set)


def shutdown() -> None:
    """Leave the job (``init()`` may be called again); forgets the process sets."""
    _process_sets._reset()
    _engine.shutdown()


def is_initialized() -> bool:
    """Whether ``init()`` has been called (and not ``shutdown()``)."""
    return _engine.is_initialized()


def rank() -> int:
    """This process's rank, 0..size()-1."""
    return _engine.topology().rank


def size() -> int:
    """The number of processes in the job."""
    return _engine.topology().size


def local_rank() -> int:
    """This process's rank among the processes on its host."""
    return _engine.topology().local_rank


def local_size() -> int:
    """The number of processes on this host."""
    return _engine.topology().local_size


def cross_rank() -> int:
    """The index of this host among the hosts that have a process with this local_rank."""
    return _engine.topology().cross_rank


def cross_size() -> int:
    """The number of hosts that have a process with this local_rank."""
    return _engine.topology().cross_size


def is_homogeneous() -> bool:
    """Whether every host runs the same number of processes."""
    return _engine.topology().homogeneous


def nccl_built() -> bool:
    """Whether CUDA tensors can travel over NCCL here (torch was built with NCCL)."""
    return bool(_dist.is_nccl_available())


def gloo_built() -> bool:
    """Whether CPU tensors can travel over gloo (always, for torch on Linux and macOS)."""
    return bool(_dist.is_gloo_available())


def mpi_built() -> bool:
    """False: sparkhvd never uses MPI (gloo and NCCL carry every collective)."""
    return False


def cuda_built() -> bool:
    """Whether this torch was built with CUDA."""
    return _torch.version.cuda is not None
