"""The communicator: one c10d process group (gloo for CPU tensors, NCCL for CUDA tensors).

``init()`` builds it from whichever launcher started this process: HorovodRunner (the driver
service serves the rendezvous store, ``_common/rendezvous.py``), torchrun (RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT), mpirun (``mpi.py``: through mpi4py, or MASTER_ADDR/MASTER_PORT), or
nothing (a group of one).
"""

from __future__ import annotations

import atexit
import datetime
import secrets
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from ..._common import context as _context
from ..._common import progress as _progress
from ..._common import settings
from ..._common import torch_ops as _torch_ops
from ..._common.network import local_address
from ..._common.topology import Placement
from . import env_rendezvous as _env_rendezvous
from . import mpi as _mpi
from . import timeline as _timeline
from .engine import Engine
from .mesh import Endpoint
from .store import DriverStore

_env_rendezvous.install()  # dist.init_process_group() in a rank of this run meets through the driver's store

_TIMEOUT = datetime.timedelta(minutes=30)
_INIT_LINK = -2  # the stall report's number for init()'s rendezvous (process sets count from 0)


@dataclass(frozen=True)
class Topology(Placement):
    """This process's Placement plus where it came from ("sparkhvd", "torchrun", "mpi" or "single")."""

    source: str = "single"


_topology: Topology | None = None
_owns_group = False
_generation = 0  # init() count in this process: keeps each init's store keys apart
# c10d calls a Python store's methods only while the Python object lives; torch itself does not
# keep it alive once it is wrapped (new_group wraps the default store), so we do.
_store = None
_endpoint: Endpoint | None = None  # the control links between ranks (``mesh.py``)
_master_addr: str | None = None  # where an mpirun job's store listens (the control links listen toward it)
_mpi_exit_registered = False  # whether shutdown() runs at exit (registered by the first mpirun join)
_engine = None  # the process's negotiating engine (``engine.py``), in jobs of more than one rank


class NotInitializedError(ValueError):
    """A collective was called before ``init()``."""


@dataclass(frozen=True)
class EngineParts:
    """What the core (``collective/_core``) gives the engine it starts."""

    zeros_for_joined_rank: Callable  # a joined rank's part in the others' reductions (``_core/_joined.py``)
    reduce: Callable  # the reduction of small tensors that ride in the control frames (``_core/_inline.py``)
    fusion_threshold: int  # bytes of ready ops fused into one (``HOROVOD_FUSION_THRESHOLD``)


