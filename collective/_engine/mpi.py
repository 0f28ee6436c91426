"""Joining a job that ``mpirun`` started: where its ranks sit, and the rendezvous store, through MPI.

``mpirun`` marks each process it starts: Open MPI with ``OMPI_COMM_WORLD_RANK`` / ``_SIZE``,
MPICH's and Intel MPI's Hydra with ``PMI_RANK`` / ``PMI_SIZE``. Where mpi4py imports
(``pip install "sparkhvd[mpi]"``), the communicator says the rest, as Horovod's MPI controller
reads it: local ranks from ``Split_type(COMM_TYPE_SHARED)``, cross ranks from the ranks of equal
local rank, both in rank order; rank 0 opens a ``TCPStore`` on a free port and broadcasts its
address over MPI. Without mpi4py, a ``MASTER_ADDR`` / ``MASTER_PORT`` the user passed
(``mpirun -x``) locates the store as under torchrun, and the ranks gather their host names there.
MPI carries no tensors: gloo and NCCL do, as in every other job.
"""

from __future__ import annotations

import datetime
import importlib.util
import os
import socket
import sys
from dataclasses import dataclass

import torch.distributed as dist

from ..._common import settings
from ..._common.network import local_address
from ..._common.topology import Placement

# (launcher, rank variable, size variable), in the order they are looked for
_LAUNCHERS = (("Open MPI's mpirun", settings.OMPI_COMM_WORLD_RANK, settings.OMPI_COMM_WORLD_SIZE),
              ("MPICH's or Intel MPI's mpirun", settings.PMI_RANK, settings.PMI_SIZE))
_LOOPBACK = "127.0.0.1"

_comm = None  # the mpi4py communicator this process joined through; None: not through MPI
_unusable = False  # whether importing mpi4py.MPI failed here


@dataclass(frozen=True)
class Launch:
    """What the MPI launcher put in this process's environment."""

    launcher: str
    rank: int
    size: int
    found: str  # the variables, as they read, for error messages


@dataclass(frozen=True)
class Joined:
    """A rendezvous made: this rank's Placement, the store its process group is built from, and the
    store's address (each rank's control endpoint listens on its interface toward it)."""

    placement: Placement
    store: dist.Store
    master_addr: str


def launched(environ=None) -> Launch | None:
    """The MPI launch this process belongs to (``environ``: None for this process's), or None where no ``mpirun``
    started it."""
    for launcher, rank, size in _LAUNCHERS:
        rank_raw, size_raw = rank.raw(environ), size.raw(environ)
        if rank_raw is not None and size_raw is not None:
            return Launch(launcher, rank.get(environ), size.get(environ),
                          f"{rank.name}={rank_raw}, {size.name}={size_raw}")
    return None


def built() -> bool:
    """Whether mpi4py is installed and, where this process tried, imports (it is imported only to join a
    job that ``mpirun`` started: elsewhere MPI_Init would start a job of one)."""
    return not _unusable and ("mpi4py.MPI" in sys.modules or importlib.util.find_spec("mpi4py") is not None)


def enabled() -> bool:
    """Whether this process joined its job through MPI."""
    return _comm is not None


def threads_supported() -> bool:
    """Whether MPI was initialised with ``MPI_THREAD_MULTIPLE`` (mpi4py asks for it by default)."""
    from mpi4py import MPI

    return MPI.Query_thread() == MPI.THREAD_MULTIPLE


def forget() -> None:
    """``hvd.shutdown()`` ran: this process no longer belongs to an MPI job."""
    global _comm
    _comm = None


def communicator(comm):
    """``comm`` if it is an mpi4py intracommunicator (``init(comm=MPI.COMM_WORLD)``), else a ValueError."""
    MPI = sys.modules.get("mpi4py.MPI")  # a communicator means the caller imported it
    if MPI is None or not isinstance(comm, MPI.Comm) or comm == MPI.COMM_NULL:
        raise ValueError(f"init(comm={comm!r}): pass None, the list of every rank, or an mpi4py communicator "
                         "such as MPI.COMM_WORLD.")
    if comm.Is_inter():
        raise ValueError(f"init(comm={comm!r}) got an intercommunicator; pass an intracommunicator such as "
                         "MPI.COMM_WORLD, or one made by its Split().")
    return comm


