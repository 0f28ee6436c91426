"""Stalls and lost ranks, seen from the driver: the settings and the report (pure logic).

Every rank sends a heartbeat (``_rank/heartbeat.py``) with the collectives it waits in. The supervision
(``_policy/supervise.py``) calls ``StallInspector.check`` (``_policy/stall_inspector.py``) on each poll, which

- prints the stall report to the driver's stderr once no rank has completed a collective for
  ``HOROVOD_STALL_CHECK_TIME_SECONDS`` while some rank waits in one, or while a rank is still
  running that long after the others returned; again after twice that, four times, ...;
- fails the run with that report as the headline once the stall has lasted
  ``HOROVOD_STALL_SHUTDOWN_TIME_SECONDS`` (0, the default: never);
- fails the run when a rank that should be alive has not been heard from for
  ``SPARKHVD_HEARTBEAT_TIMEOUT_SECONDS``: its host, or the network to it, is down.

Settings (named and parsed in ``_common/settings.py``; a rank reads its environment in
``_rank/heartbeat.py``, the driver in ``_policy/stall_inspector.py``): each rank sends the values of the
``FORWARDED_SETTINGS`` its own environment sets with every heartbeat, and those take precedence (the
lowest such rank's); otherwise the driver's environment, otherwise the default. So a value in the
executors' environment (``spark.executorEnv.*``) works as it does for Horovod, and one set on the
driver works too. ``HOROVOD_STALL_CHECK_DISABLE=1`` turns the report and its shutdown off (not the
lost-rank check: ``SPARKHVD_HEARTBEAT_TIMEOUT_SECONDS=0`` does). ``SPARKHVD_HEARTBEAT_SECONDS`` is
read by each rank alone (in ``np<0`` runs the ranks inherit the driver's environment). A rank never
heard from counts from when the ranks were placed; a rank is never taken for lost before three of
its own heartbeat intervals have passed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from ..._common import settings
from ..._common.op_names import JOIN, label
from .._shared.stall_settings import FORWARDED_SETTINGS, lenient

ALIVE = ("starting", "running", "finishing")  # what a rank's heartbeat says it is doing
RETURNED, FAILED, EXITED, SILENT = "returned", "failed", "exited", "silent"  # what the driver knows instead


# ---- settings -----------------------------------------------------------------------------

@dataclass(frozen=True)
class StallSettings:
    """The stall check's settings for one run, and where each came from (for messages)."""

    check_time: float = settings.STALL_CHECK_TIME.default
    shutdown_time: float = settings.STALL_SHUTDOWN_TIME.default
    disabled: bool = settings.STALL_CHECK_DISABLE.default
    heartbeat_timeout: float = settings.HEARTBEAT_TIMEOUT.default
    origin: dict = field(default_factory=dict, compare=False)  # variable -> "rank 1's environment", ...

    @classmethod
    def resolve(cls, driver_env, rank_settings: dict):
        """``(settings, problems)`` from the driver's environment and ``{rank: {variable: value}}``
        as the ranks sent them; a rank's value wins over the driver's, the lowest rank's over others'."""
        raw, origin = {}, {}
        for name in (s.name for s in FORWARDED_SETTINGS):
            for rank in sorted(rank_settings):
                if name in (rank_settings[rank] or {}):
                    raw[name], origin[name] = rank_settings[rank][name], f"rank {rank}'s environment"
                    break
            else:
                if driver_env.get(name) is not None:
                    raw[name], origin[name] = driver_env[name], "the driver's environment"
        check, p1 = lenient(settings.STALL_CHECK_TIME, raw.get(settings.STALL_CHECK_TIME.name),
                            origin.get(settings.STALL_CHECK_TIME.name, ""))
        shutdown, p2 = lenient(settings.STALL_SHUTDOWN_TIME, raw.get(settings.STALL_SHUTDOWN_TIME.name),
                               origin.get(settings.STALL_SHUTDOWN_TIME.name, ""))
        timeout, p3 = lenient(settings.HEARTBEAT_TIMEOUT, raw.get(settings.HEARTBEAT_TIMEOUT.name),
                              origin.get(settings.HEARTBEAT_TIMEOUT.name, ""))
        disabled, p4 = lenient(settings.STALL_CHECK_DISABLE, raw.get(settings.STALL_CHECK_DISABLE.name),
                               origin.get(settings.STALL_CHECK_DISABLE.name, ""))
        problems = [p for p in (p1, p2, p3, p4) if p]
        return cls(check, shutdown, disabled, timeout, origin), problems


