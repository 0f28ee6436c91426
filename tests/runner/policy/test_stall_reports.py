"""The stall report, its shutdown, and ranks the driver stops hearing from.

The report's logic runs on frozen views (no processes); the integration tests run np=-2 (real
rank processes, real gloo) with short settings, set in the driver's environment, which the
local launcher hands to the ranks. Times are printed, not asserted.
"""

from __future__ import annotations

import io
import re
import threading
import time

import pytest

from sparkhvd import HorovodRunError, HorovodRunner
from sparkhvd._common.settings import HEARTBEAT, STALL_CHECK_DISABLE
from sparkhvd.runner._policy.stall_inspector import Observation, StallInspector
from sparkhvd.runner._policy.stall_report import RankState, StallSettings, StallView, report
from sparkhvd.runner._shared.stall_settings import lenient

SHORT = {"HOROVOD_STALL_CHECK_TIME_SECONDS": "2", "SPARKHVD_HEARTBEAT_SECONDS": "0.5"}


_NAMED = object()


def _op(kind, name=None, *, seq=1, age=62.0, phase="check", members=None, link=0, waiting_for=None, op=_NAMED,
        nth=1):
    """An op as a rank's heartbeat has it. ``op``: the name the engine negotiated it by; by default the
    one ``name`` gives (unnamed: the first of its kind), none for an unchecked op (``seq=0``); None: an
    op not negotiated by name (init's rendezvous)."""
    entry = {"kind": kind, "name": name, "set": members, "link": link, "seq": seq, "phase": phase, "age": age}
    if op is _NAMED:
        op = (f"{kind}.{name}" if name else f"{kind}.noname.0") if seq else None
    if op is not None:
        entry["op"], entry["nth"] = op, nth
    if waiting_for is not None:
        entry["waiting_for"] = waiting_for
    return entry


def _text(view, settings=StallSettings()):
    headline, lines = report(view, settings)
    return headline + "\n" + "\n".join(lines)


# ---- the report, on frozen views ----------------------------------------------------------------

@pytest.mark.unit
def test_report_names_the_waiting_ranks_and_what_the_missing_one_does():
    view = StallView(np=4, stalled_for=62.0, ranks=(
        RankState(0, "running", "a", ops=(_op("allreduce", "loss", seq=57, members=[0, 1, 2, 3]),), heard_ago=1),
        RankState(1, "running", "a", last={"kind": "broadcast", "name": None, "ago": 70.0}, heard_ago=1),
        RankState(2, "running", "b", ops=(_op("allreduce", "loss", seq=57, age=61.0, members=[0, 1, 2, 3]),),
                  heard_ago=1),
        RankState(3, "running", "b", ops=(_op("allgather", "other", seq=3, age=20.0, members=[1, 3], link=1),),
                  heard_ago=30),
    ))
    text = _text(view)
    print(text)
    assert text.startswith("no collective has completed for 62 s while ranks wait in 2 "
                           "(HOROVOD_STALL_CHECK_TIME_SECONDS=60):")
    assert ("- allreduce 'loss' on all ranks: ranks 0,2 have waited in it for 62 s; rank 1 has not "
            "reached it: it is running user code (its latest collective, broadcast, finished 70 s ago); rank 3 has "
            "not reached it: it waits in allgather 'other' on process set [1, 3], for 20 s "
            "(not heard from for 30 s).") in text
    assert "- allgather 'other' on process set [1, 3]: rank 3 has waited in it for 20 s" in text
    assert "Every rank of a process set must call the same collectives in the same order" in text
    assert ("If the wait is expected, raise HOROVOD_STALL_CHECK_TIME_SECONDS or set HOROVOD_STALL_CHECK_DISABLE=1; "
            "set HOROVOD_STALL_SHUTDOWN_TIME_SECONDS to fail the run after a stall of that many seconds.") in text


@pytest.mark.unit
def test_report_of_members_that_returned_failed_or_are_still_starting():
    view = StallView(np=7, stalled_for=12.0, ranks=(
        RankState(0, "running", ops=(_op("barrier", age=12.0),), heard_ago=0.2),
        RankState(1, "returned", ended_ago=15.0),
        RankState(2, "starting", heard_ago=0.3),
        RankState(3, "silent"),
        RankState(4, "failed", ended_ago=3.0),
        RankState(5, "exited"),
        RankState(6, "finishing", heard_ago=0.1),
    ))
    text = _text(view, StallSettings(check_time=10, shutdown_time=120))
    print(text)
    assert "rank 1 has not reached it: it returned 15 s ago" in text
    assert "rank 2 has not reached it: it is still starting (loading the training function)" in text
    assert "rank 3 has not reached it: the driver has not heard from it yet" in text
    assert "rank 4 has not reached it: it failed 3.0 s ago" in text
    assert "rank 5 has not reached it: its process has exited" in text
    assert ("rank 6 has not reached it: it has returned from the training function and is sending its result"
            in text)
    assert "the run fails once it has stalled for 120 s (HOROVOD_STALL_SHUTDOWN_TIME_SECONDS)." in text


