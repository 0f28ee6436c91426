"""Stragglers named: a rank whose own work per step stays well above the others', before it becomes a stall.

Data-parallel ranks go in lockstep, so every rank makes the same steps per second: a slow rank shows as the others'
waiting for it in their collectives. So the measure is each rank's own time per step, its wall time outside
collectives (``negotiation_s`` and ``transfer_s`` of its heartbeats' metrics, ``_common/metrics.py``), over the last
``SPARKHVD_STRAGGLER_WINDOW_SECONDS``. Where a rank's stays above ``SPARKHVD_STRAGGLER_FACTOR`` times the median of
the other ranks', more than ``MIN_EXCESS_S`` above it and by at least half as much as the slowest rank's (not a rank a
little slower than ranks that only wait for a far slower one), the driver prints one line naming the rank, its host and
GPU, both times, and where its extra time goes: waiting for data (sparkhvd's readers) or its own compute. Once per
episode: the rank is named again only after it has fallen back below the factor.
"""

from __future__ import annotations

import statistics
import sys
import time

from ..._common import settings
from .._service.metrics import Beats, change, steps_source

CHECK_S = 1.0  # how often the driver looks
MIN_EXCESS_S = 0.01  # a straggler's own work per step is at least this much above the others' median
NEAR_WORST = 0.5  # and its excess at least this share of the slowest rank's


def straggler_settings() -> dict:
    """``factor`` and ``window`` as this process's environment sets them."""
    return {"factor": settings.STRAGGLER_FACTOR.get(), "window": settings.STRAGGLER_WINDOW.get()}


class Stragglers:
    """Reads each poll's ``RunStatus`` (its heartbeats' metrics); prints the straggler line. ``factor`` 0: off."""

    def __init__(self, *, run_id: str, factor: float, window: float, out=None, clock=time.monotonic):
        self.run_id, self.factor, self.window = run_id, factor, window
        self._out, self._clock = out, clock
        self._beats = Beats(keep=2 * window)
        self._named: set = set()  # the ranks of the episodes going on
        self._checked_at = -CHECK_S
        self.lines: list = []  # every line printed

    def check(self, status) -> None:
        if not self.factor or status.placements is None:
            return
        self._beats.update(status.progress)
        now = self._clock()
        if now - self._checked_at < CHECK_S:
            return
        self._checked_at = now
        own = {rank: per_step for rank in self._beats.by_rank if (per_step := self._own_per_step(rank)) is not None}
        if len(own) < 2:
            return
        excess = {rank: mine - statistics.median(t for r, (t, _) in own.items() if r != rank)
                  for rank, (mine, _) in own.items()}
        worst = max(excess.values())
        for rank, (mine, data) in own.items():
            others = mine - excess[rank]
            # the ranks the others wait for: far above them, and near the slowest (a rank 10 ms above ranks that do
            # nothing but wait for one 100 ms behind is not what holds them up)
            behind = mine > self.factor * others and excess[rank] > MIN_EXCESS_S
            if behind and excess[rank] >= worst * NEAR_WORST:
                if rank not in self._named:
                    self._named.add(rank)
                    self._say(rank, mine, data, others, own, status)
            elif not behind:  # the episode ends once it is back within the factor, not when another is slower
                self._named.discard(rank)

    def _own_per_step(self, rank: int):
        """(seconds of own work per step, of which waiting for data) over the last window, or None."""
        span = self._beats.span(rank, self.window, full=True)  # a whole window since its first step
        if span is None:
            return None
        (t0, first), (t1, last) = span
        steps = change(first, last, steps_source(last))
        if steps <= 0:
            return None
        waits = change(first, last, "negotiation_s", "transfer_s")
        return max(0.0, t1 - t0 - waits) / steps, max(0.0, change(first, last, "data_wait_s")) / steps

    def _say(self, rank: int, mine: float, data: float, others: float, own: dict, status) -> None:
        reg = status.by_rank().get(rank)
        host = f"host {reg.host}" if reg is not None else "an unknown host"
        gpu = f", GPU {','.join(str(g) for g in reg.gpus)}" if reg is not None and reg.gpus else ""
        extra = mine - others
        their_data = statistics.median(d for r, (_, d) in own.items() if r != rank)
        if data - their_data >= extra / 2:
            where = (f"waiting for data: {_ms(data - their_data)} more per step in sparkhvd's readers (a slow shard, "
                     "or a slow read from its host)")
        else:
            where = (f"its own compute: {_ms(extra - max(0.0, data - their_data))} more per step outside collectives "
                     "and data waits (a slower or throttled GPU, a busy host, or more work on that rank)")
        times = f"{mine / others:.1f}x" if others >= 0.001 else "theirs under 1 ms"
        line = (f"[sparkhvd] run {self.run_id}: rank {rank} ({host}{gpu}) is a straggler: {_ms(mine)} of its own work "
                f"per step against {_ms(others)} on the other ranks (median; {times}) over the last {self.window:g} s; "
                f"the extra time is {where}. The other ranks wait for it in their collectives.")
        self.lines.append(line)
        out = self._out or sys.stdout
        out.write(line + "\n")
        out.flush()


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.0f} ms"
