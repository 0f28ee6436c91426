"""Stragglers named (runner/_policy/stragglers.py): real rank processes on the driver (np=-2), real gloo, one rank
slowed by a sleep in each step; heartbeats every 0.3 s and a 1.5 s window, so the line comes within the run."""

from __future__ import annotations

import re

import pytest

from sparkhvd import HorovodRunner

pytestmark = pytest.mark.timeout(120)


def _rank_one_sleeps_in_each_step(steps: int, sleep: float, every: float = 0.0):
    import time

    import torch

    import sparkhvd.collective.torch as hvd

    hvd.init()
    model = torch.nn.Linear(8, 1)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                   named_parameters=model.named_parameters())
    for _ in range(steps):
        time.sleep(every + (sleep if hvd.rank() == 1 else 0.0))  # rank 1's extra: the other waits for it
        opt.zero_grad()
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
    return hvd.rank()


def test_a_rank_slowed_by_a_sleep_is_named_once_with_its_host_times_and_where_its_time_goes(monkeypatch, capsys):
    monkeypatch.setenv("SPARKHVD_HEARTBEAT_SECONDS", "0.3")
    monkeypatch.setenv("SPARKHVD_STRAGGLER_WINDOW_SECONDS", "1.5")
    HorovodRunner(np=-2).run(_rank_one_sleeps_in_each_step, steps=40, sleep=0.1)
    lines = [line for line in capsys.readouterr().out.splitlines() if "is a straggler" in line]
    assert len(lines) == 1, lines  # one episode, one line
    found = re.search(r"rank 1 \(host [^)]+\) is a straggler: (\d+) ms of its own work per step against (\d+) ms on "
                      r"the other ranks \(median; [^)]+\) over the last 1\.5 s; the extra time is its own compute: "
                      r"\d+ ms more per step", lines[0])
    assert found and 90 <= int(found[1]) <= 200 and int(found[2]) < 50, lines[0]  # the 100 ms sleep, and ~0


def test_ranks_at_the_same_pace_are_never_named(monkeypatch, capsys):
    monkeypatch.setenv("SPARKHVD_HEARTBEAT_SECONDS", "0.3")
    monkeypatch.setenv("SPARKHVD_STRAGGLER_WINDOW_SECONDS", "1.5")
    # 3 s of steps, twice the window: the check runs, and finds both ranks alike
    HorovodRunner(np=-2).run(_rank_one_sleeps_in_each_step, steps=60, sleep=0.0, every=0.05)
    assert "is a straggler" not in capsys.readouterr().out


def _status(np: int, beats: dict):
    """A RunStatus of ``np`` placed ranks whose latest heartbeats carry ``beats[rank]`` (metrics, arrival time)."""
    from sparkhvd._common.topology import Placement
    from sparkhvd.runner._service.service import Registration
    from sparkhvd.runner._service.status import RunStatus

    placements = tuple(Placement(rank=r, size=np, local_rank=0, local_size=1, cross_rank=r, cross_size=np)
                       for r in range(np))
    registrations = {r: Registration(task=r, host=f"host-{r}", pid=1, gpus=[str(r)], peer="10.0.0.1")
                     for r in range(np)}
    return RunStatus(np=np, at=0.0, registrations=registrations, placements=placements,
                     progress={r: ({"metrics": m} if m is not None else {}, at) for r, (m, at) in beats.items()})


def _beat(steps: int, clock: float, waits: float, data: float = 0.0) -> dict:
    return {"optimizer_steps": steps, "negotiation_s": waits, "transfer_s": 0.0, "data_wait_s": data,
            "clock_s": clock}