@pytest.mark.unit
def test_report_of_a_rank_still_running_after_the_others_returned():
    view = StallView(np=4, stalled_for=61.0, ranks=(
        RankState(0, "returned", ended_ago=61.0),
        RankState(1, "running", "a", last={"kind": "allreduce", "name": "x", "ago": 65.0}, heard_ago=1),
        RankState(2, "returned", ended_ago=62.0),
        RankState(3, "returned", ended_ago=63.0),
    ))
    text = _text(view)
    print(text)
    assert text.startswith("rank 1 is still running 61 s after ranks 0,2,3 returned "
                           "(HOROVOD_STALL_CHECK_TIME_SECONDS=60):")
    assert ("- rank 1 is still running user code 61 s after ranks 0,2,3 returned; its latest collective, "
            "allreduce 'x', finished 65 s ago.") in text
    assert "A rank still running after the others returned is stuck, or does work the others do not wait for" in text


@pytest.mark.unit
def test_report_of_two_hosts_cut_off_from_each_other():
    members = [0, 1, 2, 3]
    view = StallView(np=4, stalled_for=90.0, ranks=(
        RankState(0, "running", "a", ops=(_op("allreduce", members=members, age=90, waiting_for=[2, 3]),),
                  heard_ago=1),
        RankState(1, "running", "a", ops=(_op("allreduce", members=members, age=90, waiting_for=[2, 3]),),
                  heard_ago=1),
        RankState(2, "running", "b", ops=(_op("allreduce", members=members, age=90, waiting_for=[0, 1]),),
                  heard_ago=1),
        RankState(3, "running", "b", ops=(_op("allreduce", members=members, age=89, waiting_for=[0, 1]),),
                  heard_ago=1),
    ))
    text = _text(view)
    print(text)
    assert ("every member has reached it, yet ranks 0,1 (host a) still wait for the control frames of ranks 2,3 "
            "(host b); ranks 2,3 (host b) still wait for the control frames of ranks 0,1 (host a): those frames were "
            "sent and do not arrive, so the network between these hosts is cut") in text


@pytest.mark.unit
def test_report_of_a_cut_after_one_side_passed_the_collective():
    """Measured on the cluster: ranks 0,1 got every frame of loop.0 and went on to loop.1; ranks 2,3 never
    got theirs. No rank is out of order: the "same order" hint must not appear. Ranks 0,1 say they passed
    it through their latest finished op on the set (``last``'s ``passed``), not through their seqs."""
    members = [0, 1, 2, 3]
    first = dict(members=members, seq=1521, age=13, name="loop.0")
    second = dict(members=members, seq=1522, age=13, name="loop.1")
    done = {"kind": "allreduce", "name": "loop.0", "ago": 13.5, "phase": "check", "link": 0, "op": "allreduce.loop.0",
            "nth": 1, "passed": [[0, "allreduce.loop.0", 1]]}
    view = StallView(np=4, stalled_for=13.0, ranks=(
        RankState(0, "running", "a", ops=(_op("allreduce", **second, waiting_for=[2, 3]),), last=done, heard_ago=1),
        RankState(1, "running", "a", ops=(_op("allreduce", **second, waiting_for=[2, 3]),), last=done, heard_ago=1),
        RankState(2, "running", "b", ops=(_op("allreduce", **first, waiting_for=[0, 1]),), heard_ago=1),
        RankState(3, "running", "b", ops=(_op("allreduce", **first, waiting_for=[0, 1]),), heard_ago=1),
    ))
    text = _text(view)
    print(text)
    assert ("- allreduce 'loop.0' on all ranks: ranks 2,3 have waited in it for 13 s; ranks 0,1 "
            "have passed it and wait in allreduce 'loop.1'; every other member has passed it, yet "
            "ranks 2,3 (host b) still wait for the control frames of ranks 0,1 (host a): those frames were sent and "
            "do not arrive, so the network between these hosts is cut") in text
    assert "same order" not in text


