"""Which collectives this process is waiting in: the rank's side of the stall report.

torch.distributed's own collectives, which the function may call instead (DDP, FSDP, ``dist.all_reduce``), come
from torch's flight recorder (``torch_ops.py``) and are reported alongside.

A collective registers while it waits on its peers (the control exchange before each op, and
the wait for an op's data) and leaves when the wait is over; finished waits are counted. The
worker's heartbeat (``runner/_rank/heartbeat.py``) sends ``snapshot()`` to the driver, which
prints the stall report (``runner/_policy/stall_report.py``). Nothing here sends anything or imports torch.

An op is matched across ranks by the name the engine negotiates (``op``: "allreduce.grads",
"allreduce.noname.3", "join"), not by its place in this process's order: ranks may submit named
async ops, optimizer buckets or TensorFlow graph ops in different orders. The driver groups by it.

``begin_check``/``begin_data``/``end`` are on every collective's path, so they do no more than
a clock read, a few dict inserts and pops and a counter. Any thread may call them; ``snapshot``
may run in another thread at the same time.
"""

from __future__ import annotations

import itertools
import time

from . import metrics as _metrics
from . import torch_ops as _torch_ops
from .op_names import JOIN

CHECK = "check"  # waiting for every member's control frame: has everyone reached this op?
DATA = "data"  # every member passed the check; waiting for the op's data transfer
MAX_NAMES = 4096  # reused names counted per set; past that a new name's ``nth`` is not counted (None)

_in_flight: dict = {}  # id(entry) -> entry: [kind, name, ranks, link id, place, phase, since, mesh]
# place: (seq, op, nth). seq: this process's count of the control exchanges started on the link; it
# orders one rank's waits but differs between ranks that submit in different orders. op: the
# negotiated name, what pairs the op across ranks (None: not negotiated by name, e.g. init's
# rendezvous). nth: which time that name runs on the link (1, 2, ...), alike on every member: a
# name is in flight once at a time, so the engine pairs the k-th of a name with the k-th.
_seq: dict = {}  # link id -> a count of the control exchanges started on that set (this process's order)
_times: dict = {}  # link id -> {op: how many times that reused name was checked on the set}
_passed: dict = {}  # link id -> (op, nth) of the latest finished wait for a negotiated op on that set
_completed = 0  # finished waits, of either phase
_last = None  # the latest finished entry (its "since" then holds when it finished)


def begin_check(kind: str, name, ranks, link_id: int, op: str | None = None) -> list:
    """A control exchange of ``kind`` on the set ``ranks`` (None: every rank) starts waiting; ``op`` is
    the name the engine negotiates it by (None: none). Returns the entry to pass to ``attach`` and ``end``."""
    counter = _seq.get(link_id) or _seq.setdefault(link_id, itertools.count(1))
    seq = next(counter)  # atomic under the GIL: two threads on one set never take the same number
    place = (seq, op, _nth(link_id, op))
    entry = [kind, name, ranks, link_id, place, CHECK, time.monotonic(), None]
    _in_flight[id(entry)] = entry
    return entry


def _nth(link_id: int, op):
    """Which time ``op`` runs on the set (1, 2, ...); None where it is not counted."""
    if op is None:
        return None
    if op == JOIN:
        # A rank inside join() submits none of the ops the others go on with, so its counts fall behind
        # theirs; every member passes join together: all count afresh from here.
        _times.pop(link_id, None)
        _passed.pop(link_id, None)
        return None
    if op.split(".")[1:2] == ["noname"]:  # the engine's names for unnamed ops never repeat on a set
        return 1
    counts = _times.get(link_id) or _times.setdefault(link_id, {})
    n = counts.get(op, 0) + 1  # one name is never checked twice at once on a set: the engine refuses it
    if n == 1 and len(counts) >= MAX_NAMES:
        return None  # names made afresh each step (f"loss.{step}"): not kept, so memory stays bounded
    counts[op] = n
    return n


def attach(entry: list, mesh) -> None:
    """The exchange's control links (made by now): the snapshot asks them whose frames are missing."""
    entry[7] = mesh


def begin_data(op, kind: str, name) -> list:
    """The wait for the data of ``op`` (its check's entry[:5], from the engine's handle; None: unknown) starts."""
    if op is None:
        entry = [kind, name, None, -1, (0, None, None), DATA, time.monotonic(), None]
    else:
        entry = [kind, name if name is not None else op[1], op[2], op[3], op[4], DATA, time.monotonic(), None]
    _in_flight[id(entry)] = entry
    return entry


def end(entry: list) -> None:
    """The wait is over (done or failed)."""
    global _completed, _last
    _in_flight.pop(id(entry), None)
    _completed += 1  # a lost increment under threads only delays the count: it still moves
    now = time.monotonic()
    if _metrics.ON:
        _metrics.waited(entry[5], now - entry[6])
    entry[6] = now  # from now on: when it finished (it is out of _in_flight)
    _last = entry
    _, op, nth = entry[4]
    if op is not None:
        _passed[entry[3]] = (op, nth)


def completed() -> int:
    return _completed


def snapshot(limit: int = 32) -> dict:
    """This process's collectives now: ``done`` (finished waits), ``ops`` (in flight, oldest first,
    with their age in seconds and, where negotiated by name, ``op`` and ``nth``) and ``last`` (the
    latest finished: kind, name, seconds ago; and ``passed``: per set, ``[link, op, nth]`` of the
    latest finished negotiated op)."""
    now = time.monotonic()
    for _ in range(3):
        try:
            entries = sorted(list(_in_flight.values()), key=lambda e: e[6])
            passed = sorted(_passed.items())
            break
        except RuntimeError:  # the dict changed size under us (another thread): read it again
            entries, passed = [], []
    ops = []
    for kind, name, ranks, link_id, (seq, full, nth), phase, since, mesh in entries[:limit]:
        op = {"kind": str(kind)[:200], "name": None if name is None else str(name)[:200],
              "set": None if ranks is None else list(ranks), "link": link_id, "seq": seq,
              "phase": phase, "age": round(now - since, 3)}
        if full is not None:
            op["op"], op["nth"] = str(full)[:200], nth
        missing = _missing(mesh)
        if missing is not None:
            op["waiting_for"] = missing
        ops.append(op)
    theirs, their_done = _torch_ops.snapshot()  # torch.distributed's own collectives (DDP, FSDP, dist.*)
    ops = (ops + theirs)[:limit]
    last = _last
    if last is None and their_done:  # no sparkhvd collective yet, but torch.distributed's have finished
        return {"done": _completed + their_done, "ops": ops,
                "last": {"kind": f"torch.distributed's collective #{their_done}", "name": None, "ago": None,
                         "phase": DATA, "link": None, "op": None, "nth": None, "passed": []}}
    if last is not None:
        _, full, nth = last[4]
        last = {"kind": str(last[0])[:200], "name": None if last[1] is None else str(last[1])[:200],
                "ago": round(now - last[6], 3), "phase": last[5], "link": last[3],
                "op": None if full is None else str(full)[:200], "nth": nth,
                "passed": [[link_id, str(full)[:200], nth] for link_id, (full, nth) in passed[:limit]]}
    return {"done": _completed + their_done, "ops": ops, "last": last}


def _missing(mesh):
    """The members whose frames the exchange still waits for, if its links say."""
    waiting_for = getattr(mesh, "waiting_for", None)
    if waiting_for is None:
        return None
    try:
        return waiting_for()
    except Exception:  # noqa: BLE001 - a diagnostic: never fail the heartbeat over it
        return None