def test_a_rank_waiting_on_its_reader_is_named_for_its_data_and_again_only_after_it_caught_up():
    from sparkhvd.runner._policy.stragglers import Stragglers

    now = [0.0]
    watch = Stragglers(run_id="r1", factor=1.5, window=2.0, out=open("/dev/null", "w"), clock=lambda: now[0])
    slow = {0: 0.02, 1: 0.02, 2: 0.08}  # own seconds per step at 10 steps a second; rank 2's mostly data waits
    totals = {rank: {"waits": 0.0, "data": 0.0} for rank in range(3)}
    for second in range(1, 16):
        now[0] = float(second)
        if second == 7:
            slow[2] = 0.02  # it catches up: the episode ends
        if second == 11:
            slow[2] = 0.08  # and falls behind again: a new episode, a new line
        beats = {}
        for rank in range(3):
            own = 10 * slow[rank]  # of this second
            totals[rank]["waits"] += 1.0 - own
            totals[rank]["data"] += 0.8 * own if rank == 2 and slow[2] > 0.02 else 0.0
            beats[rank] = (_beat(10 * second, float(second), totals[rank]["waits"], totals[rank]["data"]), float(second))
        watch.check(_status(3, beats))
    assert len(watch.lines) == 2, watch.lines
    assert "rank 2 (host host-2, GPU 2) is a straggler" in watch.lines[0]
    assert "the extra time is waiting for data:" in watch.lines[0] and "sparkhvd's readers" in watch.lines[0]


def test_ranks_that_send_no_metrics_are_left_out():
    from sparkhvd.runner._policy.stragglers import Stragglers

    watch = Stragglers(run_id="r1", factor=1.5, window=1.0, out=open("/dev/null", "w"), clock=lambda: 10.0)
    status = _status(2, {0: (None, 1.0), 1: (None, 1.0)})  # SPARKHVD_METRICS=0: beats without metrics
    watch.check(status)
    assert watch.lines == []


def test_a_rank_a_little_slower_than_ranks_that_only_wait_for_a_far_slower_one_is_not_named():
    from sparkhvd.runner._policy.stragglers import Stragglers

    now = [0.0]
    watch = Stragglers(run_id="r1", factor=1.5, window=2.0, out=open("/dev/null", "w"), clock=lambda: now[0])
    # own seconds per step at 5 steps a second: rank 3 sleeps 100 ms a step; rank 0 (a busy host) does 12 ms of its own
    # work where ranks 1 and 2 do none but wait: rank 0 is 12 ms above their median, rank 3 108 ms above it
    slow = {0: 0.012, 1: 0.0, 2: 0.0, 3: 0.108}
    waits = dict.fromkeys(slow, 0.0)
    for second in range(1, 8):
        now[0] = float(second)
        beats = {}
        for rank, own in slow.items():
            waits[rank] += 1.0 - 5 * own
            beats[rank] = (_beat(5 * second, float(second), waits[rank]), float(second))
        watch.check(_status(4, beats))
    assert len(watch.lines) == 1 and "rank 3 (host host-3, GPU 3) is a straggler" in watch.lines[0], watch.lines


def test_a_straggler_is_named_once_while_a_slower_one_comes_and_goes():
    from sparkhvd.runner._policy.stragglers import Stragglers

    now = [0.0]
    watch = Stragglers(run_id="r1", factor=1.5, window=2.0, out=open("/dev/null", "w"), clock=lambda: now[0])
    slow = {0: 0.0, 1: 0.0, 2: 0.1, 3: 0.0}  # rank 2 stays 100 ms behind; rank 3 is 300 ms behind for a while
    waits = dict.fromkeys(slow, 0.0)
    for second in range(1, 16):
        now[0] = float(second)
        slow[3] = 0.3 if 6 <= second < 10 else 0.0
        beats = {}
        for rank, own in slow.items():
            waits[rank] += 1.0 - 2 * own
            beats[rank] = (_beat(2 * second, float(second), waits[rank]), float(second))
        watch.check(_status(4, beats))
    named = [line.split(" is a straggler")[0].split(": ")[-1] for line in watch.lines]
    assert named == ["rank 2 (host host-2, GPU 2)", "rank 3 (host host-3, GPU 3)"], watch.lines