@pytest.mark.unit
def test_report_groups_named_ops_by_name_whatever_order_the_ranks_submitted_them_in():
    """Rank 0 submitted 'a' then 'b' (seqs 1, 2), rank 1 'b' then 'a' (seqs 1, 2): the engine pairs them by
    name, and so does the report; grouped by seq, it would pair rank 0's 'a' with rank 1's 'b'."""
    members = [0, 1]
    view = StallView(np=3, stalled_for=70.0, ranks=(
        RankState(0, "running", "a", ops=(_op("allreduce", "a", seq=1, age=70, members=members, link=4),
                                          _op("allreduce", "b", seq=2, age=69, members=members, link=4)),
                  heard_ago=1),
        RankState(1, "running", "b", ops=(_op("allreduce", "b", seq=1, age=68, members=members, link=4),
                                          _op("allreduce", "a", seq=2, age=67, members=members, link=4)),
                  heard_ago=1),
        RankState(2, "running", "b", ops=(_op("allgather", seq=7, age=66, op="allgather.noname.3"),), heard_ago=1),
    ))
    text = _text(view)
    print(text)
    assert text.startswith("no collective has completed for 70 s while ranks wait in 3 ")
    assert ("- allreduce 'a' on process set [0, 1]: ranks 0,1 have waited in it for 70 s; every member has reached "
            "it, yet its control exchange does not complete") in text
    assert ("- allreduce 'b' on process set [0, 1]: ranks 0,1 have waited in it for 69 s; every member has reached "
            "it, yet its control exchange does not complete") in text
    assert ("- the 4th unnamed allgather on all ranks: rank 2 has waited in it for 66 s; rank 0 has not reached it: "
            "it waits in allreduce 'a' on process set [0, 1], for 70 s; rank 1 has not reached it: it waits in "
            "allreduce 'b' on process set [0, 1], for 68 s.") in text


@pytest.mark.unit
def test_a_rank_is_said_to_have_passed_an_op_only_when_it_finished_that_very_time_of_its_name():
    """Rank 1's latest finished op on the set is 'grads' too, but the previous step's (nth 4, the others wait
    in the 5th): it has not reached this one. Were it the 5th, it would have passed it."""
    members = [0, 1]

    def view(nth):
        last = {"kind": "allreduce", "name": "grads", "ago": 80.0, "phase": "data", "link": 0,
                "op": "allreduce.grads", "nth": nth, "passed": [[0, "allreduce.grads", nth]]}
        return StallView(np=2, stalled_for=70.0, ranks=(
            RankState(0, "running", "a", ops=(_op("allreduce", "grads", seq=9, age=70, members=members, nth=5),),
                      heard_ago=1),
            RankState(1, "running", "b", last=last, heard_ago=1)))

    behind = _text(view(4))
    print(behind)
    assert ("- allreduce 'grads' on all ranks: rank 0 has waited in it for 70 s; rank 1 has not reached it: it is "
            "running user code (its latest collective, allreduce 'grads', finished 80 s ago).") in behind
    assert "same order" in behind
    passed = _text(view(5))
    print(passed)
    assert ("- allreduce 'grads' on all ranks: rank 0 has waited in it for 70 s; rank 1 has passed it: it is "
            "running user code (its latest collective, allreduce 'grads', finished 80 s ago); every other member has "
            "passed it, yet its control exchange does not complete") in passed
    assert "same order" not in passed


@pytest.mark.unit
def test_report_of_a_data_transfer_that_does_not_finish():
    view = StallView(np=2, stalled_for=70.0, ranks=(
        RankState(0, "running", "a", ops=(_op("allreduce", "g", phase="data", members=[0, 1], age=70),), heard_ago=1),
        RankState(1, "running", "b", last={"kind": "allreduce", "name": "g", "ago": 71.0, "phase": "data"},
                  heard_ago=1),
    ))
    text = _text(view)
    print(text)
    assert ("rank 0 passed its check and waits for its data for 70 s; rank 1 passed its check too: it is running "
            "user code") in text
    assert ("every member has reached it, yet its data transfer does not complete: the network between hosts a, b "
            "is cut") in text


@pytest.mark.unit
def test_report_of_a_control_exchange_that_does_not_finish_and_of_an_op_of_a_set_of_one():
    view = StallView(np=2, stalled_for=70.0, ranks=(
        RankState(0, "running", "a", ops=(_op("broadcast", members=[0, 1], age=70),), heard_ago=1),
        RankState(1, "running", "b", ops=(_op("broadcast", members=[0, 1], age=69),
                                          _op("allreduce", "u", seq=0, link=-1, phase="data", age=5)), heard_ago=1),
    ))
    text = _text(view)
    print(text)
    assert ("ranks 0,1 have waited in it for 70 s; every member has reached it, yet its control exchange does not "
            "complete: the network between hosts a, b is cut") in text
    assert ("- allreduce 'u': rank 1 waits for its data for 5.0 s (an op of a process set of one, so no other rank "
            "takes part in it: its own device or library does not finish it).") in text


