"""``start_timeline`` / ``stop_timeline``: a Chrome trace (chrome://tracing, Perfetto) of the ops.

Each collective becomes one complete event: its kind and name, when it was started and when
``synchronize`` finished it (for blocking ops: the call), and the bytes it carried, on a
track per rank.
"""

from __future__ import annotations

import json
import os
import threading
import time

_lock = threading.Lock()
_events: list | None = None
_path: str | None = None


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Record every collective of this rank until ``stop_timeline``.

    Rank 0 writes ``file_path``; rank r > 0 writes ``file_path`` with ``.rank<r>`` before the
    extension (``trace.json`` -> ``trace.rank1.json``), so ranks that pass the same path do
    not overwrite each other. ``mark_cycles`` is accepted for Horovod compatibility.
    """
    global _events, _path
    directory = os.path.dirname(os.path.abspath(file_path))
    if not os.path.isdir(directory):
        raise ValueError(f"start_timeline: the folder {directory} does not exist; create it or pick another path.")
    from .. import _engine

    rank = _engine.topology().rank if _engine.is_initialized() else 0
    if rank:
        root, ext = os.path.splitext(file_path)
        file_path = f"{root}.rank{rank}{ext}"
    with _lock:
        _events, _path = [], file_path


def stop_timeline() -> None:
    """Stop recording and write the trace (a JSON list of Chrome trace events)."""
    global _events, _path
    with _lock:
        events, path, _events, _path = _events, _path, None, None
    if path is not None:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(events, f)


def now_us() -> float:
    return time.perf_counter() * 1e6


def record(kind: str, name: str | None, start_us: float, nbytes: int) -> None:
    """Add one finished op (no-op unless a timeline is recording)."""
    if _events is None:
        return
    from .. import _engine

    rank = _engine.topology().rank if _engine.is_initialized() else 0
    event = {"name": f"{kind} {name}" if name else kind, "ph": "X", "ts": start_us, "dur": now_us() - start_us,
             "pid": rank, "tid": 0, "args": {"bytes": nbytes}}
    with _lock:
        if _events is not None:
            _events.append(event)
