"""``start_timeline`` / ``stop_timeline``: Horovod's timeline, a Chrome trace (chrome://tracing, Perfetto).

The format is Horovod's (horovod/common/timeline.cc): each op's name (``allreduce.grads``,
``allreduce.noname.3``) is a "process" of the trace; on it, ``NEGOTIATE_<KIND>`` spans from
submission until every member had submitted it (the coordinator's answer), then ``<KIND>`` from
then until ``synchronize`` finished it, its end carrying the bytes. The first record holds
``start_time_since_epoch_in_micros``; times are microseconds from it. ``mark_cycles=True`` adds
an instant ``CYCLE_START`` each time the engine carries out a batch of answers (the engine has
no fixed cycle: an answer is its cycle). Unlike Horovod, where rank 0 writes the file, every
rank writes its own (see ``start_timeline``). Nothing here imports torch; the engine calls the
hooks, which cost one global read while no timeline is recording.

Every trace a rank records (``HOROVOD_TIMELINE`` on the driver has its ranks record one from hvd.init(), in memory:
``SPARKHVD_TIMELINE``) is also kept (``_common/traces.py``), and the rank sends them to the driver as it ends
(runner/_rank/worker.py); the driver merges every rank's into one trace (runner/_service/timeline.py). The waits of
the training loop on sparkhvd's readers are spans ``DATA_WAIT`` of a "process" ``data``.
"""

from __future__ import annotations

import json
import os
import threading
import time

from ..._common import metrics as _metrics
from ..._common import traces as _traces

#: the most events one trace holds (about 200 bytes each in memory): past it, nothing more is recorded, and an instant
#: ``TRUNCATED`` says so (a whole run under HOROVOD_TIMELINE stays within about 200 MB per rank)
MAX_EVENTS = 1_000_000
_lock = threading.Lock()
_events: list | None = None  # the trace while recording, else None
_path: str | None = None
_pids: dict = {}  # op name -> its "process" number in the trace
_origin_us = 0.0  # perf_counter microseconds at start_timeline
_mark_cycles = False
_ready: dict = {}  # op name -> (wall clock microseconds, whose clock): when the op's last request came (``ready``)


def start_timeline(file_path: str | None, mark_cycles: bool = False, rank: int = 0) -> None:
    """Record this rank's collectives until ``stop_timeline``.

    Rank 0 writes ``file_path``; rank r > 0 writes ``file_path`` with ``.rank<r>`` before the
    extension (``trace.json`` -> ``trace.rank1.json``), so ranks that pass the same path do
    not overwrite each other. ``None``: the trace is kept in memory only (``segments``).
    """
    global _events, _path, _origin_us, _mark_cycles
    if file_path is not None:
        directory = os.path.dirname(os.path.abspath(file_path))
        if not os.path.isdir(directory):
            raise ValueError(f"start_timeline: the folder {directory} does not exist; create it or pick another "
                             "path.")
        if rank:
            root, ext = os.path.splitext(file_path)
            file_path = f"{root}.rank{rank}{ext}"
    with _lock:
        # a timeline recording already (HOROVOD_TIMELINE's) ends here: it stays a segment of its own
        _origin_us, _mark_cycles = time.perf_counter() * 1e6, mark_cycles
        _pids.clear()
        _ready.clear()
        start_us = int(time.time() * 1e6)
        _events = [{"name": "process_name", "ph": "M", "pid": 0,
                    "args": {"start_time_since_epoch_in_micros": start_us}},
                   {"name": "process_sort_index", "ph": "M", "pid": 0, "args": {"sort_index": 0}}]
        _traces.keep({"start_us": start_us, "events": _events})
        _path = file_path
        _metrics.TIMELINE = data_wait


def stop_timeline() -> None:
    """Stop recording and write the trace (a JSON list of Chrome trace events)."""
    global _events, _path
    with _lock:
        events, path, _events, _path = _events, _path, None, None
        _metrics.TIMELINE = None
    if path is not None:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(events, f)


def data_wait(seconds: float) -> None:
    """The training loop waited ``seconds`` on sparkhvd's readers, ending now (``_common/metrics.loader_waited``)."""
    if _events is not None:
        end_us = now_us()
        _add("data", {"ph": "B", "name": "DATA_WAIT"}, end_us - seconds * 1e6)
        _add("data", {"ph": "E"}, end_us)


def recording() -> bool:
    return _events is not None


def now_us() -> float:
    return time.perf_counter() * 1e6


def wall_us() -> float:
    return time.time() * 1e6


def ready(op_name: str, at_wall_us: float, clock_rank: int) -> None:
    """The op's last request reached its coordinator at ``at_wall_us`` on rank ``clock_rank``'s wall clock: its
    NEGOTIATE span's end says so (``ready_us``, ``ready_clock``), for the merged trace to split it there into the
    wait for the peers and the negotiation proper (runner/_service/timeline.py)."""
    if _events is not None:
        with _lock:
            _ready[op_name] = (round(at_wall_us), clock_rank)


def _add(op_name: str, event: dict, at_us: float) -> None:
    with _lock:
        if _events is None:
            return
        if len(_events) >= MAX_EVENTS:  # a trace kept in memory does not grow without end: it stops, marked once
            if _events[-1].get("name") != "TRUNCATED":
                _events.append({"ph": "i", "name": "TRUNCATED", "ts": round(at_us - _origin_us, 3), "pid": 0, "s": "g",
                                "args": {"events": MAX_EVENTS}})
            return
        pid = _pids.get(op_name)
        if pid is None:
            pid = _pids[op_name] = len(_pids) + 1
            _events.append({"name": "process_name", "ph": "M", "pid": pid, "args": {"name": op_name}})
            _events.append({"name": "process_sort_index", "ph": "M", "pid": pid, "args": {"sort_index": pid}})
        event.update(ts=round(at_us - _origin_us, 3), pid=pid)
        _events.append(event)


def negotiate_start(op_name: str, kind: str, at_us: float) -> None:
    if _events is not None:
        _add(op_name, {"ph": "B", "name": f"NEGOTIATE_{kind.upper()}"}, at_us)


def negotiate_end(op_name: str, kind: str) -> None:
    """The op is agreed (or failed): its negotiation ends and its data phase begins."""
    if _events is not None:
        at = now_us()
        with _lock:
            came = _ready.pop(op_name, None)
        _add(op_name, {"ph": "E"} if came is None else {"ph": "E", "args": {"ready_us": came[0], "ready_clock": came[1]}},
             at)
        _add(op_name, {"ph": "B", "name": kind.upper()}, at)


def end(op_name: str, nbytes: int) -> None:
    """``synchronize`` finished the op."""
    if _events is not None:
        _add(op_name, {"ph": "E", "args": {"bytes": nbytes}}, now_us())


def cycle() -> None:
    """The engine carried out a batch of answers (``mark_cycles``)."""
    if _events is not None and _mark_cycles:
        with _lock:
            if _events is not None:
                _events.append({"ph": "i", "name": "CYCLE_START", "ts": round(now_us() - _origin_us, 3), "pid": 0,
                                "s": "g"})