def init(parts: EngineParts, mpi_comm=None) -> Topology:
    """Join the job this process belongs to (idempotent); ``mpi_comm``: an mpi4py communicator to join through."""
    global _topology, _owns_group, _generation, _store, _endpoint, _master_addr, _mpi_exit_registered
    if _topology is not None:
        return _topology
    ctx = _context.current()
    backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
    if ctx is not None:
        p = ctx.placement
        store = _store = DriverStore(ctx.new_client(), prefix=f"sparkhvd/{_generation}/")
        store.set_timeout(_TIMEOUT)  # init_process_group leaves a given store at its 5-minute default
        if torch.cuda.is_available():  # the runner's list puts a rank's own GPU at cuda_devices[0] (local_rank where
            # each rank has one); where it pinned none (np<0, on the driver), the ranks share the GPUs by local_rank
            torch.cuda.set_device(p.cuda_devices[0] if p.cuda_devices else p.local_rank % torch.cuda.device_count())
        topology = Topology(**p.as_dict(), source="sparkhvd")
        if dist.is_initialized():  # the function called dist.init_process_group() first (torchrun's variables)
            problem = reuse_problem((dist.get_rank(), dist.get_world_size()), (p.rank, p.size), dist.get_backend())
            if problem:
                raise ValueError(problem)
            _owns_group = False
        else:
            waiting = _progress.begin_check("hvd.init", None, None, _INIT_LINK)  # the stall report sees who is late
            try:
                dist.init_process_group(backend, store=store, rank=p.rank, world_size=p.size, timeout=_TIMEOUT)
            finally:
                _progress.end(waiting)
            _owns_group = True
            _torch_ops.ignore_group(dist.distributed_c10d._get_default_group().group_name)  # the engine names its ops
            _context.built_default_group("hvd.init()")
    elif dist.is_initialized():  # the user built the default group (e.g. under torchrun)
        topology = _from_torchrun(dist.get_rank(), dist.get_world_size())
        _owns_group = False
    elif mpi_comm is not None or (_mpi.launched() is not None and not _torchrun_env()):  # torchrun under
        # mpirun (one per node) sees both: its own variables describe this process
        joined = _mpi.join(mpi_comm, _TIMEOUT)
        store, _master_addr, p = joined.store, joined.master_addr, joined.placement
        if torch.cuda.is_available():  # the GPU Horovod's scripts then select, torch.cuda.set_device(hvd.local_rank())
            torch.cuda.set_device(p.local_rank % torch.cuda.device_count())
        topology = Topology(**p.as_dict(), source="mpi")
        dist.init_process_group(backend, store=store, rank=p.rank, world_size=p.size, timeout=_TIMEOUT)
        _store, _owns_group = store, True
        if not _mpi_exit_registered:  # as Horovod's: gloo's threads stop before the interpreter (and MPI)
            # does; a script that just ends otherwise races them, and mpirun reports the abort
            atexit.register(shutdown)
            _mpi_exit_registered = True
    elif _torchrun_env():
        topology = _from_torchrun(settings.RANK.get(), settings.WORLD_SIZE.get())
        dist.init_process_group(backend, init_method="env://", rank=topology.rank,
                                world_size=topology.size, timeout=_TIMEOUT)
        _owns_group = True
    else:
        topology = Topology(rank=0, size=1, local_rank=0, local_size=1, cross_rank=0, cross_size=1)
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=_TIMEOUT)
        _owns_group = True
    if topology.size > 1:
        _endpoint = _control_endpoint(topology.rank, ctx)
        _start_engine(topology, parts)
    if ctx is not None and (record := settings.TIMELINE.get()) and not _timeline.recording():
        _timeline.start_timeline(None, mark_cycles=record == "cycles")  # HOROVOD_TIMELINE on the driver
    _generation += 1
    _topology = topology
    return topology


def reuse_problem(found: tuple, placed: tuple, backend: str) -> str | None:
    """Why ``hvd.init()`` cannot use the default process group the function built (``found``: its rank and size,
    and its ``backend``) for this rank, ``placed`` (rank, size) by HorovodRunner; None where it can."""
    if tuple(found) != tuple(placed):
        return (f"hvd.init() found a default process group in which this process is rank {found[0]} of {found[1]}, "
                f"but HorovodRunner placed it as rank {placed[0]} of {placed[1]}; build the group from the environment "
                "the runner set (dist.init_process_group() with no init_method, rank or world_size), or call "
                "hvd.init() alone.")
    if "gloo" not in str(backend):
        return (f"hvd.init() found a default process group on backend {backend!r}, which carries no CPU tensors, and "
                "Horovod's API needs them (broadcast_object, elastic state, CPU tensors); build it with "
                "dist.init_process_group('cpu:gloo,cuda:nccl'), or call hvd.init() alone.")
    return None


def _control_endpoint(rank: int, ctx) -> Endpoint:
    """This rank's end of the control links, listening where its peers can reach it."""
    if ctx is not None:  # the worker chose the address: toward the driver, or network_interface's
        store, prefix, key = _store, "control/", ctx.secret
        host = ctx.local_address or local_address(ctx.address[0])
    else:
        store = dist.distributed_c10d._get_default_store()
        prefix = f"sparkhvd/{_generation}/control/"
        if rank == 0:
            store.set(prefix + "key", secrets.token_hex(32))
        key = store.get(prefix + "key")
        host = local_address(_master_addr or settings.MASTER_ADDR.get())
    return Endpoint(rank=rank, host=host, key=key, store=store, prefix=prefix, timeout=_TIMEOUT.total_seconds())


