"""Every rank's metrics with no user code (issue 40's first item): real rank processes on the driver (np=-2), real
gloo, heartbeats every 0.3 s; ``RunResult.metrics`` has each rank's series (runner/_service/metrics.py)."""

from __future__ import annotations

import pytest

from sparkhvd import HorovodRunner
from sparkhvd.runner._service.metrics import MAX_POINTS, MetricsLog

STEPS = 12


def _train_with_the_distributed_optimizer(steps: int, adasum: bool = False):
    import time

    import torch

    import sparkhvd.collective.torch as hvd

    hvd.init()
    model = torch.nn.Linear(8, 1)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                   named_parameters=model.named_parameters(), op=hvd.Adasum if adasum else hvd.Average)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
        time.sleep(0.1)  # about 1.2 s in all: a few heartbeats
    return hvd.rank()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("adasum", [False, True], ids=["average", "adasum"])  # Adasum steps each parameter inside
def test_each_ranks_steps_collective_time_cpu_and_memory_come_back_with_no_user_code(monkeypatch, adasum):
    monkeypatch.setenv("SPARKHVD_HEARTBEAT_SECONDS", "0.3")
    result = HorovodRunner(np=-2).run_all(_train_with_the_distributed_optimizer, steps=STEPS, adasum=adasum)
    assert sorted(result.metrics) == [0, 1], result.metrics
    for rank, rows in result.metrics.items():
        assert len(rows) >= 2, rows  # beats while it ran, and the last as it finished
        last = rows[-1]
        assert last["optimizer_steps"] == STEPS and last["steps"] == STEPS, last  # each step counted once
        # small reductions ride the control exchange itself: their time is negotiation, not transfer
        assert last["collectives"] >= STEPS and last["negotiation_s"] > 0 and last["transfer_s"] >= 0, last
        assert last["cpu_s"] > 0 and last["rss_bytes"] > 10 << 20 and last["gpu"] is None, last
        assert [r["t"] for r in rows] == sorted(r["t"] for r in rows) and {r["attempt"] for r in rows} == {0}
        assert rows[0]["steps_per_s"] is None and any(r["steps_per_s"] for r in rows[1:]), rows


def test_a_log_keeps_a_long_runs_whole_span_at_a_coarser_grain():
    log = MetricsLog(started=0.0)
    for i in range(MAX_POINTS + 1):
        log.record(0, 0, {"optimizer_steps": i}, at=float(i))
    rows = log.series()[0]
    assert len(rows) <= MAX_POINTS // 2 + 2 and rows[0]["t"] == 0.0 and rows[-1]["t"] == float(MAX_POINTS)
    assert rows[1]["steps_per_s"] == 1.0  # the rate stays per second over the wider gaps


def test_steps_are_commits_where_no_optimizer_stepped_and_collectives_where_neither():
    log = MetricsLog(started=0.0)
    log.record(0, 0, {"optimizer_steps": 0, "commits": 3, "collectives": 40}, at=1.0)
    log.record(1, 0, {"optimizer_steps": 0, "commits": 0, "collectives": 40}, at=1.0)
    log.record(1, 1, {"optimizer_steps": 0, "commits": 0, "collectives": 4}, at=2.0)
    series = log.series()
    assert series[0][0]["steps"] == 3 and series[1][0]["steps"] == 40
    assert series[1][1]["steps_per_s"] is None  # a new attempt starts its counts afresh: no rate across it