def same_communicator(comm) -> bool:
    """Whether this process joined through ``comm`` (or one with the same ranks in the same order)."""
    if _comm is None:
        return False
    from mpi4py import MPI

    return MPI.Comm.Compare(_comm, comm) in (MPI.IDENT, MPI.CONGRUENT)


def place(rank: int, nodes: list) -> Placement:
    """Rank ``rank``'s Placement where rank ``r`` runs on node ``nodes[r]``, as Horovod splits its
    communicator: local ranks among a node's ranks, cross ranks among the ranks of equal local rank,
    both in rank order."""
    per_node: dict = {}
    local_ranks = []
    for node in nodes:
        local_ranks.append(per_node.get(node, 0))
        per_node[node] = local_ranks[-1] + 1
    mine = local_ranks[rank]
    peers = [r for r, lr in enumerate(local_ranks) if lr == mine]
    return Placement(rank=rank, size=len(nodes), local_rank=mine, local_size=per_node[nodes[rank]],
                     cross_rank=peers.index(rank), cross_size=len(peers),
                     homogeneous=len(set(per_node.values())) == 1)


def join(comm, timeout: datetime.timedelta) -> Joined:
    """Make the rendezvous: through ``comm`` (None: MPI.COMM_WORLD), else through MASTER_ADDR/MASTER_PORT."""
    MPI, why = _import_mpi()
    if MPI is not None:
        return _join_mpi(MPI, MPI.COMM_WORLD if comm is None else comm, timeout)
    launch = launched()
    if settings.MASTER_ADDR.raw() is not None and settings.MASTER_PORT.raw() is not None:
        return _join_env(launch, timeout)
    raise ValueError(f"This process was started by {launch.launcher} ({launch.found}), but mpi4py cannot be "
                     f"used ({why}) and MASTER_ADDR/MASTER_PORT are not both set; install it (pip install "
                     "\"sparkhvd[mpi]\"), or name a free port on rank 0's host with mpirun "
                     "-x MASTER_ADDR=<rank 0's host> -x MASTER_PORT=<port>.")


def _import_mpi():
    """``(mpi4py.MPI, None)``, or ``(None, why)`` where it cannot be imported or MPI cannot start."""
    global _unusable
    try:
        from mpi4py import MPI
    except Exception as exc:  # noqa: BLE001 - not installed, no MPI library to load, or MPI_Init failed
        _unusable = True
        return None, f"{type(exc).__name__}: {exc}"
    return MPI, None


def _join_mpi(MPI, comm, timeout: datetime.timedelta) -> Joined:
    global _comm
    rank, size = comm.Get_rank(), comm.Get_size()
    launch = launched()
    if launch is not None and comm == MPI.COMM_WORLD and (launch.rank, launch.size) != (rank, size):
        raise ValueError(mismatch(launch, rank, size))
    node_comm = comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        node = node_comm.bcast(rank, root=0)  # a node is named by its lowest rank
    finally:
        node_comm.Free()
    names = comm.allgather((node, MPI.Get_processor_name()))
    placement = place(rank, [n for n, _ in names])
    if size == 1:
        _comm = comm
        return Joined(placement, dist.HashStore(), _LOOPBACK)
    server = error = None
    address = None
    if rank == 0:
        try:
            address = _store_address(placement, names)
            server = _serve(address[0], address[1], size, timeout)
            address = (address[0], server.port)
        except ValueError as exc:  # no address the other ranks can reach
            error = str(exc)
        except (OSError, RuntimeError) as exc:
            why = os.strerror(exc.errno) if getattr(exc, "errno", None) else exc  # create_server's repeats the address
            error = (f"Rank 0 could not open the rendezvous store on {address[0]}:{address[1]} ({why}); pass a "
                     "free port on an address of rank 0's host with mpirun -x MASTER_ADDR=<address> "
                     "-x MASTER_PORT=<port>, or leave both unset.")
    address, error = comm.bcast((address, error), root=0)
    if error:
        raise ValueError(error)
    store = server or dist.TCPStore(address[0], address[1], size, False, timeout)
    _comm = comm
    return Joined(placement, store, address[0])