@pytest.mark.unit
def test_the_rank_side_registry_snapshots_the_waits_in_flight():
    from sparkhvd._common import progress as _progress

    class Links:  # what the engine attaches (``link.Missing``): whose requests are still missing
        def waiting_for(self):
            return [3]

    done = _progress.completed()
    entry = _progress.begin_check("allreduce", "w", [0, 1, 2, 3], 7, "allreduce.w")
    _progress.attach(entry, Links())
    data = _progress.begin_data(tuple(entry[:5]), "allreduce", None)  # as the engine's handle passes it
    snap = _progress.snapshot()
    mine = [o for o in snap["ops"] if o["link"] == 7]
    assert [(o["kind"], o["name"], o["set"], o["phase"], o.get("waiting_for"), o["op"]) for o in mine] == [
        ("allreduce", "w", [0, 1, 2, 3], "check", [3], "allreduce.w"),
        ("allreduce", "w", [0, 1, 2, 3], "data", None, "allreduce.w")]
    assert mine[0]["seq"] == mine[1]["seq"] >= 1 and mine[0]["nth"] == mine[1]["nth"] >= 1
    _progress.end(data)
    _progress.end(entry)
    assert _progress.completed() == done + 2
    assert not [o for o in _progress.snapshot()["ops"] if o["link"] == 7]
    last = _progress.snapshot()["last"]
    assert (last["name"], last["op"], last["link"]) == ("w", "allreduce.w", 7)
    assert [7, "allreduce.w", mine[0]["nth"]] in last["passed"]


@pytest.mark.unit
def test_the_registry_counts_each_name_per_set_and_afresh_after_join(monkeypatch):
    """``nth``: which time a name runs on a set, alike on every member whatever the order of submission;
    the engine's unnamed names never repeat (always 1); a rank inside join() submits nothing the others
    do, so every count starts again after it; an op not negotiated by name has none; past MAX_NAMES
    names on a set, a new one is not counted (names made afresh each step would grow without bound)."""
    from sparkhvd._common import progress as _progress

    def check(kind, full, link=12):
        entry = _progress.begin_check(kind, None, [0, 1], link, full)
        _progress.end(entry)
        return entry[4][2]

    assert [check("allreduce", "allreduce.a"), check("allreduce", "allreduce.b"), check("allreduce", "allreduce.a"),
            check("allreduce", "allreduce.a", link=13)] == [1, 1, 2, 1]
    assert [check("allreduce", "allreduce.noname.0"), check("allreduce", "allreduce.noname.1")] == [1, 1]
    assert check("join", "join") is None
    assert [check("allreduce", "allreduce.a"), check("allreduce", "allreduce.a", link=13)] == [1, 2]
    assert check("hvd.init", None) is None
    assert _progress.snapshot()["last"]["op"] is None
    passed = {link: (full, nth) for link, full, nth in _progress.snapshot()["last"]["passed"]}
    assert passed[12] == ("allreduce.a", 1) and passed[13] == ("allreduce.a", 2)
    monkeypatch.setattr(_progress, "MAX_NAMES", 2)
    assert [check("allreduce", f"allreduce.step{i}", link=14) for i in range(3)] == [1, 1, None]
    assert [check("allreduce", "allreduce.step0", link=14), check("allreduce", "allreduce.step2", link=14)] == [2, None]


@pytest.mark.unit
def test_the_coordinator_says_whose_requests_a_check_still_waits_for():
    """As the engine wires it: each check is attached to ``_Missing`` over its set's ``_Link``, which on
    the coordinator asks the set's ``Table``; elsewhere it knows nothing, and the snapshot says nothing."""
    from sparkhvd._common import progress as _progress
    from sparkhvd._common.op_names import JOIN
    from sparkhvd.collective._engine.link import Link as _Link
    from sparkhvd.collective._engine.link import Missing as _Missing
    from sparkhvd.collective._engine.messages import Request

    class Broken:
        def waiting_for(self):
            raise RuntimeError("a diagnostic that fails")

    members = [0, 1, 2, 3]
    coordinator = _Link(9, members, 0, {}, members, 0, 0)
    worker = _Link(9, members, 1, {}, members, 0, 0)
    request = Request("allreduce.w", "allreduce", "float32[4]", "allreduce(float32[4])")
    entries = [_progress.begin_check("allreduce", "w", members, 9) for _ in range(3)]
    try:
        _progress.attach(entries[0], _Missing(coordinator, "allreduce.w"))
        _progress.attach(entries[1], _Missing(worker, "allreduce.w"))
        _progress.attach(entries[2], Broken())  # never fails the heartbeat: the op is reported without it

        def waiting():
            return [o.get("waiting_for", "absent") for o in _progress.snapshot()["ops"] if o["link"] == 9]

        coordinator.table.add(0, request)
        assert waiting() == [[1, 2, 3], "absent", "absent"]
        coordinator.table.add(2, request)
        coordinator.table.add(3, Request(JOIN, JOIN))  # a joined rank is not waited for
        assert waiting() == [[1], "absent", "absent"]
        coordinator.table.add(1, request)
        assert waiting() == [[], "absent", "absent"]
    finally:
        for entry in entries:
            _progress.end(entry)
    assert waiting() == []


# ---- settings -------------------------------------------------------------------------------------

