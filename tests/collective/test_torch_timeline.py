"""hvd.start_timeline writes Horovod's Chrome-trace format at np=2: each op's negotiation and its bytes, cycle
marks, nothing after stop_timeline, and a clear error for a folder that does not exist."""

from __future__ import annotations

import pytest

from sparkhvd import HorovodRunner


def _timeline(folder):
    import json

    import torch

    import sparkhvd.collective.torch as hvd

    hvd.init()
    hvd.start_timeline(f"{folder}/trace.json", mark_cycles=True)  # rank 1 writes trace.rank1.json
    path = f"{folder}/trace.json" if hvd.rank() == 0 else f"{folder}/trace.rank1.json"
    hvd.allreduce(torch.ones(256), name="grads")
    hvd.synchronize(hvd.broadcast_async(torch.ones(8, dtype=torch.float64), root_rank=0))
    hvd.barrier()
    hvd.stop_timeline()
    hvd.barrier()  # in a set of two, rank 0's next small reduction reaches rank 1 at once: after it stopped
    hvd.allreduce(torch.ones(4))  # after stop: not recorded
    error = None
    try:
        hvd.start_timeline(f"{folder}/missing/trace.json")
    except ValueError as exc:
        error = str(exc)
    with open(path) as f:
        return json.load(f), error


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("timeline")


@pytest.fixture(scope="module")
def ranks(folder):
    return HorovodRunner(np=-2).run_all(_timeline, folder=str(folder)).values


def test_each_rank_writes_horovods_format_with_each_ops_negotiation_and_bytes(ranks):
    for events, _ in ranks:
        assert "start_time_since_epoch_in_micros" in events[0]["args"]
        names = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name" and e["pid"]}
        assert sorted(names.values()) == ["allreduce.grads", "barrier.noname.0", "broadcast.noname.0"]
        spans = [(names[e["pid"]], e["ph"], e.get("name"), e.get("args", {}).get("bytes"))
                 for e in events if e["ph"] in "BE"]
        assert spans == [
            ("allreduce.grads", "B", "NEGOTIATE_ALLREDUCE", None), ("allreduce.grads", "E", None, None),
            ("allreduce.grads", "B", "ALLREDUCE", None), ("allreduce.grads", "E", None, 1024),
            ("broadcast.noname.0", "B", "NEGOTIATE_BROADCAST", None), ("broadcast.noname.0", "E", None, None),
            ("broadcast.noname.0", "B", "BROADCAST", None), ("broadcast.noname.0", "E", None, 64),
            ("barrier.noname.0", "B", "NEGOTIATE_BARRIER", None), ("barrier.noname.0", "E", None, None),
            ("barrier.noname.0", "B", "BARRIER", None), ("barrier.noname.0", "E", None, 0)]
        times = [e["ts"] for e in events if e["ph"] in "BE"]
        assert times == sorted(times) and times[0] >= 0


def test_mark_cycles_marks_each_batch_of_answers(ranks):
    for events, _ in ranks:
        assert sum(e.get("name") == "CYCLE_START" for e in events) == 3  # one batch of answers per op here


def test_a_folder_that_does_not_exist_is_a_clear_error(ranks, folder):
    for _, error in ranks:
        assert error == f"start_timeline: the folder {folder}/missing does not exist; create it or pick another path."
