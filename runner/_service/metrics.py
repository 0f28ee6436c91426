"""Every rank's metrics over one run, as its heartbeats bring them (``_common/metrics.py`` counts them in the rank):
what ``RunResult.metrics`` gives back.

Each beat's totals are kept with the attempt and the time they arrived, up to ``MAX_POINTS`` per rank: past it,
every other point of that rank is dropped, so a long run keeps its whole span at a coarser grain. ``series`` turns
them into plain rows per rank: the totals, ``steps`` (the rank's optimizer steps where it made any, else its
``hvd.elastic`` commits, else its finished collectives) and the rates since the rank's previous row of the same
attempt, over the rank's own clock (``clock_s``).
"""

from __future__ import annotations

import threading
import time

MAX_POINTS = 2048  # per rank
#: the totals whose rate per second ``series`` adds (``<name>_per_s``); the seconds' rates are shares of wall time
RATES = ("steps", "negotiation_s", "transfer_s", "data_wait_s", "cpu_s")


class MetricsLog:
    """The run's metrics points; ``record`` is the driver service's ``on_metrics``. Thread-safe."""

    def __init__(self, started: float | None = None, sink=None):
        self.started = time.monotonic() if started is None else started
        self.sink = sink  # (rank, row) -> None: each new point's row as ``series`` makes it (the MLflow writer)
        self._points: dict = {}  # rank -> [(attempt, at, metrics)]
        self._lock = threading.Lock()

    def record(self, rank: int, attempt: int, metrics: dict | None, at: float | None = None) -> None:
        if not isinstance(metrics, dict):
            return
        at = time.monotonic() if at is None else at
        with self._lock:
            points = self._points.setdefault(rank, [])
            points.append((attempt, at, dict(metrics)))
            if len(points) > MAX_POINTS:
                points[:] = points[::2] + ([points[-1]] if len(points) % 2 == 0 else [])
            latest = points[-2:] if self.sink is not None else None
        if latest:
            self.sink(rank, _rows(latest, self.started)[-1])

    def points(self) -> list:
        """``(rank, attempt, at, metrics)`` of every point, for another log to take (runner/_policy/hosted.py)."""
        with self._lock:
            return [(rank, a, at, m) for rank, points in self._points.items() for a, at, m in points]

    def series(self) -> dict:
        """``{rank: [row, ...]}``: each row the point's totals, ``t`` (seconds since the run started), ``attempt``,
        ``steps``, and ``<total>_per_s`` since the rank's previous row of the same attempt (None in its first)."""
        with self._lock:
            points = {rank: list(p) for rank, p in self._points.items()}
        return {rank: _rows(p, self.started) for rank, p in sorted(points.items())}


def steps_source(last: dict) -> str:
    """Which count is the rank's steps: its optimizer steps where it made any, else its commits, else its
    collectives."""
    for name in ("optimizer_steps", "commits"):
        if last.get(name):
            return name
    return "collectives"


def own_clock(metrics: dict, arrived: float) -> float:
    """When a beat was taken, on its rank's own clock (``clock_s``) where it sends one, else when it arrived."""
    clock = metrics.get("clock_s")
    return clock if isinstance(clock, (int, float)) else arrived


def change(first: dict, last: dict, *names: str) -> float:
    """How much the totals ``names`` grew from one beat's metrics to a later one's."""
    return sum((last.get(n) or 0) - (first.get(n) or 0) for n in names)


class Beats:
    """Each rank's latest heartbeats over about the last ``keep`` seconds of its own clock, from ``RunStatus.progress``
    on each poll: what the live view's rates and the straggler check read (``span``)."""

    def __init__(self, keep: float):
        self.keep = keep
        self.by_rank: dict = {}  # rank -> [(clock, metrics)], oldest first

    def update(self, progress) -> None:
        for rank, (meta, at) in progress.items():
            metrics = meta.get("metrics") if isinstance(meta, dict) else None
            if not isinstance(metrics, dict):
                continue  # SPARKHVD_METRICS=0 in that rank
            clock = own_clock(metrics, at)
            history = self.by_rank.setdefault(rank, [])
            if history and history[-1][0] >= clock:
                continue  # the beat already seen (or one of a rank's earlier process: a restart)
            history.append((clock, metrics))
            while len(history) > 2 and history[1][0] <= clock - self.keep:
                history.pop(0)

    def clear(self) -> None:
        """A new attempt: its ranks' clocks and totals start again."""
        self.by_rank.clear()

    def span(self, rank: int, window: float, full: bool = False) -> tuple | None:
        """The rank's ``(first, last)`` beats, as ``(clock, metrics)``, over about the last ``window`` seconds since
        it made its first step (its start-up, imports and ``hvd.init``, is not in a rate of steps): ``first`` the
        latest beat at least ``window`` before ``last``, or (unless ``full``) the oldest kept. None where there is
        no such pair."""
        history = self.by_rank.get(rank) or []
        if len(history) < 2:
            return None
        last = history[-1]
        source = steps_source(last[1])
        stepping = [point for point in history if point[1].get(source)]
        points = stepping if len(stepping) >= 2 else [] if full else history
        older = [point for point in points[:-1] if point[0] <= last[0] - window]
        first = older[-1] if older else None if full else points[0] if points else None
        if first is None or first[0] >= last[0]:
            return None
        return first, last


def _rows(points: list, started: float) -> list:
    source = steps_source(points[-1][2])
    rows, previous = [], None
    for attempt, at, metrics in points:
        row = {"t": round(at - started, 3), "attempt": attempt, **metrics, "steps": metrics.get(source) or 0}
        elapsed = None
        if previous is not None and previous["attempt"] == attempt:
            clocks = (row.get("clock_s"), previous.get("clock_s"))  # the rank's own clock, where it sends one
            elapsed = (clocks[0] - clocks[1] if all(isinstance(c, (int, float)) for c in clocks)
                       else row["t"] - previous["t"])
        for name in RATES:
            rate = None
            if elapsed and elapsed > 0 and isinstance(row.get(name), (int, float)) \
                    and isinstance(previous.get(name), (int, float)):
                rate = round((row[name] - previous[name]) / elapsed, 6)
            row[f"{name}_per_s"] = rate
        rows.append(row)
        previous = row
    return rows
