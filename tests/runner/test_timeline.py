"""One timeline for the whole run (runner/_service/timeline.py): every rank's Horovod timeline merged on the driver
into one Chrome/Perfetto trace, a process per rank on one clock; real rank processes (np=-2) and real gloo, under
HOROVOD_TIMELINE and under hvd.start_timeline, a run that fails included."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from sparkhvd import HorovodRunError, HorovodRunner
from sparkhvd.runner._service.timeline import TimelineLog


def _segment(start_us: int, op: str, begin: float, end: float) -> dict:
    """A rank's trace as collective/_engine/timeline.py records it: one op, negotiated then carried out."""
    return {"start_us": start_us, "events": [
        {"name": "process_name", "ph": "M", "pid": 0, "args": {"start_time_since_epoch_in_micros": start_us}},
        {"name": "process_name", "ph": "M", "pid": 1, "args": {"name": op}},
        {"ph": "B", "name": "NEGOTIATE_ALLREDUCE", "ts": begin, "pid": 1},
        {"ph": "E", "ts": begin + 5, "pid": 1},
        {"ph": "B", "name": "ALLREDUCE", "ts": begin + 5, "pid": 1},
        {"ph": "E", "ts": end, "pid": 1, "args": {"bytes": 64}},
        {"ph": "i", "name": "CYCLE_START", "ts": begin + 5, "pid": 0, "s": "g"}]}