def _start_engine(topology: Topology, parts: EngineParts) -> None:
    """The engine thread, with the global set's links (made now: every rank is in init())."""
    global _engine
    everyone = list(range(topology.size))
    waiting = _progress.begin_check("hvd.init", None, None, _INIT_LINK)
    try:
        sockets = _endpoint.star(0, everyone, "hvd.init()")
    finally:
        _progress.end(waiting)
    if torch.cuda.is_available():  # the engine thread starts NCCL ops on this process's device
        device = torch.cuda.current_device()
    else:
        device = None
    _engine = Engine(topology.rank, settings.MAX_CONTROL_PAYLOAD.get(), zeros_for_joined_rank=parts.zeros_for_joined_rank,
                     reduce=parts.reduce, device=device, fusion_threshold=parts.fusion_threshold,
                     cycle_time=settings.CYCLE_TIME.get(), cache_capacity=settings.CACHE_CAPACITY.get())
    _engine.add_link(0, everyone, sockets, None)


def add_links(link_id: int, members: list, group) -> None:
    """Make a new process set's links and hand them to the engine (on every member, together)."""
    if _engine is None:
        return
    sockets = endpoint().star(link_id, members, f"process set {members}")
    _engine.add_link(link_id, members, sockets, members, group=group)


def forget_links(link_id: int) -> None:
    """Close a removed process set's control links."""
    if _engine is not None:
        _engine.remove_link(link_id)
    if _endpoint is not None:
        _endpoint.forget(link_id)


def engine():
    """The negotiating engine; raises unless ``init()`` ran in a job of more than one rank."""
    if _engine is None:
        raise NotInitializedError("sparkhvd has not been initialized in a job of more than one rank; "
                                  "call hvd.init() first.")
    return _engine


def endpoint() -> Endpoint:
    """The control links' endpoint; raises unless ``init()`` ran in a job of more than one rank."""
    if _endpoint is None:
        raise NotInitializedError("sparkhvd has not been initialized in a job of more than one rank; "
                                  "call hvd.init() first.")
    return _endpoint


def _torchrun_env() -> bool:
    return all(s.raw() is not None for s in (settings.RANK, settings.WORLD_SIZE, settings.MASTER_ADDR))


def _from_torchrun(rank: int, size: int) -> Topology:
    local_rank = settings.LOCAL_RANK.get()
    local_size = settings.LOCAL_WORLD_SIZE.get()
    cross_size = settings.GROUP_WORLD_SIZE.get()
    cross_size = max(1, size // max(1, local_size)) if cross_size is None else cross_size
    cross_rank = settings.GROUP_RANK.get()
    cross_rank = rank // max(1, local_size) if cross_rank is None else cross_rank
    return Topology(rank=rank, size=size, local_rank=local_rank, local_size=local_size,
                    cross_rank=cross_rank, cross_size=cross_size, source="torchrun")


DRAIN_S = 10.0  # how long leaving waits for frames still owed to peers


def drain() -> None:
    """Send what this rank still owes its peers before the process ends (the rank's exit calls it)."""
    if _engine is not None:
        _engine.drain(DRAIN_S)


atexit.register(drain)  # a script under torchrun may exit without hvd.shutdown()
_context.at_exit(drain)  # under HorovodRunner, the worker drains before it reports the result


def shutdown() -> None:
    """Leave the job; ``init()`` may be called again afterwards."""
    global _topology, _owns_group, _store, _endpoint, _engine, _master_addr
    if _topology is None:
        return
    if _engine is not None:
        _engine.drain(DRAIN_S)
        _engine.close("hvd.shutdown() ran on this rank.")
        _engine = None
    if _endpoint is not None:
        _endpoint.close()
        _endpoint = None
    if _owns_group and dist.is_initialized():
        dist.destroy_process_group()
    _store = None
    _torch_ops.forget_ignored()
    _context.built_default_group(None)
    _topology = None
    _owns_group = False
    _master_addr = None
    _mpi.forget()


def is_initialized() -> bool:
    return _topology is not None


def topology() -> Topology:
    """This process's topology; raises if ``init()`` has not been called."""
    if _topology is None:
        raise NotInitializedError("sparkhvd has not been initialized; call hvd.init() first.")
    return _topology
