"""One timeline for the whole run: every rank's Horovod timeline traces, merged into one Chrome/Perfetto trace.

Each rank sends the traces it recorded as it ends (a TIMELINE frame: runner/_rank/worker.py), under
``HOROVOD_TIMELINE`` on the driver (its ranks record from ``hvd.init()``) or where the function called
``hvd.start_timeline``. The driver keeps them with the offset of the rank's wall clock from its own, which the rank
measured with round trips to the driver (``worker.clock_offset``: within half the shortest trip, which the trace's
``otherData`` lists per rank). At the run's end, success or failure, ``write`` puts them in one trace: a process per
rank named with its host and GPU, each of the rank's ops (and its data waits) a thread of it, every time on the
driver's clock from the earliest trace's start; the restarts are instants of a ``driver`` process.

Each collective has its three phases: ``NEGOTIATE_<KIND>`` from the rank's submission to the coordinator's answer,
inside it ``WAIT_FOR_PEERS`` until the op's last request reached the coordinator (the answer's ``ready_us``, on the
coordinator's clock, put on the driver's with the coordinator's offset), and ``<KIND>``, the transfer, until
``synchronize`` finished it.
"""

from __future__ import annotations

import json
import threading
import time

DRIVER_PID = 0


class TimelineLog:
    """The ranks' traces over a run; ``record`` is the driver service's ``on_timeline``. Thread-safe."""

    def __init__(self):
        self._parts: list = []
        self._lock = threading.Lock()

    def record(self, rank: int, attempt: int, segments: list, offset_us: float, host: str | None = None,
               gpus: tuple = (), error_us: float = 0) -> None:
        kept = [s for s in segments if isinstance(s, dict) and isinstance(s.get("start_us"), (int, float))
                and isinstance(s.get("events"), list)]
        if kept:
            with self._lock:
                self._parts.append({"rank": rank, "attempt": attempt, "segments": kept, "offset_us": offset_us,
                                    "host": host, "gpus": tuple(gpus), "error_us": error_us})

    def __bool__(self) -> bool:
        with self._lock:
            return bool(self._parts)

    def merged(self, run_id: str = "", restarts: tuple = ()) -> dict:
        """The run's trace (Chrome's JSON object format): ``restarts``' RestartEvents marked at their ``failed_at``."""
        with self._lock:
            parts = sorted(self._parts, key=lambda p: (p["rank"], p["attempt"]))
        starts = [s["start_us"] + p["offset_us"] for p in parts for s in p["segments"]]
        origin = min(starts) if starts else time.time() * 1e6
        offsets = {(p["rank"], p["attempt"]): p["offset_us"] for p in parts}  # whose clock a ``ready_us`` is on
        events = [{"name": "process_name", "ph": "M", "pid": DRIVER_PID, "args": {"name": "driver"}},
                  {"name": "process_sort_index", "ph": "M", "pid": DRIVER_PID, "args": {"sort_index": 0}}]
        named: set = set()
        threads: dict = {}  # (pid, op name) -> tid
        for part in parts:
            rank = part["rank"]
            pid = rank + 1
            if pid not in named:
                named.add(pid)
                where = f"host {part['host']}" if part["host"] else "host unknown"
                if part["gpus"]:
                    where += f", GPU {','.join(str(g) for g in part['gpus'])}"
                events += [{"name": "process_name", "ph": "M", "pid": pid, "args": {"name": f"rank {rank} ({where})"}},
                           {"name": "process_sort_index", "ph": "M", "pid": pid, "args": {"sort_index": pid}}]
            for segment in part["segments"]:
                shift = segment["start_us"] + part["offset_us"] - origin
                ops = {e.get("pid"): e["args"]["name"] for e in segment["events"]
                       if e.get("ph") == "M" and e.get("name") == "process_name" and "name" in (e.get("args") or {})}
                ops.setdefault(0, "cycles")  # Horovod's pid 0: the trace's own record, and CYCLE_START marks
                begun: dict = {}  # tid -> its open spans: (start, where a WAIT_FOR_PEERS inside a NEGOTIATE goes)
                for event in segment["events"]:
                    if event.get("ph") == "M" or not isinstance(event.get("ts"), (int, float)):
                        continue
                    op = ops.get(event.get("pid"), f"op {event.get('pid')}")
                    tid = threads.get((pid, op))
                    if tid is None:
                        tid = threads[(pid, op)] = len([k for k in threads if k[0] == pid]) + 1
                        events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": op}})
                    ts = round(event["ts"] + shift, 3)
                    events.append({**event, "pid": pid, "tid": tid, "ts": ts})
                    if event.get("ph") == "B":
                        negotiating = str(event.get("name", "")).startswith("NEGOTIATE_")
                        begun.setdefault(tid, []).append((ts, len(events) if negotiating else None))
                        if negotiating:
                            events.append(None)  # its WAIT_FOR_PEERS's start, once its end says where it ends
                    elif event.get("ph") == "E" and begun.get(tid):
                        start, slot = begun[tid].pop()
                        ready = None if slot is None else _ready(start, ts, event.get("args"), offsets,
                                                                 part["attempt"], origin)
                        if ready is not None:  # inside the NEGOTIATE span: its end goes before the span's
                            events[slot] = {"name": "WAIT_FOR_PEERS", "ph": "B", "pid": pid, "tid": tid, "ts": start,
                                            "args": {"coordinator": event["args"]["ready_clock"]}}
                            events.insert(len(events) - 1, {"ph": "E", "pid": pid, "tid": tid, "ts": ready})
        for event in restarts:
            at = getattr(event, "failed_at", None)
            if not at:
                continue
            wall_us = (time.time() - (time.monotonic() - at)) * 1e6
            events.append({"name": f"restart {event.attempt}: {event.kind}", "ph": "i", "s": "g", "pid": DRIVER_PID,
                           "tid": 0, "ts": round(wall_us - origin, 3), "args": {"cause": event.lost}})
        return {"traceEvents": [e for e in events if e is not None], "displayTimeUnit": "ms",
                "otherData": {"run_id": run_id, "clock": "the driver's wall clock, microseconds from the earliest "
                              "trace's start", "origin_since_epoch_in_micros": int(origin),
                              "clock_error_us": {str(p["rank"]): p["error_us"] for p in parts}}}

    def write(self, path: str, run_id: str = "", restarts: tuple = ()) -> str:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.merged(run_id, restarts), f)
        return path


def _ready(begun: float, ended: float, args, offsets: dict, attempt: int, origin: float) -> float | None:
    """Where the ``WAIT_FOR_PEERS`` inside a NEGOTIATE span from ``begun`` to ``ended`` (merged trace times) ends: when
    the op's last request reached the coordinator (the span's end's ``ready_us`` on rank ``ready_clock``'s wall
    clock), kept inside the span (the offsets' error, ``clock_error_us``, may put it a little outside); None where
    the end says nothing of it, no trace of that rank puts its clock on the driver's, or nobody was waited for."""
    if not isinstance(args, dict) or not isinstance(args.get("ready_us"), (int, float)):
        return None
    offset = offsets.get((args.get("ready_clock"), attempt))
    if offset is None:
        return None
    ready = round(min(max(args["ready_us"] + offset - origin, begun), ended), 3)
    return ready if ready > begun else None
