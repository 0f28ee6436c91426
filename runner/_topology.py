"""Rank assignment: ranks grouped by host, Horovod's topology fields."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Placement:
    """Where one rank sits.

    ``rank``/``size``: the global rank and the number of ranks. ``local_rank``/``local_size``:
    the rank among, and the number of, the ranks on the same host. ``cross_rank``/``cross_size``:
    as in Horovod, the index of this host among the hosts that have a rank with this
    ``local_rank``, and the number of such hosts (on a homogeneous cluster: the host index and
    the number of hosts).
    """

    rank: int
    size: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int
    homogeneous: bool = True  # every host runs the same number of ranks

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
