"""Horovod's basics, the same for every framework: ``init``, ``rank``, ``size`` and the rest, ``join``, and what is built.

As Horovod's ``horovod/common/basics.py``: the torch, TensorFlow and Keras APIs all export these.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..._common.op_names import JOIN
from .._engine import communicator as _engine
from .._engine import mpi as _mpi
from .._engine.ops import Op
from . import _buffers, _inline, _joined, _process_sets
from ._handles import synchronize
from ._process_sets import add_process_set, global_process_set

_JOINED_THROUGH = {"sparkhvd": "HorovodRunner", "torchrun": "torchrun", "mpi": "MASTER_ADDR/MASTER_PORT",
                   "single": "no launcher (a job of one)"}


def init(comm=None, process_sets=None) -> None:
    """Join this process's job: HorovodRunner's, torchrun's, mpirun's, or a job of one.

    ``comm``: None; the list of every rank (a subset of ranks is a process set here); or, as
    Horovod's, an mpi4py intracommunicator (``MPI.COMM_WORLD``, or one made by its ``Split``)
    whose ranks form the job, each with its rank in it. ``process_sets``: ProcessSets (or lists
    of ranks) to register on every rank, or ``"dynamic"`` (sets are always dynamic here:
    ``add_process_set`` works at any time).
    """
    if isinstance(process_sets, str):
        if process_sets.lower() != "dynamic":
            raise ValueError(f"init(process_sets={process_sets!r}): pass a list of ProcessSets or \"dynamic\".")
        process_sets = None
    mpi_comm = None if comm is None or isinstance(comm, (list, tuple, range)) else _mpi.communicator(comm)
    _engine.init(_engine.EngineParts(zeros_for_joined_rank=_joined.zeros_for_joined_rank, reduce=_inline.reduce,
                                     fusion_threshold=_buffers.fusion_threshold()), mpi_comm)
    if mpi_comm is not None and not _mpi.same_communicator(mpi_comm):
        how = "another communicator" if _mpi.enabled() else _JOINED_THROUGH.get(_engine.topology().source)
        raise ValueError(f"init(comm={comm!r}): this process already joined a job of {size()} ranks through {how}; "
                         "call hvd.shutdown() before hvd.init(comm=...).")
    if mpi_comm is None and comm is not None:
        everyone = list(range(_engine.topology().size))
        if sorted(comm) != everyone:
            raise ValueError(f"init(comm={comm!r}): sparkhvd always runs on every rank of the job ({everyone}); "
                             "pass comm=None, and put a subset of ranks in a process set (hvd.add_process_set).")
    global_process_set.ranks = list(range(_engine.topology().size))
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
    if size() == 1:
        return 0
    return synchronize(_engine.engine().submit(global_process_set.link_id, Op(
        kind=JOIN, name=None, signature="", description="join()"), sync=True))


def shutdown() -> None:
    """Leave the job (``init()`` may be called again); forgets the process sets and unfinished names."""
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


def nccl_built() -> int:
    """NCCL's version code (e.g. 21803 for 2.18.3) if CUDA tensors can travel over NCCL here, else 0.

    As Horovod's, a number that is true exactly when NCCL is there.
    """
    if not dist.is_nccl_available():
        return 0
    major, minor, patch = torch.cuda.nccl.version()[:3]
    return major * (10000 if (major, minor) >= (2, 9) else 1000) + minor * 100 + patch


def gloo_built() -> bool:
    """Whether CPU tensors can travel over gloo (always, for torch on Linux and macOS)."""
    return bool(dist.is_gloo_available())


def mpi_built() -> bool:
    """Whether a job that ``mpirun`` starts can join through MPI here: mpi4py is installed.

    MPI only makes the rendezvous; gloo and NCCL carry every collective.
    """
    return _mpi.built()


def mpi_enabled() -> bool:
    """Whether this process joined its job through MPI (started by ``mpirun``, with mpi4py)."""
    return _engine.is_initialized() and _mpi.enabled()


def mpi_threads_supported() -> bool:
    """Whether MPI runs with ``MPI_THREAD_MULTIPLE`` (so the script may use mpi4py too); raises, as
    Horovod's, where MPI is not enabled."""
    if not mpi_enabled():
        raise ValueError("MPI is not enabled: this process did not join its job through MPI (that needs mpirun "
                         "and mpi4py: pip install \"sparkhvd[mpi]\"), so there is no MPI threading to ask about; "
                         "call hvd.mpi_enabled() first.")
    return _mpi.threads_supported()


def gloo_enabled() -> bool:
    """Whether gloo carries CPU tensors at run time (always, as gloo_built)."""
    return gloo_built()


def ddl_built() -> bool:
    """False: no IBM DDL."""
    return False


def ccl_built() -> bool:
    """False: no oneCCL."""
    return False


def rocm_built() -> bool:
    """Whether this torch was built for ROCm (its GPU collectives then go over RCCL, as NCCL)."""
    return torch.version.hip is not None


def cuda_built() -> bool:
    """Whether this torch was built with CUDA."""
    return torch.version.cuda is not None