@pytest.mark.unit
def test_settings_from_the_ranks_win_over_the_drivers():
    settings, problems = StallSettings.resolve(
        {"HOROVOD_STALL_CHECK_TIME_SECONDS": "30", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "100"},
        {2: {"HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "300"}, 1: {"HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "120"}})
    assert problems == []
    assert (settings.check_time, settings.shutdown_time, settings.disabled, settings.heartbeat_timeout) == (
        30, 120, False, 60)
    assert settings.origin["HOROVOD_STALL_SHUTDOWN_TIME_SECONDS"] == "rank 1's environment"
    assert settings.origin["HOROVOD_STALL_CHECK_TIME_SECONDS"] == "the driver's environment"
    assert StallSettings.resolve({"HOROVOD_STALL_CHECK_DISABLE": "1"}, {})[0].disabled


@pytest.mark.unit
def test_bad_settings_fall_back_to_the_defaults_with_a_sentence():
    settings, problems = StallSettings.resolve(
        {"HOROVOD_STALL_CHECK_TIME_SECONDS": "soon", "HOROVOD_STALL_CHECK_DISABLE": "maybe"},
        {0: {"SPARKHVD_HEARTBEAT_TIMEOUT_SECONDS": "-5", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "inf"}})
    assert (settings.check_time, settings.shutdown_time, settings.disabled, settings.heartbeat_timeout) == (
        60, 0, False, 60)
    assert problems == [
        "HOROVOD_STALL_CHECK_TIME_SECONDS='soon' in the driver's environment is not a positive number of seconds; "
        "using 60 s instead. Set it to a number such as 60.",
        "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS='inf' in rank 0's environment is not a number of seconds (0 turns it "
        "off); using 0 s instead. Set it to a number such as 60.",
        "SPARKHVD_HEARTBEAT_TIMEOUT_SECONDS='-5' in rank 0's environment is not a number of seconds (0 turns it "
        "off); using 60 s instead. Set it to a number such as 60.",
        "HOROVOD_STALL_CHECK_DISABLE='maybe' in the driver's environment is neither 1 nor 0; the stall check stays "
        "on. Set it to 1 to turn it off."]
    assert lenient(HEARTBEAT, "0", "this rank's environment") == (
        5.0, "SPARKHVD_HEARTBEAT_SECONDS='0' in this rank's environment is not a positive number of seconds; using "
             "5 s instead. Set it to a number such as 5.")
    assert lenient(STALL_CHECK_DISABLE, "true", "x") == (True, None)


@pytest.mark.unit
def test_the_inspector_warns_once_about_a_bad_driver_setting():
    with pytest.warns(RuntimeWarning, match="HOROVOD_STALL_CHECK_TIME_SECONDS='x' in the driver's environment"):
        StallInspector(np=1, run_id="r", log_dir="/logs", driver_env={"HOROVOD_STALL_CHECK_TIME_SECONDS": "x"})


# ---- the inspector's schedule, on a fake clock ----------------------------------------------------

class _Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def _seen(progress, returned=()):
    return Observation(placed=True, progress=progress, returned=frozenset(returned), failed=frozenset(),
                       exited=frozenset(), hosts={0: "a", 1: "a"}, where={0: "host a (10.0.0.1)",
                                                                           1: "host a (10.0.0.1)"})


def _beat(state="running", done=0, ops=(), settings=None):
    return {"state": state, "done": done, "ops": list(ops), "last": None, "interval": 0.5,
            "settings": settings or {}}


@pytest.mark.unit
def test_reports_repeat_at_doubling_intervals_then_the_run_fails_at_the_shutdown_time():
    clock, out = _Clock(), io.StringIO()
    inspector = StallInspector(np=2, run_id="r1", log_dir="/logs", driver_env={}, out=out, clock=clock)
    settings = {"HOROVOD_STALL_CHECK_TIME_SECONDS": "10", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "100"}
    start = clock.now
    printed_at = []
    while clock.now - start < 100:
        age = clock.now - start
        seen = _seen({0: (_beat(ops=[_op("allreduce", "w", age=age)], settings=settings), clock.now),
                      1: (_beat(done=0, settings=settings), clock.now)})
        before = inspector.reports
        assert inspector.check_observation(seen, clock.now) is None
        if inspector.reports > before:
            printed_at.append(round(clock.now - start))
        clock.now += 1
    assert printed_at == [10, 20, 40, 80]
    seen = _seen({0: (_beat(ops=[_op("allreduce", "w", age=100)], settings=settings), clock.now),
                  1: (_beat(settings=settings), clock.now)})
    error = inspector.check_observation(seen, clock.now)
    print(error)
    assert str(error).startswith(
        "HorovodRunner run r1 failed after a stall of 100 s (HOROVOD_STALL_SHUTDOWN_TIME_SECONDS=100): no collective "
        "has completed for 100 s while ranks wait in one (HOROVOD_STALL_CHECK_TIME_SECONDS=10):\n- allreduce 'w' "
        "on all ranks: rank 0 has waited in it for 100 s; rank 1 has not reached it")
    assert inspector.abort_reason == "the run stalled for 100 s, past HOROVOD_STALL_SHUTDOWN_TIME_SECONDS"
    assert out.getvalue().count("[sparkhvd] run r1 stalled: ") == 4


