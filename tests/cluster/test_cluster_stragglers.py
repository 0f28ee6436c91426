"""A straggler named on the 2-host testbed: np=4 over both hosts, the last rank sleeping 0.1 s in each step; the
driver's line names it with its host and GPU (runner/_policy/stragglers.py). Heartbeats every second (the
testbed's executors' setting), a 2 s window on the driver."""

from __future__ import annotations

import re

import pytest

from .test_cluster_correctness import NP, _assert_ok, _print_seconds

pytestmark = [pytest.mark.slow, pytest.mark.cluster]


def test_a_rank_slowed_on_one_host_is_named_with_its_host_and_gpu(cluster, no_leftover_ranks):
    slow = NP - 1
    outcome = cluster.driver.run("straggler", NP, slow_rank=slow, steps=80, sleep=0.1, timeout=180,
                                 driver_env={"SPARKHVD_STRAGGLER_WINDOW_SECONDS": "2"})
    _assert_ok(outcome)
    _print_seconds("a straggler named", outcome)
    host = next(v["host"] for v in outcome.values if v["rank"] == slow)
    lines = [line for line in outcome.output.splitlines() if "is a straggler" in line]
    assert len(lines) == 1, outcome.output[-3000:]
    found = re.search(rf"rank {slow} \(host {re.escape(host)}, GPU (\d)\) is a straggler: (\d+) ms of its own work "
                      r"per step against (\d+) ms on the other ranks", lines[0])
    assert found and found[1] == outcome.gpus[slow][0], (lines[0], outcome.gpus)
    assert 80 <= int(found[2]) <= 250 and int(found[3]) < 60, lines[0]  # the sleep, against the others' own work
