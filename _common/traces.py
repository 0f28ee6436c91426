"""The timeline traces this process recorded (collective/_engine/timeline.py keeps each here as it starts), for the
rank to send the driver as it ends (runner/_rank/worker.py), which merges every rank's (runner/_service/timeline.py).
Here because the engine and the rank's runner meet only in this bottom layer."""

from __future__ import annotations

import threading

_lock = threading.Lock()
_segments: list = []  # {"start_us": this host's wall clock at the trace's start, µs since the epoch, "events": [...]}


def keep(segment: dict) -> None:
    """A trace that starts now; its ``events`` list grows while it records."""
    with _lock:
        _segments.append(segment)


def recorded() -> list:
    """Every trace kept so far, each with a copy of its events."""
    with _lock:
        return [{"start_us": s["start_us"], "events": list(s["events"])} for s in _segments]
