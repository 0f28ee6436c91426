"""Rank assignment: ranks grouped by host, Horovod's topology fields, and the GPUs each rank sees."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace


@dataclass(frozen=True)
class Placement:
    """Where one rank sits.

    ``rank``/``size``: the global rank and the number of ranks. ``local_rank``/``local_size``:
    the rank among, and the number of, the ranks on the same host. ``cross_rank``/``cross_size``:
    as in Horovod, the index of this host among the hosts that have a rank with this
    ``local_rank``, and the number of such hosts (on a homogeneous cluster: the host index and
    the number of hosts). ``cuda_devices``: this rank's own GPUs, as indices into the
    ``CUDA_VISIBLE_DEVICES`` the runner gave it (``host_gpus``); the first is the device
    ``hvd.init()`` makes current. Empty where the runner pinned no GPU (no GPUs, or np<0).
    """

    rank: int
    size: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int
    homogeneous: bool = True  # every host runs the same number of ranks
    cuda_devices: tuple = ()

    def __post_init__(self):
        object.__setattr__(self, "cuda_devices", tuple(self.cuda_devices))  # a list, when it comes from JSON

    def as_dict(self) -> dict:
        return asdict(self)


def assign_ranks(hosts: list[str]) -> list[Placement]:
    """Place task ``i`` (which runs on ``hosts[i]``): returns one Placement per task.

    Ranks are contiguous per host; hosts are ordered by their lowest task index and tasks on a
    host by task index, so the result is deterministic for a given registration.
    """
    by_host: dict[str, list[int]] = {}
    for task, host in enumerate(hosts):
        by_host.setdefault(host, []).append(task)  # dicts keep first-seen order = lowest task
    size = len(hosts)
    placements: list[Placement | None] = [None] * size
    rank = 0
    host_list = list(by_host)
    homogeneous = len({len(tasks) for tasks in by_host.values()}) == 1
    for host in host_list:
        tasks = by_host[host]
        for local_rank, task in enumerate(tasks):
            peers = [h for h in host_list if len(by_host[h]) > local_rank]
            placements[task] = Placement(
                rank=rank, size=size, local_rank=local_rank, local_size=len(tasks),
                cross_rank=peers.index(host), cross_size=len(peers), homogeneous=homogeneous)
            rank += 1
    return placements  # type: ignore[return-value]


def host_gpus(placements: list[Placement], hosts: list[str], devices: list[list[str]]) \
        -> tuple[list[Placement], list[list[str]]]:
    """Each task's ``CUDA_VISIBLE_DEVICES``: the GPUs of this job's ranks on its host, in local-rank order.

    ``placements`` and ``hosts`` are ``assign_ranks``' answer and argument; ``devices[i]`` are task
    ``i``'s GPUs, already mapped through its executor's own ``CUDA_VISIBLE_DEVICES`` (``visible_gpus``),
    so executors with different lists on one host still agree. Where every task has one GPU, entry
    ``i`` of a host's list is the GPU of the rank with ``local_rank`` ``i``, so Horovod's
    ``torch.cuda.set_device(hvd.local_rank())`` selects the rank's own. A task with several GPUs keeps
    them together, in Spark's order (rank ``r`` with ``k`` each: entries ``r*k`` .. ``r*k+k-1``, as
    Horovod scripts that give each rank ``k`` GPUs index them). A task without GPUs gets an empty list
    (its process keeps the executor's environment). Where Spark gave two tasks on a host one GPU (a
    fractional ``spark.task.resource.gpu.amount``), that host's ranks each see only their own, as at
    index 0 (NCCL then refuses the shared GPU with its own error; gloo jobs run). Returns the
    placements with ``cuda_devices`` (the task's own entries) filled in, and the lists.
    """
    by_host: dict[str, list[int]] = {}
    for task in sorted(range(len(hosts)), key=lambda t: placements[t].local_rank):
        by_host.setdefault(hosts[task], []).append(task)
    pinned, lists = list(placements), [[] for _ in hosts]
    for tasks in by_host.values():
        listed = [str(d) for task in tasks for d in devices[task]]
        shared = len(set(listed)) < len(listed)  # Spark shares a GPU between tasks (a fractional gpu amount)
        start = 0
        for task in tasks:
            mine = [str(d) for d in devices[task]]
            if not mine:
                continue
            if shared:  # a list cannot name one GPU twice: each such rank sees only its own, at index 0
                pinned[task] = replace(placements[task], cuda_devices=tuple(range(len(mine))))
                lists[task] = mine
            else:
                pinned[task] = replace(placements[task], cuda_devices=tuple(range(start, start + len(mine))))
                lists[task] = list(listed)
            start += len(mine)
    return pinned, lists

