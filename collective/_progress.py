"""Which collectives this process is waiting in: the rank's side of the stall report.

A collective registers while it waits on its peers (the control exchange before each op, and
the wait for an op's data) and leaves when the wait is over; finished waits are counted. The
worker's heartbeat (``runner/_heartbeat.py``) sends ``snapshot()`` to the driver, which
prints the stall report (``runner/_stall.py``). Nothing here sends anything or imports torch.

``begin_check``/``begin_data``/``end`` are on every collective's path, so they do no more than
a clock read, a dict insert and pop and a counter. Any thread may call them; ``snapshot`` may
run in another thread at the same time.
"""

from __future__ import annotations

import itertools
import threading
import time

CHECK = "check"  # waiting for every member's control frame: has everyone reached this op?
DATA = "data"  # every member passed the check; waiting for the op's data transfer

_in_flight: dict = {}  # id(entry) -> entry: [kind, name, ranks, link id, seq, phase, since, mesh]
_seq: dict = {}  # link id -> a count of the control exchanges started on that set (alike on every member)
_completed = 0  # finished waits, of either phase
_last = None  # the latest finished entry (its "since" then holds when it finished)
_current = threading.local()  # .op: (kind, name, ranks, link id, seq) of this thread's latest check


def begin_check(kind: str, name, ranks, link_id: int) -> list:
    """A control exchange of ``kind`` on the set ``ranks`` (None: every rank) starts waiting;
    returns the entry to pass to ``attach`` and ``end``."""
    counter = _seq.get(link_id) or _seq.setdefault(link_id, itertools.count(1))
    seq = next(counter)  # atomic under the GIL: two threads on one set never take the same number
    _current.op = (kind, name, ranks, link_id, seq)
    entry = [kind, name, ranks, link_id, seq, CHECK, time.monotonic(), None]
    _in_flight[id(entry)] = entry
    return entry


def attach(entry: list, mesh) -> None:
    """The exchange's control links (made by now): the snapshot asks them whose frames are missing."""
    entry[7] = mesh


def take_op():
    """This thread's latest checked op, for the data wait that follows it; None once taken, so an op
    whose check did not run (``SPARKHVD_CHECK_COLLECTIVES=0``) is not taken for an older one."""
    op = getattr(_current, "op", None)
    _current.op = None
    return op


def current_op():
    """This thread's latest checked op, left in place: for an op that waits for data twice (sizes
    first, then the data) and leaves ``take_op`` to the second wait."""
    return getattr(_current, "op", None)


def begin_data(op, kind: str, name) -> list:
    """The wait for the data of ``op`` (from ``take_op``, when the op started; None: unknown) starts."""
    if op is None:
        entry = [kind, name, None, -1, 0, DATA, time.monotonic(), None]
    else:
        entry = [kind, name if name is not None else op[1], op[2], op[3], op[4], DATA, time.monotonic(), None]
    _in_flight[id(entry)] = entry
    return entry


def end(entry: list) -> None:
    """The wait is over (done or failed)."""
    global _completed, _last
    _in_flight.pop(id(entry), None)
    _completed += 1  # a lost increment under threads only delays the count: it still moves
    entry[6] = time.monotonic()  # from now on: when it finished (it is out of _in_flight)
    _last = entry


def completed() -> int:
    return _completed


def snapshot(limit: int = 32) -> dict:
    """This process's collectives now: ``done`` (finished waits), ``ops`` (in flight, oldest first,
    with their age in seconds) and ``last`` (the latest finished: kind, name, seconds ago)."""
    now = time.monotonic()
    for _ in range(3):
        try:
            entries = sorted(list(_in_flight.values()), key=lambda e: e[6])
            break
        except RuntimeError:  # the dict changed size under us (another thread): read it again
            entries = []
    ops = []
    for kind, name, ranks, link_id, seq, phase, since, mesh in entries[:limit]:
        op = {"kind": str(kind)[:200], "name": None if name is None else str(name)[:200],
              "set": None if ranks is None else list(ranks), "link": link_id, "seq": seq,
              "phase": phase, "age": round(now - since, 3)}
        missing = _missing(mesh)
        if missing is not None:
            op["waiting_for"] = missing
        ops.append(op)
    last = _last
    return {"done": _completed, "ops": ops,
            "last": None if last is None else {"kind": str(last[0])[:200],
                                               "name": None if last[1] is None else str(last[1])[:200],
                                               "ago": round(now - last[6], 3), "phase": last[5]}}


def _missing(mesh):
    """The members whose frames the exchange still waits for, if its links say."""
    waiting_for = getattr(mesh, "waiting_for", None)
    if waiting_for is None:
        return None
    try:
        return waiting_for()
    except Exception:  # noqa: BLE001 - a diagnostic: never fail the heartbeat over it
        return None
