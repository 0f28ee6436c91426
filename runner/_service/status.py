"""What one attempt's ranks have reported, frozen at one moment: what the run's policy reads.

The driver service records registrations, results, errors, exits and heartbeats as they arrive
(``_service/service.py``); ``DriverService.status()`` copies them under its lock into a ``RunStatus``
(Ray Train's ``WorkerGroupPollStatus`` plays this part there). The policy (``_policy/policy.py``,
``_policy/supervise.py``) decides from these copies, never from the service's live containers, so a
fake service that hands out ``RunStatus`` values stands in for the real one in tests.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Mapping

_EMPTY: Mapping = MappingProxyType({})


@dataclass(frozen=True, eq=False)
class RunStatus:
    """The ranks of one attempt as the driver knows them at ``at`` (``time.monotonic()``)."""

    np: int
    at: float
    registrations: Mapping = field(default_factory=lambda: _EMPTY)  # task -> Registration (_service/service.py): what the task told the driver
    placements: tuple | None = None  # task -> Placement, once every task has registered and ranks are assigned
    placed_at: float | None = None  # when that happened
    results: Mapping = field(default_factory=lambda: _EMPTY)  # rank -> its pickled return value
    failures: tuple = ()  # each rank's reported exception (_service.Failure), in arrival order
    exits: Mapping = field(default_factory=lambda: _EMPTY)  # rank -> its process's exit code
    progress: Mapping = field(default_factory=lambda: _EMPTY)  # rank -> (its latest heartbeat's meta, when it arrived)
    hosts_updated: tuple | None = None  # set once the driver told rank 0 the run can grow
    agents_gone: frozenset = frozenset()  # tasks whose agent's connection closed (its executor or worker died)

    @property
    def registered(self) -> frozenset:
        """The tasks that have registered."""
        return frozenset(self.registrations)

    @property
    def placed(self) -> bool:
        """Every task has registered and has its rank."""
        return self.placements is not None

    @property
    def failed(self) -> frozenset:
        """The ranks that reported an exception."""
        return frozenset(f.rank for f in self.failures)

    def finished(self) -> bool:
        """Every rank has returned its value and its process has exited."""
        return len(self.results) == self.np and len(self.exits) == self.np

    def dead(self) -> dict:
        """``rank -> exit code`` of the ranks whose process exited without a result or an error."""
        failed = self.failed
        return {r: c for r, c in self.exits.items() if r not in self.results and r not in failed}

    def unfinished(self) -> list:
        """``(rank, Registration)`` of the ranks that have not returned a value: an executor Spark lost explains
        these, the ones that failed or died with it too."""
        if self.placements is None:
            return []
        return [(p.rank, self.registrations[task]) for task, p in enumerate(self.placements) if p.rank not in self.results]

    def silent_ranks(self, also_done=()) -> list:
        """Ranks that have neither returned, failed nor exited (nor are in ``also_done``), and whose heartbeats
        have stopped: none for twice its interval and a second."""
        if self.placements is None:
            return []
        done = set(self.results) | set(self.exits) | self.failed | set(also_done)
        heard = {rank: (self.at - at, float(meta.get("interval") or 5)) for rank, (meta, at) in self.progress.items()}
        alive = {rank for rank, (ago, interval) in heard.items() if ago <= 2 * interval + 1}
        return [r for r in range(self.np) if r not in done and r not in alive]

    def vanished(self) -> list:
        """Ranks that have neither returned, failed nor exited, whose task agent's connection closed: their
        executor, its Python worker or their host is gone, and no word will come from them."""
        if self.placements is None:
            return []
        done = set(self.results) | set(self.exits) | self.failed
        return sorted(p.rank for task, p in enumerate(self.placements) if task in self.agents_gone and p.rank not in done)

    def by_rank(self) -> dict:
        """``rank -> Registration`` once ranks are assigned."""
        if self.placements is None:
            return {}
        return {p.rank: self.registrations[t] for t, p in enumerate(self.placements)}

    def hosts_of(self, ranks) -> set:
        """The addresses and hostnames the ``ranks`` ran on."""
        ranks = set(ranks)
        if not ranks or self.placements is None:
            return set()
        regs = [reg for rank, reg in self.by_rank().items() if rank in ranks]
        return {reg.peer for reg in regs} | {reg.host for reg in regs}