# ---- a frozen view of the run, and the report -----------------------------------------------

@dataclass(frozen=True)
class RankState:
    """One rank as the driver sees it now; every time is in seconds before now."""

    rank: int
    status: str  # one of ALIVE (its latest heartbeat's word), or RETURNED, FAILED, EXITED, SILENT
    host: str = ""
    ops: tuple = ()  # collectives it waits in (dicts as _common/progress.py makes them), oldest first
    last: dict | None = None  # its latest finished collective: kind, name, ago, op; passed: per set, [link, op, nth]
    heard_ago: float | None = None  # its latest heartbeat; None: never heard from
    interval: float = settings.HEARTBEAT.default
    ended_ago: float | None = None  # RETURNED or FAILED: when


@dataclass(frozen=True)
class StallView:
    """Every rank, at one moment, and how long no collective has completed."""

    np: int
    ranks: tuple  # RankState for rank 0, 1, ...
    stalled_for: float


def _ranks(ranks) -> str:
    ranks = sorted(ranks)
    return f"rank{'s' if len(ranks) > 1 else ''} {','.join(map(str, ranks))}"


def _s(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds >= 10 else f"{seconds:.1f} s"


def _op(kind, name) -> str:
    return f"{kind} {name!r}" if name else str(kind)


def _what(op: dict) -> str:
    """An op (in flight, or ``last``) as the user knows it: by its negotiated name ("allreduce 'grads'", "the
    4th unnamed allreduce") where the rank sent one, else by its kind and name ("hvd.init")."""
    full = op.get("op")
    if full and full != JOIN:
        try:
            return label(str(full))
        except ValueError:  # a name label() cannot read ("allreduce.noname.x"): the kind and name say enough
            pass
    return _op(op.get("kind"), op.get("name"))


def _set(members, np: int) -> str:
    return "all ranks" if members is None or list(members) == list(range(np)) else f"process set {list(members)}"


def _groups(view: StallView) -> list:
    """The collectives in flight, one per (set, negotiated name): [(title, members, {rank: op})], oldest
    first; members is None where the op's place is unknown (its check did not run).

    The engine pairs an op across ranks by its name, whatever order the ranks submitted it in, so the
    name is the key. Ops not negotiated by name (init's rendezvous) keep the older key, each process's
    count of checks on the set: those run in call order, so the count is alike on every member. A name
    reused each step is one key: a rank still in step k's op and one already in step k+1's share a group
    (the rare case of a cut after the coordinator answered step k; ``nth`` would tell them apart, but a
    rank whose count is unknown there would then look absent).
    """
    found: dict = {}
    for state in view.ranks:
        if state.status not in ALIVE:
            continue
        for op in state.ops:
            if op.get("op"):
                key = (op.get("link"), "op", op["op"])
            elif op.get("seq"):
                key = (op.get("link"), "seq", op["seq"])
            else:
                key = ("data", state.rank, op.get("kind"))
            entry = found.setdefault(key, {"op": op, "in": {}})
            entry["in"][state.rank] = op
            if op.get("name") and not entry["op"].get("name"):
                entry["op"] = op
    groups = []
    for key, entry in found.items():
        op = entry["op"]
        if key[0] == "data":
            groups.append((_what(op), None, entry["in"]))
            continue
        members = tuple(op["set"]) if op.get("set") is not None else tuple(range(view.np))
        groups.append((f"{_what(op)} on {_set(members, view.np)}", members, entry["in"]))
    groups.sort(key=lambda g: (-max(op["age"] for op in g[2].values()),  # oldest first; ties: earliest
                               min(op.get("seq") or 0 for op in g[2].values())))
    return groups


_STILL = {"starting": "starting (loading the training function)", "running": "running user code",
          "finishing": "sending its result"}


def doing(state: RankState, np: int, heard: bool = True) -> str:
    """What a rank that is not in a given collective is doing instead, as a clause (``heard``: say when
    its heartbeats are late)."""
    if state.status == RETURNED:
        return f"it returned {_s(state.ended_ago or 0)} ago"
    if state.status == FAILED:
        return f"it failed {_s(state.ended_ago or 0)} ago"
    if state.status == EXITED:
        return "its process has exited"
    if state.status == SILENT or state.heard_ago is None:
        return "the driver has not heard from it yet"
    if state.status == "starting":
        text = "it is still starting (loading the training function)"
    elif state.status == "finishing":
        text = "it has returned from the training function and is sending its result"
    elif state.ops:
        op = state.ops[0]
        where = f" on {_set(op.get('set'), np)}" if op.get("op") or op.get("seq") else ""
        text = f"it waits in {_what(op)}{where}, for {_s(op['age'])}"
    elif state.last:
        text = f"it is running user code (its latest collective, {_what(state.last)}, {_finished(state.last)})"
    else:
        text = "it is running user code (it has not called a collective yet)"
    if heard and state.heard_ago > 2 * state.interval + 1:
        text += f" (not heard from for {_s(state.heard_ago)})"
    return text


def _finished(last: dict) -> str:
    """When a rank's latest collective finished: "finished 3.0 s ago", or "has finished" where its rank cannot tell
    (torch.distributed's, counted by the flight recorder without a time)."""
    return "has finished" if last.get("ago") is None else f"finished {_s(last['ago'])} ago"


def _hosts(states) -> str:
    hosts = sorted({s.host for s in states if s.host})
    return f"host{'s' if len(hosts) > 1 else ''} {', '.join(hosts)}" if hosts else "their hosts"


def report(view: StallView, stall: StallSettings) -> tuple[str, list]:
    """``(headline, lines)``: which ranks wait in which collective and what the others do instead."""
    by_rank = {s.rank: s for s in view.ranks}
    groups = _groups(view)
    said = [_group_line(title, members, in_it, by_rank, view.np) for title, members, in_it in groups]
    lines = [line.text for line in said]
    returned = [s for s in view.ranks if s.status == RETURNED]
    grouped = {r for _, members, in_it in groups for r in in_it}
    late = [s for s in view.ranks if s.status in ALIVE and s.rank not in grouped]
    since = _s(min(s.ended_ago or 0 for s in returned)) if returned else ""
    if returned and late:
        lines += _still_running(late, returned, since)
    headline = _headline(view, stall, groups, late, returned, since)
    # behind a cut, ranks lag because of it, not their own code
    if any(line.missing for line in said) and not any(line.cut for line in said):
        lines.append("Every rank of a process set must call the same collectives in the same order: look at what "
                     "the ranks that have not reached it do instead (their output is in the log files named below).")
    if returned and late:
        lines.append("A rank still running after the others returned is stuck, or does work the others do not "
                     "wait for: look at its output (in the log files named below).")
    lines.append(_fix(stall))
    return headline, lines


class _GroupLine(NamedTuple):
    """One collective's line of the report, and what it found."""

    text: str
    missing: bool = False  # some member has not reached it while others wait in its check
    cut: bool = False  # every absent member has passed it: the ranks still in it do not receive its frames


def _group_line(title: str, members, in_it: dict, by_rank: dict, np: int) -> _GroupLine:
    """The line for the collective ``title`` that the ranks ``in_it`` wait in: who waits in its check, who
    waits for its data, who has passed it, who has not reached it, and, when only the network is left, where
    it is cut."""
    checking = sorted(r for r, op in in_it.items() if op.get("phase") != "data")
    passed = sorted(r for r, op in in_it.items() if op.get("phase") == "data")
    parts = []
    if checking:
        parts.append(f"{_ranks(checking)} {'has' if len(checking) == 1 else 'have'} waited in it for "
                     f"{_s(max(in_it[r]['age'] for r in checking))}")
    if passed and members is None:
        parts.append(f"{_ranks(passed)} {'waits' if len(passed) == 1 else 'wait'} for its data for "
                     f"{_s(max(in_it[r]['age'] for r in passed))} (an op of a process set of one, so no other rank "
                     "takes part in it: its own device or library does not finish it)")
        return _GroupLine(f"- {title}: " + "; ".join(parts) + ".")
    if passed:
        parts.append(f"{_ranks(passed)} passed its check and {'waits' if len(passed) == 1 else 'wait'} for its "
                     f"data for {_s(max(in_it[r]['age'] for r in passed))}")
    absent = [r for r in members if r not in in_it and r in by_rank]
    ahead = [r for r in absent if _ahead(by_rank[r], in_it)]
    if ahead:  # they sent their frames and moved on: the ranks still in it do not receive them
        absent = [r for r in absent if r not in ahead]
        parts += _passed_it(ahead, in_it, by_rank, np)
        if not absent and checking:
            parts.append(_network(members, in_it, by_rank, passed=True))
            return _GroupLine(f"- {title}: " + "; ".join(parts) + ".", cut=True)
    parts += _not_reached(absent, bool(checking), by_rank, np)
    # The absent ranks finished its data (not just its check, then user code such as pickling the object):
    finished = all((by_rank[r].last or {}).get("phase") == "data" for r in absent)
    missing = bool(absent and checking)
    if not missing and (not absent or finished):  # every member reached it or is done with it: only the network
        parts.append(_network(members, in_it, by_rank))
    return _GroupLine(f"- {title}: " + "; ".join(parts) + ".", missing=missing)


def _passed_it(ahead: list, in_it: dict, by_rank: dict, np: int) -> list:
    """A clause per place the ranks ``ahead`` (members that have passed the collective) are now: a later op
    on the set, or what they do instead."""
    link = next(iter(in_it.values())).get("link")
    by_next: dict = {}
    for r in ahead:
        nxt = next((op for op in by_rank[r].ops if op.get("link") == link), None)
        key = ("in", _what(nxt)) if nxt is not None else ("doing", doing(by_rank[r], np))
        by_next.setdefault(key, []).append(r)
    parts = []
    for (how, what), ranks in by_next.items():
        one = len(ranks) == 1
        parts.append(f"{_ranks(ranks)} {'has' if one else 'have'} passed it" +
                     (f" and {'waits' if one else 'wait'} in {what}" if how == "in" else f": {what}"))
    return parts


def _not_reached(absent: list, checking: bool, by_rank: dict, np: int) -> list:
    """A clause per thing the members ``absent`` from the collective do instead (``checking``: some rank
    still waits in its check, so they have not reached it; else every member has passed the check)."""
    by_doing: dict = {}
    for r in absent:
        by_doing.setdefault(doing(by_rank[r], np), []).append(r)
    if checking:
        return [f"{_ranks(ranks)} {'has' if len(ranks) == 1 else 'have'} not reached it: {what}"
                for what, ranks in by_doing.items()]
    return [f"{_ranks(ranks)} passed its check too: {what}" for what, ranks in by_doing.items()]


def _still_running(late: list, returned: list, since: str) -> list:
    """A line per rank still running (``late``) after the ranks ``returned`` returned."""
    lines = []
    for s in late:
        text = (f"- rank {s.rank} is still {_STILL.get(s.status, 'running')} {since} after "
                f"{_ranks(r.rank for r in returned)} returned")
        if s.status == "running" and s.last:
            text += f"; its latest collective, {_what(s.last)}, {_finished(s.last)}"
        elif s.status == "running":
            text += "; it has not called a collective"
        lines.append(text + ".")
    return lines


def _headline(view: StallView, stall: StallSettings, groups: list, late: list, returned: list, since: str) -> str:
    """The report's first sentence: how long no collective has completed, or which ranks are still running."""
    check = f"{settings.STALL_CHECK_TIME.name}={stall.check_time:g}"
    if groups:
        return (f"no collective has completed for {_s(view.stalled_for)} while ranks wait in "
                f"{'one' if len(groups) == 1 else len(groups)} ({check}):")
    return (f"{_ranks(s.rank for s in late)} {'is' if len(late) == 1 else 'are'} still running {since} after "
            f"{_ranks(s.rank for s in returned)} returned ({check}):")


def _fix(stall: StallSettings) -> str:
    """The report's last line: the settings that quiet the report or end the run."""
    shutdown = settings.STALL_SHUTDOWN_TIME.name
    fix = (f"If the wait is expected, raise {settings.STALL_CHECK_TIME.name} or set "
           f"{settings.STALL_CHECK_DISABLE.name}=1")
    if stall.shutdown_time > 0:
        return fix + f"; the run fails once it has stalled for {stall.shutdown_time:g} s ({shutdown})."
    return fix + f"; set {shutdown} to fail the run after a stall of that many seconds."


def _ahead(state: RankState, in_it: dict) -> bool:
    """Whether ``state``'s rank, absent from the collective the ranks ``in_it`` wait in, has passed it.

    ``seq`` cannot say so any more: it counts each process's checks in the order that process submitted
    them, and ranks may submit named ops in different orders, so a higher seq on another rank is not a
    later op. What does say so: the rank's latest finished negotiated op on that set (``last``'s
    ``passed``) is this very name, and the same time it runs there (``nth``, alike on every member; the
    ranks in it must agree on it, and init's rendezvous, with no name, is never claimed passed). A rank
    that went on to finish another op on the set since is not recognised: it is reported as not having
    reached it, with what it does instead, which names where it is.
    """
    refs = list(in_it.values())
    link, name, nth = refs[0].get("link"), refs[0].get("op"), refs[0].get("nth")
    if not name or nth is None or any((op.get("link"), op.get("op"), op.get("nth")) != (link, name, nth)
                                      for op in refs):
        return False
    for item in (state.last or {}).get("passed") or ():
        if isinstance(item, (list, tuple)) and len(item) == 3 and item[0] == link:
            return item[1] == name and item[2] == nth
    return False


def _network(members, in_it: dict, by_rank: dict, passed: bool = False) -> str:
    """Every member has reached the collective (``passed``: some have even left it), and it still does
    not finish: say where the links are cut."""
    reached = "every other member has passed it" if passed else "every member has reached it"
    states = [by_rank[r] for r in members if r in by_rank]
    waits = {r: tuple(op.get("waiting_for") or ()) for r, op in in_it.items() if op.get("phase") != "data"}
    waits = {r: w for r, w in waits.items() if w}
    if waits:
        by_wait: dict = {}
        for r, w in waits.items():
            by_wait.setdefault(w, []).append(r)
        told = "; ".join(f"{_ranks(ranks)} ({_hosts([by_rank[r] for r in ranks if r in by_rank])}) still "
                         f"{'waits' if len(ranks) == 1 else 'wait'} for the control frames of {_ranks(w)} "
                         f"({_hosts([by_rank[r] for r in w if r in by_rank])})" for w, ranks in by_wait.items())
        return (f"{reached}, yet {told}: those frames were sent and do not arrive, so the network "
                f"between these hosts is cut or dropping packets while each still reaches the driver; check the "
                "routes and firewalls between them")
    if any(op.get("phase") != "data" for op in in_it.values()):
        return (f"{reached}, yet its control exchange does not complete: the network between "
                f"{_hosts(states)} is cut or dropping packets while each still reaches the driver; check the routes "
                "and firewalls between them")
    return (f"every member has reached it, yet its data transfer does not complete: the network between "
            f"{_hosts(states)} is cut or dropping packets while each still reaches the driver; check the routes and "
            "firewalls between them")
