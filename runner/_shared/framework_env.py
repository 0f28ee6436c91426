"""What each framework's own distributed training reads from a rank's environment: torchrun's variables and
TensorFlow's ``TF_CONFIG``.

Every rank gets them, so ``torch.distributed.init_process_group()`` (``env://``), DDP, FSDP, Lightning, Hugging
Face and ``MultiWorkerMirroredStrategy`` run as under torchrun or spark-tensorflow-distributor. The rendezvous
goes through the driver: each task's agent reserves two free ports on its host when it registers
(``reserve_ports``), and the driver hands every rank the list of the ranks' addresses and ports (``Endpoint``);
rank 0's first port is ``MASTER_PORT``, where ``init_process_group`` starts its store, and each rank's second
port is its ``TF_CONFIG`` worker's. Nothing listens on them until the function does.

Two layouts of torchrun's variables:

- ``"torchrun"`` (HorovodRunner): as ``torchrun --nnodes=<hosts> --nproc_per_node=<ranks on each host>`` sets
  them: ``LOCAL_RANK`` is the rank's index on its host (``hvd.local_rank()``), ``GROUP_RANK`` its host's index.
- ``"node_per_task"`` (the TorchDistributor drop-in): as pyspark's TorchDistributor runs ``torchrun
  --nnodes=<np> --nproc_per_node=1`` in each task: every rank is a node of its own (``LOCAL_RANK=0``,
  ``NODE_RANK=GROUP_RANK=RANK``), which Lightning's ``Trainer(devices=1, num_nodes=np)`` expects; each rank
  then sees only its own GPUs (``runner/_agent/agent.py``). Where each Spark task holds k GPUs and runs k ranks
  (``per_task``), the task is the node, as pyspark runs ``torchrun --nnodes=<np/k> --nproc_per_node=k`` there:
  ``LOCAL_RANK=RANK % k``, ``NODE_RANK=RANK // k``, and each rank sees its task's k GPUs.
"""

from __future__ import annotations

import json
import socket
from dataclasses import dataclass

TORCHRUN = "torchrun"
NODE_PER_TASK = "node_per_task"
LAYOUTS = (TORCHRUN, NODE_PER_TASK)

# Every variable this module sets; a rank's environment loses the executor's own first (another job's).
NAMES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
         "ROLE_WORLD_SIZE", "ROLE_NAME", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID",
         "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_USE_AGENT_STORE", "TF_CONFIG")


@dataclass(frozen=True)
class Endpoint:
    """Where one rank's framework servers may listen: its host's address toward its peers and two free ports."""

    address: str
    torch_port: int  # rank 0's is MASTER_PORT: init_process_group's store
    tf_port: int  # this rank's TF_CONFIG worker (its gRPC server)

    @classmethod
    def parse(cls, value) -> Endpoint | None:
        """A REGISTER frame's ``endpoint`` (``[address, port, port]``), or None where absent or malformed."""
        if (isinstance(value, (list, tuple)) and len(value) == 3 and isinstance(value[0], str)
                and all(type(p) is int and 0 < p < 65536 for p in value[1:])):
            return cls(value[0], value[1], value[2])
        return None


def reserve_ports(address: str) -> tuple[Endpoint, list]:
    """Two ports free on ``address`` (the kernel's choice), and the sockets that hold them: close them once every
    task has registered (the driver's ASSIGN), so that no two tasks on a host are given the same port. The rank's
    torch store and TF worker bind them later, as pyspark's TorchDistributor and spark-tensorflow-distributor
    choose theirs; nothing listens on them meanwhile."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    held = []
    try:
        for _ in range(2):
            s = socket.socket(family, socket.SOCK_STREAM)
            held.append(s)
            s.bind((address, 0))
    except OSError:
        for s in held:
            s.close()
        raise
    return Endpoint(address, held[0].getsockname()[1], held[1].getsockname()[1]), held


def framework_env(placement: dict, *, layout: str, endpoints: list, node: tuple, run_id: str, attempt: int,
                  max_restarts: int, per_task: int = 1) -> dict:
    """The variables of rank ``placement["rank"]``. ``endpoints``: every rank's ``Endpoint`` in rank order (None
    where its agent could not reserve ports: without rank 0's, no MASTER_*; without any one, no TF_CONFIG); ``node``: ``(index of the rank's
    host, number of hosts)``, torchrun's group rank and size; ``per_task``: the ranks of each Spark task, which
    ``node_per_task`` makes a node (a task's ranks are consecutive: ``assign_ranks`` orders a host's by task)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r} is not one of {', '.join(map(repr, LAYOUTS))}.")
    rank, size = placement["rank"], placement["size"]
    if layout == TORCHRUN:
        local_rank, local_size = placement["local_rank"], placement["local_size"]
        group_rank, groups = node
    else:
        local_rank, local_size, group_rank, groups = rank % per_task, per_task, rank // per_task, size // per_task
    env = {
        "RANK": rank, "WORLD_SIZE": size, "LOCAL_RANK": local_rank, "LOCAL_WORLD_SIZE": local_size,
        "GROUP_RANK": group_rank, "GROUP_WORLD_SIZE": groups, "NODE_RANK": group_rank,
        "ROLE_RANK": rank, "ROLE_WORLD_SIZE": size, "ROLE_NAME": "default",
        "TORCHELASTIC_RUN_ID": run_id, "TORCHELASTIC_RESTART_COUNT": attempt,
        "TORCHELASTIC_MAX_RESTARTS": max_restarts,
        "TORCHELASTIC_USE_AGENT_STORE": False,  # rank 0's init_process_group starts the store at MASTER_PORT
    }
    if endpoints and endpoints[0] is not None:  # rank 0's store is all torch needs
        env["MASTER_ADDR"], env["MASTER_PORT"] = endpoints[0].address, endpoints[0].torch_port
    if len(endpoints) == size and all(e is not None for e in endpoints):
        workers = [f"[{e.address}]:{e.tf_port}" if ":" in e.address else f"{e.address}:{e.tf_port}" for e in endpoints]
        env["TF_CONFIG"] = json.dumps({"cluster": {"worker": workers}, "task": {"type": "worker", "index": rank}})
    return {name: str(value) for name, value in env.items()}


def node_of(placements: list, task: int) -> tuple[int, int]:
    """Task ``task``'s ``(host index, number of hosts)`` from ``assign_ranks``' placements: ranks are contiguous on
    a host, so the host's first rank has local rank 0, whose ``cross_rank`` is the host's index among all."""
    first = {p.rank: p for p in placements}[placements[task].rank - placements[task].local_rank]
    return first.cross_rank, first.cross_size