@pytest.mark.unit
def test_the_ranks_traces_become_a_process_each_on_the_drivers_clock():
    from sparkhvd.runner._policy.result import RestartEvent

    log = TimelineLog()
    # rank 1's trace started 500 µs after rank 0's by its own clock, which runs 300 µs ahead of the driver's
    log.record(1, 0, [_segment(1_000_500, "allreduce.grads", 10, 40)], offset_us=-300, host="b", gpus=("1",))
    log.record(0, 0, [_segment(1_000_000, "allreduce.grads", 200, 240)], offset_us=0, host="a", gpus=("0",))
    log.record(2, 0, [{"start_us": "later"}, "junk"], offset_us=0)  # nothing usable: no process for it
    restart = RestartEvent(attempt=2, attempts=3, lost="rank 1's host was lost", np_before=2, np_after=2,
                           failed_at=1.0)
    trace = log.merged("r1", restarts=(restart,))
    events = trace["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    assert names == {0: "driver", 1: "rank 0 (host a, GPU 0)", 2: "rank 1 (host b, GPU 1)"}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    assert set(threads.values()) == {"allreduce.grads", "cycles"}
    ends = {e["pid"]: e["ts"] for e in events if e.get("ph") == "E" and e.get("args", {}).get("bytes")}
    assert ends == {1: 240, 2: 40 + 200}  # rank 1's 40 µs, 200 µs after rank 0's start on the driver's clock
    assert trace["otherData"]["origin_since_epoch_in_micros"] == 1_000_000 and trace["otherData"]["run_id"] == "r1"
    [mark] = [e for e in events if e.get("ph") == "i" and e["pid"] == 0]
    assert mark["name"] == "restart 2: restart" and mark["args"] == {"cause": "rank 1's host was lost"}


@pytest.mark.unit
def test_a_negotiation_is_split_where_the_ops_last_request_reached_its_coordinator():
    log = TimelineLog()

    def negotiated(start_us: int, ready: dict | None) -> dict:
        segment = _segment(start_us, "allreduce.grads", 100, 200)
        if ready is not None:
            segment["events"][3]["args"] = ready  # the NEGOTIATE span's end (100 to 105 µs)
        return segment

    # the last request reached rank 0 (the coordinator, whose clock is the driver's) at 1_000_103 µs on its clock:
    # rank 1 (300 µs ahead of the driver) waited 103 - 100 µs of its 5 µs negotiation for its peers
    log.record(0, 0, [negotiated(1_000_000, {"ready_us": 1_000_103, "ready_clock": 0})], offset_us=0)
    log.record(1, 0, [negotiated(1_000_300, {"ready_us": 1_000_103, "ready_clock": 0})], offset_us=-300)
    # rank 2's coordinator sent no trace, so its clock is unknown there; rank 3's says a moment before its span
    log.record(2, 0, [negotiated(1_000_000, {"ready_us": 1_000_103, "ready_clock": 7})], offset_us=0)
    log.record(3, 0, [negotiated(1_000_000, {"ready_us": 1_000_050, "ready_clock": 0})], offset_us=0)
    events = log.merged()["traceEvents"]
    waits = {e["pid"] - 1: e for e in events if e.get("name") == "WAIT_FOR_PEERS"}
    assert set(waits) == {0, 1} and all(w["ts"] == 100 and w["args"] == {"coordinator": 0} for w in waits.values())
    for rank, wait in waits.items():  # nested in its NEGOTIATE span: it starts after it, ends before its end
        track = [e for e in events if e.get("pid") == rank + 1 and e.get("tid") == wait["tid"] and e["ph"] in "BE"]
        assert [e.get("name") for e in track[:4]] == ["NEGOTIATE_ALLREDUCE", "WAIT_FOR_PEERS", None, None]
        assert [e["ts"] for e in track[:4]] == [100, 100, 103, 105]


@pytest.mark.unit
def test_the_coordinator_keeps_when_an_ops_last_request_came_through_fusion():
    from sparkhvd.collective._engine.messages import Request
    from sparkhvd.collective._engine.negotiate import Table

    table = Table([0, 1], fusion_threshold=1 << 20)
    for name, times in (("allreduce.a", (5.0, 9.0)), ("allreduce.b", (7.0, 8.0))):
        for rank, at in enumerate(times):
            table.add(rank, Request(name, "allreduce", fusion_key="k", nbytes=8), at=at)
    table.add(0, Request("allreduce.c", "allreduce"))  # untimed (no timeline records)
    table.add(1, Request("allreduce.c", "allreduce"))
    [fused, untimed] = table.decide()
    assert fused.answer.names == ["allreduce.a", "allreduce.b"] and fused.ready_at == 9.0
    assert untimed.ready_at is None


@pytest.mark.unit
def test_the_service_keeps_a_ranks_traces_with_its_clocks_offset_and_refuses_a_trace_that_is_not_json(monkeypatch):
    import time
    import types

    from sparkhvd._common import driver_messages as dm
    from sparkhvd._common.client import ServiceClient, ServiceError
    from sparkhvd._common.protocol import new_secret
    from sparkhvd.runner._rank import worker
    from sparkhvd.runner._service.service import DriverService

    secret, got = new_secret(), []
    service = DriverService(np=2, secret=secret, payload=b"", run_id="t", on_timeline=lambda *a, **kw: got.append((a, kw)))
    client = ServiceClient(service.address, secret)
    try:
        offset_us, error_us = worker.clock_offset(client)  # one machine, one clock: no offset past the trip's half
        assert 0 < error_us < 1_000_000 and abs(offset_us) <= error_us + 1
        ahead = types.SimpleNamespace(time=lambda: time.time() + 5.0)  # a rank whose clock is 5 s ahead (its own
        monkeypatch.setattr(worker, "time", ahead)  # module's: the driver's thread here reads the true one)
        offset_us, error_us = worker.clock_offset(client)
        assert abs(offset_us + 5_000_000) <= error_us + 1
        monkeypatch.undo()
        client.ask(dm.Timeline(rank=1, offset_us=offset_us, error_us=error_us),
                   json.dumps([_segment(1, "x", 0, 1)]).encode())
        [((rank, attempt, segments, offset, host, gpus), kw)] = got
        assert (rank, attempt, host, gpus, offset, kw) == (1, 0, None, (), offset_us, {"error_us": error_us})
        assert segments[0]["start_us"] == 1
        with pytest.raises(ServiceError, match=r"^rank 0's timeline is not JSON \(Expecting property name .*\), so the "
                                               r"run's merged timeline goes without it; please report it with the "
                                               r"run's logs\.$"):
            client.ask(dm.Timeline(rank=0, offset_us=0, error_us=0), b"{not json")
    finally:
        client.close()
        service.close()


@pytest.mark.unit
def test_a_service_that_keeps_no_timeline_takes_a_ranks_trace_and_drops_it():
    from sparkhvd._common import driver_messages as dm
    from sparkhvd._common.client import ServiceClient
    from sparkhvd._common.protocol import new_secret
    from sparkhvd.runner._service.service import DriverService

    secret = new_secret()
    service = DriverService(np=2, secret=secret, payload=b"", run_id="t")  # as a hosted run's: no on_timeline
    client = ServiceClient(service.address, secret)
    try:
        client.ask(dm.Timeline(rank=1, offset_us=0, error_us=5), json.dumps([_segment(1, "x", 0, 1)]).encode())
        assert service.bad_frames == 0
    finally:
        client.close()
        service.close()


@pytest.mark.unit
def test_a_data_wait_is_a_span_of_the_data_thread_while_a_timeline_records():
    from sparkhvd._common import metrics, traces
    from sparkhvd.collective._engine import timeline

    timeline.start_timeline(None)
    try:
        metrics.loader_waited(0.02)
    finally:
        timeline.stop_timeline()
    assert metrics.TIMELINE is None
    events = traces.recorded()[-1]["events"]
    assert {"name": "process_name", "ph": "M", "pid": 1, "args": {"name": "data"}} in events
    begin, end = [e for e in events if e.get("pid") == 1 and e["ph"] in "BE"]
    assert begin["name"] == "DATA_WAIT" and end["ts"] - begin["ts"] == pytest.approx(20_000, abs=1)


@pytest.mark.unit
def test_a_trace_stops_at_its_limit_of_events_and_says_so(monkeypatch):
    from sparkhvd._common import traces
    from sparkhvd.collective._engine import timeline

    monkeypatch.setattr(timeline, "MAX_EVENTS", 10)
    timeline.start_timeline(None)
    try:
        for _ in range(20):
            timeline.data_wait(0.001)
    finally:
        timeline.stop_timeline()
    events = traces.recorded()[-1]["events"]
    assert len(events) == 11 and events[-1]["name"] == "TRUNCATED" and events[-1]["args"] == {"events": 10}


def _allreduces(steps: int, fail_on: int | None = None, timeline: str | None = None):
    import time

    import torch

    import sparkhvd.collective.torch as hvd

    hvd.init()
    if timeline:
        hvd.start_timeline(timeline)
    for step in range(steps):
        time.sleep(0.02 * hvd.rank())  # rank 1 comes later: rank 0 waits for it in the negotiation
        hvd.allreduce(torch.ones(16), name="x")
        if hvd.rank() == fail_on and step == steps - 1:
            raise ValueError("rank 1 stops here")
    return hvd.rank()


def _events(path: str) -> list:
    with open(path) as f:
        return json.load(f)["traceEvents"]


def _spans(events: list, rank: int, name: str) -> list:
    """The (begin, end) times of the rank's spans called ``name`` (spans nest: an end closes its thread's latest)."""
    pid = rank + 1
    begins = [e for e in events if e.get("pid") == pid and e.get("ph") in ("B", "E")]
    spans, open_at = [], {}
    for e in begins:
        if e["ph"] == "B":
            open_at.setdefault(e["tid"], []).append((e["name"], e["ts"]))
        elif open_at.get(e["tid"]):
            began = open_at[e["tid"]].pop()
            if began[0] == name:
                spans.append((began[1], e["ts"]))
    return spans


@pytest.mark.timeout(120)
def test_horovod_timeline_on_the_driver_gives_one_trace_of_every_rank_on_one_clock(tmp_path, monkeypatch, capsys):
    path = str(tmp_path / "trace.json")
    monkeypatch.setenv("HOROVOD_TIMELINE", path)
    result = HorovodRunner(np=-2).run_all(_allreduces, steps=8)
    assert result.timeline == path and result.values == [0, 1]
    assert f"the timeline of every rank is in {path}" in capsys.readouterr().out
    events = _events(path)
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    assert names[0] == "driver" and names[1].startswith("rank 0 (host ") and names[2].startswith("rank 1 (host ")
    threads = {e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    assert "allreduce.x" in threads
    for rank in (0, 1):
        assert len(_spans(events, rank, "NEGOTIATE_ALLREDUCE")) == 8 and len(_spans(events, rank, "ALLREDUCE")) == 8
    # One clock: each allreduce ends on both ranks at the same moment, give or take the last bytes' trip (a
    # trace on each rank's own clock from its own start would be apart by the ranks' start-up, seconds here).
    for (_, end0), (_, end1) in zip(_spans(events, 0, "ALLREDUCE"), _spans(events, 1, "ALLREDUCE")):
        assert abs(end0 - end1) < 50_000, (end0, end1)
    # rank 0 negotiated longer: it waited for rank 1, which slept 20 ms before each
    waited = [end - begin for begin, end in _spans(events, 0, "NEGOTIATE_ALLREDUCE")[1:]]
    assert sum(waited) / len(waited) > 10_000, waited
    # and the merged trace says it was the wait for its peer: a WAIT_FOR_PEERS inside each of its negotiations
    for_peers = [end - begin for begin, end in _spans(events, 0, "WAIT_FOR_PEERS")[1:]]
    assert len(for_peers) == 7 and sum(for_peers) / len(for_peers) > 10_000, for_peers
    assert all(p <= w for p, w in zip(for_peers, waited))


@pytest.mark.timeout(120)
def test_a_failed_runs_ranks_started_timelines_are_merged_in_its_log_folder(tmp_path):
    logs = tmp_path / "logs"
    own = tmp_path / "own"
    own.mkdir()
    with pytest.raises(HorovodRunError, match="rank 1 stops here"):
        HorovodRunner(np=-2, log_dir=str(logs)).run_all(_allreduces, steps=4, fail_on=1,
                                                        timeline=str(own / "trace.json"))
    assert os.listdir(own) == []  # hvd.start_timeline writes its own file at stop_timeline, which never came
    merged = logs / "timeline.json"
    events = _events(str(merged))
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    assert names.get(2, "").startswith("rank 1 (host "), names  # the rank that failed sent its trace first
    assert len(_spans(events, 1, "ALLREDUCE")) == 4


@pytest.mark.timeout(120)
def test_perfettos_trace_processor_loads_the_merged_trace_with_every_ranks_slices(tmp_path, monkeypatch):
    perfetto = pytest.importorskip("perfetto.trace_processor", reason="perfetto is not installed (pip install perfetto)")
    shell = os.environ.get("PERFETTO_TRACE_PROCESSOR") or shutil.which("trace_processor_shell")
    if not shell:
        pytest.skip("no trace_processor_shell (perfetto downloads it from Google's storage, unreachable here): put "
                    "it on PATH or in PERFETTO_TRACE_PROCESSOR")
    path = str(tmp_path / "trace.json")
    monkeypatch.setenv("HOROVOD_TIMELINE", path)
    HorovodRunner(np=-2, driver_log_verbosity="log_callback_only").run_all(_allreduces, steps=4)
    tp = perfetto.TraceProcessor(trace=path, config=perfetto.TraceProcessorConfig(bin_path=shell))
    try:
        rows = list(tp.query("select process.name as process, count(*) as n from slice join thread_track on "
                             "slice.track_id = thread_track.id join thread using (utid) join process using (upid) "
                             "where slice.name = 'ALLREDUCE' group by process.name order by process.name"))
    finally:
        tp.close()
    assert [r.n for r in rows] == [4, 4] and rows[0].process.startswith("rank 0 (host "), rows