def mismatch(launch: Launch, rank: int, size: int) -> str:
    """The error where the MPI that mpi4py loaded is not the launcher's (each process then starts a job of one)."""
    return (f"{launch.launcher} started this process as rank {launch.rank} of {launch.size} ({launch.found}), but "
            f"the MPI library mpi4py loaded says rank {rank} of {size}: it is another MPI than the mpirun's, and "
            "every rank would train alone; point mpi4py at the launcher's MPI (MPI4PY_LIBMPI=<its libmpi.so>, or "
            "MPI4PY_MPIABI=openmpi or mpich), or start the job with the mpirun of the MPI mpi4py loads.")


def reachable(host: str, multi_node: bool) -> str:
    """``host``, where the store may listen for a job's ranks: not a loopback address when they span nodes (a
    host name that resolves to 127.0.1.1, as Debian's /etc/hosts maps its own, would keep the others out)."""
    try:
        address = socket.gethostbyname(host)
    except OSError as exc:
        raise ValueError(f"the rendezvous store's host {host!r} does not resolve here ({exc.strerror}); pass an "
                         "address of rank 0's host with mpirun -x MASTER_ADDR=<address>.") from None
    if multi_node and address.startswith("127."):
        raise ValueError(f"the rendezvous store would listen on {host} ({address}), a loopback address, but this "
                         "job's ranks span several hosts, which cannot reach it there; pass rank 0's address on the "
                         "network the hosts share with mpirun -x MASTER_ADDR=<address>.")
    return host


def _store_address(placement: Placement, names: list) -> tuple[str, int]:
    """Where rank 0's store listens: MASTER_ADDR/MASTER_PORT where given, the loopback where every rank
    shares its node, else its interface toward another node (port 0: a free one)."""
    port = settings.MASTER_PORT.get() or 0
    multi_node = placement.local_size < placement.size
    if settings.MASTER_ADDR.raw() is not None:
        return reachable(settings.MASTER_ADDR.raw(), multi_node), port
    if not multi_node:
        return _LOOPBACK, port
    other = next(name for node, name in names if node != names[0][0])
    try:
        return local_address(other), port
    except OSError:  # the name does not resolve here: the host's own address
        return reachable(local_address(None), multi_node), port


def _serve(host: str, port: int, size: int, timeout: datetime.timedelta) -> dist.TCPStore:
    """Rank 0's store, listening on ``host`` only (TCPStore alone would listen on every interface)."""
    listener = socket.create_server((host, port))
    port = listener.getsockname()[1]
    return dist.TCPStore(host, port, size, True, timeout, wait_for_workers=False, master_listen_fd=listener.detach())


def _join_env(launch: Launch, timeout: datetime.timedelta) -> Joined:
    """The rendezvous without mpi4py: the store at MASTER_ADDR:MASTER_PORT; host names gathered there."""
    host, port = settings.MASTER_ADDR.raw(), settings.MASTER_PORT.get()
    local_size = settings.OMPI_COMM_WORLD_LOCAL_SIZE.get()
    local_size = settings.MPI_LOCALNRANKS.get() if local_size is None else local_size
    reachable(host, local_size is not None and local_size < launch.size)  # every rank reads the same
    if launch.rank == 0:
        store = _serve(host, port, launch.size, timeout)
    else:
        store = dist.TCPStore(host, port, launch.size, False, timeout)
    store.set(f"sparkhvd/mpi/node/{launch.rank}", socket.gethostname())
    nodes = store.multi_get([f"sparkhvd/mpi/node/{r}" for r in range(launch.size)])
    return Joined(place(launch.rank, [bytes(n).decode() for n in nodes]), store, host)