@pytest.mark.unit
def test_progress_ends_a_stall_and_computing_ranks_are_no_stall():
    clock, out = _Clock(), io.StringIO()
    inspector = StallInspector(np=2, run_id="r2", log_dir="/logs", driver_env={}, out=out, clock=clock)
    settings = {"HOROVOD_STALL_CHECK_TIME_SECONDS": "10"}
    clock.now += 500  # every rank computes for a long time: nothing to report
    assert inspector.check_observation(_seen({0: (_beat(settings=settings), clock.now),
                                              1: (_beat(settings=settings), clock.now)}), clock.now) is None
    assert out.getvalue() == ""
    clock.now += 9  # rank 0 has waited 9 s: not yet
    waiting = _seen({0: (_beat(ops=[_op("allreduce", age=9)], settings=settings), clock.now),
                     1: (_beat(settings=settings), clock.now)})
    assert inspector.check_observation(waiting, clock.now) is None and out.getvalue() == ""
    clock.now += 2
    assert inspector.check_observation(waiting, clock.now) is None
    assert "rank 0 has waited in it for 11 s" in out.getvalue()
    clock.now += 1
    assert inspector.check_observation(_seen({0: (_beat(done=1, settings=settings), clock.now),
                                              1: (_beat(done=1, settings=settings), clock.now)}), clock.now) is None
    assert out.getvalue().endswith("[sparkhvd] run r2: the stall is over after 12 s; the ranks make progress again.\n")


@pytest.mark.unit
def test_the_check_can_be_turned_off_and_a_failing_check_turns_itself_off():
    clock, out = _Clock(), io.StringIO()
    inspector = StallInspector(np=2, run_id="r5", log_dir="/logs", driver_env={"HOROVOD_STALL_CHECK_DISABLE": "1"},
                               out=out, clock=clock)
    clock.now += 1000
    waiting = _seen({0: (_beat(ops=[_op("allreduce", age=1000)]), clock.now), 1: (_beat(), clock.now)})
    assert inspector.check_observation(waiting, clock.now) is None and out.getvalue() == ""

    class Service:  # a heartbeat the check cannot read: it warns once and stays quiet
        cv = threading.Condition()
        placements = [None, None]
        registrations, results, exits, failures = {}, {}, {}, []
        progress = {0: ({"done": "many"}, clock.now)}

    broken = StallInspector(np=2, run_id="r6", log_dir="/logs", driver_env={}, out=out, clock=clock)
    with pytest.warns(RuntimeWarning, match=r"sparkhvd run r6: the stall check failed \(ValueError: invalid literal "
                                            r".*\) and is off for the rest of this run; please report it with the "
                                            r"run's logs."):
        assert broken.check(Service()) is None
    clock.now += 1
    assert broken.check(Service()) is None


@pytest.mark.unit
def test_hosts_named_alike_are_told_apart_by_their_address():
    from sparkhvd._common.topology import assign_ranks
    from sparkhvd.runner._policy.stall_inspector import observe
    from sparkhvd.runner._service.service import Registration

    class Service:
        cv = threading.Condition()
        registrations = {t: Registration(task=t, host="node", pid=t, gpus=[], peer=f"198.18.0.{t + 2}", host_id=h)
                         for t, h in enumerate("ab")}
        placements = assign_ranks(["a", "b"])
        results, exits, failures, progress = {}, {}, [], {}

    seen = observe(Service())
    assert seen.hosts == {0: "node (198.18.0.2)", 1: "node (198.18.0.3)"}
    assert seen.where[1] == "host node (198.18.0.3)"


def test_a_rank_not_heard_from_fails_the_run_naming_its_host():
    clock = _Clock()
    inspector = StallInspector(np=2, run_id="r3", log_dir="/logs", driver_env={}, out=io.StringIO(), clock=clock)
    settings = {"SPARKHVD_HEARTBEAT_TIMEOUT_SECONDS": "30"}
    last = clock.now
    clock.now += 29
    seen = _seen({0: (_beat(settings=settings), clock.now), 1: (_beat(ops=[_op("allreduce", age=1)]), last)})
    assert inspector.check_observation(seen, clock.now) is None
    clock.now += 1
    seen = _seen({0: (_beat(settings=settings), clock.now), 1: (_beat(ops=[_op("allreduce", age=1)]), last)})
    error = inspector.check_observation(seen, clock.now)
    print(error)
    assert str(error).startswith(
        "HorovodRunner run r3 failed: rank 1 on host a (10.0.0.1) has not been heard from for 30 s; rank 1's last "
        "heartbeat said: it waits in the 1st unnamed allreduce on all ranks, for 31 s. A rank that stops sending "
        "heartbeats has lost its host or the network to the driver, or its process is frozen (stopped, or in a native "
        "call that holds Python's GIL). A rank sends a heartbeat every 0.5 s (SPARKHVD_HEARTBEAT_SECONDS); raise "
        "SPARKHVD_HEARTBEAT_TIMEOUT_SECONDS (now 30, from rank 0's environment) if a rank can be busy that long, or "
        "set it to 0 to turn this check off.")
    assert inspector.abort_reason == "rank 1 stopped sending heartbeats to the driver"


