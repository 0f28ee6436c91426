"""The Horovod API for PyTorch: ``import sparkhvd.collective.torch as hvd``.

Works inside ``HorovodRunner``, under torchrun, and alone (a job of one). CPU tensors travel
over gloo, CUDA tensors over NCCL.
"""

from __future__ import annotations

from .. import _engine
from ._functions import broadcast_object, broadcast_optimizer_state, broadcast_parameters
from ._ops import (Adasum, Average, Max, Min, Product, ReduceOp, Sum, allgather, allreduce,
                   allreduce_, barrier, broadcast, broadcast_)
from ._optimizer import DistributedOptimizer

__all__ = [
    "init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size",
    "cross_rank", "cross_size",
    "allreduce", "allreduce_", "allgather", "broadcast", "broadcast_", "barrier",
    "broadcast_parameters", "broadcast_optimizer_state", "broadcast_object",
    "DistributedOptimizer",
    "ReduceOp", "Average", "Sum", "Adasum", "Min", "Max", "Product",
]


def init() -> None:
    """Join this process's job: HorovodRunner's, torchrun's, or a job of one."""
    _engine.init()


def shutdown() -> None:
    """Leave the job (``init()`` may be called again)."""
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
