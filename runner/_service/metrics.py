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