def test_a_rank_never_heard_from_fails_the_run_too():
    clock = _Clock()
    inspector = StallInspector(np=2, run_id="r4", log_dir="/logs", driver_env={}, out=io.StringIO(), clock=clock)
    assert inspector.check_observation(_seen({0: (_beat(), clock.now)}), clock.now) is None
    clock.now += 60
    error = inspector.check_observation(_seen({0: (_beat(), clock.now)}), clock.now)
    assert str(error).startswith("HorovodRunner run r4 failed: rank 1 on host a (10.0.0.1) has not been heard from "
                                 "since the ranks started 60 s ago.")


# ---- real runs ------------------------------------------------------------------------------------

def _late_allreduce(late_s):
    import time

    import torch

    import sparkhvd.collective.torch as hvd

    hvd.init()
    if hvd.rank() == 1:
        time.sleep(late_s)  # rank 0 already waits in the allreduce below
    t = torch.ones(4)
    hvd.allreduce_(t, name="late", op=hvd.Sum)
    return t.tolist()


@pytest.mark.timeout(120)
def test_a_late_rank_is_reported_and_the_run_fails_at_the_shutdown_time(monkeypatch, capfd, rank_processes):
    for name, value in {**SHORT, "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "6"}.items():
        monkeypatch.setenv(name, value)
    started = time.monotonic()
    with pytest.raises(HorovodRunError) as info:
        HorovodRunner(np=-2).run(_late_allreduce, late_s=300)
    took = time.monotonic() - started
    err = capfd.readouterr().err
    print(f"failed after {took:.1f} s:\n{info.value}")
    text = str(info.value)
    assert text.startswith(f"HorovodRunner run {info.value.run_id} failed after a stall of ")
    assert "(HOROVOD_STALL_SHUTDOWN_TIME_SECONDS=6): no collective has completed for " in text
    assert "- allreduce 'late' on all ranks: rank 0 has waited in it for " in text
    assert "rank 1 has not reached it: it is running user code (its latest collective, hvd.init, finished " in text
    assert f"[sparkhvd] run {info.value.run_id} stalled: no collective has completed for " in err
    assert rank_processes() == []


def _late_init(late_s):
    import time

    import sparkhvd.collective.torch as hvd
    from sparkhvd._common import context as _context

    if _context.current().placement.rank == 1:
        time.sleep(late_s)  # rank 0 already waits in hvd.init()'s rendezvous
    hvd.init()
    return hvd.rank()


@pytest.mark.timeout(120)
def test_a_rank_late_to_init_is_reported(monkeypatch, capfd):
    for name, value in {**SHORT, "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "5"}.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(HorovodRunError) as info:
        HorovodRunner(np=-2).run(_late_init, late_s=300)
    text = str(info.value)
    print(text)
    assert "- hvd.init on all ranks: rank 0 has waited in it for " in text
    assert "rank 1 has not reached it: it is running user code (it has not called a collective yet)" in text


@pytest.mark.timeout(120)
def test_the_report_is_printed_and_the_run_completes_when_the_late_rank_arrives(monkeypatch, capfd):
    for name, value in SHORT.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", raising=False)
    started = time.monotonic()
    assert HorovodRunner(np=-2).run(_late_allreduce, late_s=6) == [2.0] * 4
    took = time.monotonic() - started
    err = capfd.readouterr().err
    print(f"completed after {took:.1f} s; the driver's stderr:\n{err}")
    assert "stalled: no collective has completed for " in err
    assert "- allreduce 'late' on all ranks: rank 0 has waited in it for " in err
    assert "rank 1 has not reached it: it is running user code" in err
    assert "set HOROVOD_STALL_SHUTDOWN_TIME_SECONDS to fail the run after a stall of that many seconds." in err
    assert "the stall is over after " in err


def _stuck_after_the_others(forever):
    import time

    import torch

    import sparkhvd.collective.torch as hvd

    hvd.init()
    hvd.allreduce_(torch.ones(4), name="last")
    if hvd.rank() == 1:
        end = time.monotonic() + (3600 if forever else 0)
        while time.monotonic() < end:  # pure Python: no collective, no GIL-holding call
            sum(range(1000))
            time.sleep(0.01)
    return hvd.rank()


@pytest.mark.timeout(120)
def test_a_rank_stuck_after_the_others_returned_is_reported_and_failed(monkeypatch, capfd, rank_processes):
    for name, value in {**SHORT, "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "6"}.items():
        monkeypatch.setenv(name, value)
    started = time.monotonic()
    with pytest.raises(HorovodRunError) as info:
        HorovodRunner(np=-2).run(_stuck_after_the_others, forever=True)
    took = time.monotonic() - started
    err = capfd.readouterr().err
    print(f"failed after {took:.1f} s:\n{info.value}")
    text = str(info.value)
    assert "(HOROVOD_STALL_SHUTDOWN_TIME_SECONDS=6): rank 1 is still running " in text
    assert "after rank 0 returned (HOROVOD_STALL_CHECK_TIME_SECONDS=2):" in text
    assert "- rank 1 is still running user code " in text
    assert "its latest collective, allreduce 'last', finished " in text
    assert "stalled: rank 1 is still running " in err
    assert rank_processes() == []


@pytest.mark.timeout(120)
def test_a_rank_the_driver_stops_hearing_from_fails_the_run(monkeypatch, rank_processes):
    monkeypatch.setenv("SPARKHVD_HEARTBEAT_SECONDS", "0.5")
    monkeypatch.setenv("SPARKHVD_HEARTBEAT_TIMEOUT_SECONDS", "4")

    def train():
        import os
        import signal

        import torch

        import sparkhvd.collective.torch as hvd

        hvd.init()
        if hvd.rank() == 1:
            os.kill(os.getpid(), signal.SIGSTOP)  # alive, silent: as a rank behind a dropped link looks
        hvd.allreduce_(torch.ones(4), name="after")
        return 1

    started = time.monotonic()
    with pytest.raises(HorovodRunError) as info:
        HorovodRunner(np=-2).run(train)
    print(f"failed after {time.monotonic() - started:.1f} s:\n{info.value}")
    text = str(info.value)
    assert "failed: rank 1 on host " in text
    assert re.search(r" has not been heard from for \d+\.\d s; rank 1's last heartbeat said: ", text)
    assert "raise SPARKHVD_HEARTBEAT_TIMEOUT_SECONDS (now 4, from rank 0's environment)" in text
    assert rank_processes() == []


def _slow_to_pickle():
    import time

    import sparkhvd.collective.torch as hvd

    class Slow:
        def __reduce__(self):
            time.sleep(300)  # rank 1 (the root) pickles; rank 0 already waits for the data
            return (Slow, ())

    hvd.init()
    return hvd.broadcast_object(Slow(), root_rank=1, name="obj") is not None


@pytest.mark.timeout(120)
def test_a_rank_waiting_for_a_broadcast_objects_root_is_reported_in_it(monkeypatch, capfd, rank_processes):
    for name, value in {**SHORT, "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "6"}.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(HorovodRunError) as info:
        HorovodRunner(np=-2).run(_slow_to_pickle)
    text = str(info.value)
    print(text)
    assert "- broadcast 'obj.length' on all ranks: rank 0 has waited in it for " in text
    assert "rank 1 has not reached it: it is running user code (its latest collective, hvd.init, finished " in text
    assert "network" not in text  # rank 1 is pickling the object before its first op, not cut off
    assert rank_processes() == []


def _data_waits():
    import torch

    import sparkhvd.collective.torch as hvd
    from sparkhvd._common import progress as _progress

    hvd.init()
    seen = []
    begin_data = _progress.begin_data

    def recording(op, kind, name):
        seen.append((kind, None if op is None else op[0]))  # op[0]: what its check was for
        return begin_data(op, kind, name)

    _progress.begin_data = recording
    hvd.broadcast_object({"a": 1}, root_rank=1, name="obj")
    hvd.allgather_object(hvd.rank(), name="objs")
    hvd.allgather(torch.ones(hvd.rank() + 1, 2), name="rows")
    hvd.alltoall(torch.arange(4.0), splits=[1, 3])
    x = torch.randn(4, 3, requires_grad=True)
    hvd.SyncBatchNorm(3)(x).sum().backward()  # two reductions forward, one backward
    model = torch.nn.Linear(2, 1)
    model.bias.requires_grad_(False)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    model.bias.requires_grad_(True)  # trainable after wrapping: reduced on the reference path
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    if hvd.rank() == 1:  # too big to ride in the check: rank 0, joined, mirrors it with zeros
        hvd.allreduce(torch.ones(300_000), op=hvd.Sum, name="big")
    hvd.join()
    _progress.begin_data = begin_data
    return hvd.allgather_object((seen, _progress.snapshot()["ops"]))  # run() returns rank 0's result


@pytest.mark.timeout(120)
def test_every_wait_for_data_after_a_check_is_registered_under_its_checked_op():
    results = HorovodRunner(np=-2).run(_data_waits)
    for rank, (seen, in_flight) in enumerate(results):
        print(rank, seen)
        assert in_flight == []  # every wait ended
        assert all(what == kind for kind, what in seen), seen  # None: registered without its negotiated op
        kinds = {kind for kind, _ in seen}  # small reductions ride in the control frames: no data wait
        assert {"broadcast", "allgather", "alltoall"} <= kinds, kinds
    assert ("allreduce", "allreduce") in results[1][0]  # "big", which joined rank 0 mirrors
