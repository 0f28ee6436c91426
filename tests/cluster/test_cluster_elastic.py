"""Restarts on the 2-host cluster: a training run under ``hvd.elastic.run`` with ``max_restarts`` goes on
after its host B loses a rank process, after a frozen rank on host A and then host B's executor JVM
killed, after host B's executor is decommissioned (a preemption), and after host B is cut off; it ends
with the weights of the same run uninterrupted, bit for bit.

np=4 (ranks 0,1 on host A, 2,3 on host B); the fault lands mid-training, after some commits. Each
test prints the seconds from the fault to the run's end and the driver's restart line.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import time

import pytest

from sparkhvd.runner._warm.protocol import SERVER_MODULE

from . import _faults

pytestmark = [pytest.mark.slow, pytest.mark.cluster]

NP = 4
STEPS = 3 * 40  # elastic_train's epochs x batches


@pytest.fixture(scope="module")
def reference(cluster):
    outcome = cluster.driver.run("elastic_train", NP, timeout=240, step_seconds=0.0)
    assert outcome.ok, outcome.error
    return outcome.values[0]


def _same(a, b) -> bool:
    import torch

    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def _training(cluster, runner=None, **kwargs):
    pending = cluster.driver.submit("elastic_train", NP, runner=runner or {"max_restarts": 2}, **kwargs)
    for r in range(NP):
        pending.wait_for_output(f"[{r}] rank {r} pid", timeout=120)
    ranks = _faults.wait_for_ranks(cluster, NP, timeout=30)
    pending.wait_for_output("[0] commit of step 10 is on the driver", timeout=120)
    time.sleep(0.6)  # a few steps past that commit
    return pending, ranks[3][0]


def _finished(cluster, pending, reference, what: str):
    faulted = time.monotonic()
    outcome = pending.result(300)
    seconds = time.monotonic() - faulted
    assert outcome.ok, f"the run did not survive {what}: {outcome.error}"
    weights, steps = outcome.values[0]
    assert _same(weights, reference[0]) and steps == reference[1] == STEPS  # bit for bit, no step counted twice
    assert len(outcome.restarts) == 1, outcome.restarts
    event = outcome.restarts[0]
    assert event["commit"] is not None and event["commit"]["steps"] >= 10, event  # resumed mid-run, not from the start
    line = next(line for line in outcome.output.splitlines() if "restart 1 of 2 after" in line)
    print(f"\n[cluster] {what}: the run ended {seconds:.1f} s after the fault; {event['seconds']:.1f} s from the "
          f"failure to training resumed\n[cluster]   {line}")
    assert not cluster.wait_no_ranks(timeout=30)
    return event


def test_a_rank_killed_on_host_b_restarts_from_the_last_commit(cluster, reference):
    pending, b = _training(cluster)
    _faults.kill_rank(cluster, 3, signal.SIGKILL)
    event = _finished(cluster, pending, reference, "SIGKILL of rank 3")
    assert event["lost"].startswith(f"rank 3's process on host {b.hostname} ({b.address}) was killed by signal 9")


def test_a_frozen_rank_on_host_a_then_an_executor_killed_on_host_b_each_restart_naming_only_their_own_cause(
        cluster, reference):
    """The first fault makes sparkhvd ask Spark to replace host A's executor (its rank went silent); Spark removes
    that executor whenever it gets to it. The second fault's restart line names host B's killed executor alone:
    the executor sparkhvd replaced is never a later attempt's cause, whenever its removal lands."""
    pending = cluster.driver.submit("elastic_train", NP, runner={"max_restarts": 2})
    for r in range(NP):
        pending.wait_for_output(f"[{r}] rank {r} pid", timeout=120)
    ranks = _faults.wait_for_ranks(cluster, NP, timeout=30)
    pending.wait_for_output("[0] commit of step 10 is on the driver", timeout=120)
    (a, frozen), b = ranks[1], ranks[3][0]
    faulted = time.monotonic()
    os.kill(frozen, signal.SIGSTOP)  # silent past SPARKHVD_HEARTBEAT_TIMEOUT_SECONDS (8 s here)
    try:
        pending.wait_for_output("restart 1 of 2 after", timeout=120)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(frozen, signal.SIGCONT)  # gone with its executor, or it finds its attempt over and leaves
    _faults.wait_for_ranks(cluster, NP, timeout=60)
    time.sleep(1.0)  # training again, from the commit
    _faults.kill_executor(cluster, b)
    outcome = pending.result(300)
    seconds = time.monotonic() - faulted
    assert outcome.ok, f"the run did not survive a frozen rank then a killed executor: {outcome.error}"
    weights, steps = outcome.values[0]
    assert _same(weights, reference[0]) and steps == reference[1] == STEPS  # bit for bit, no step counted twice
    assert [e["lost"] is not None for e in outcome.restarts] == [True, True], outcome.restarts
    first, second = outcome.restarts
    assert re.match(rf"rank 1 on host {a.hostname} \({re.escape(a.address)}\) has not been heard from", first["lost"]), first
    assert "asked Spark to replace executor" in outcome.output and f"on {a.address}" in outcome.output
    assert a.hostname not in second["lost"] and a.address not in second["lost"], second  # not the replaced executor
    # the relaunch placed ranks anew: host B's two ranks are whichever the second attempt gave it
    assert re.fullmatch(rf"ranks \d,\d ran on executor \d+ on host {b.hostname} \({re.escape(b.address)}\), which Spark "
                        "lost: Command exited with code 137", second["lost"]) or "ExecutorLostFailure" in second["lost"], second
    lines = [line for line in outcome.output.splitlines() if re.search(r"restart [12] of 2 after", line)]
    print(f"\n[cluster] a frozen rank on host A, then host B's executor killed: the run ended {seconds:.1f} s after "
          f"the first fault; {first['seconds']:.1f} s and {second['seconds']:.1f} s from each failure to training "
          "resumed\n" + "\n".join(f"[cluster]   {line}" for line in lines))
    assert not cluster.wait_no_ranks(timeout=30)
    # the replacement executors forked their ranks from the warm process their host already had: after the
    # restarts, at most one idle warm process per task slot of a host (one per host, by the key)
    warm = {h.hostname: len(cluster.processes(h, SERVER_MODULE)) for h in cluster.hosts}
    assert all(n <= cluster.slots // len(cluster.hosts) for n in warm.values()), warm


def test_host_bs_executor_decommissioned_is_a_preemption_that_loses_no_step(cluster, reference):
    """SIGPWR to host B's executor JVM: Spark decommissions it (spark.decommission.enabled, as a Kubernetes pod's
    preStop hook or a cluster manager's spot notice does). Every rank leaves at a commit soon after; the run goes on
    from it, counted against max_preemptions (max_restarts=0 here), with the uninterrupted run's weights, bit for
    bit, and no step done twice."""
    pending, b = _training(cluster, runner={"max_restarts": 0}, say_steps=True)
    noticed = time.monotonic()
    _faults.kill_executor(cluster, b, signal.SIGPWR)
    outcome = pending.result(300)
    seconds = time.monotonic() - noticed
    assert outcome.ok, f"the run did not survive a decommissioned executor: {outcome.error}"
    weights, steps = outcome.values[0]
    assert _same(weights, reference[0]) and steps == reference[1] == STEPS
    [event] = outcome.restarts
    assert event["kind"] == "preemption" and event["commit"]["steps"] >= 10, event
    assert re.fullmatch(rf"a preemption: executor \d+ on host {b.hostname} \({re.escape(b.address)}\), which runs "
                        r"ranks \d,\d, is being decommissioned by Spark", event["lost"]), event
    done = [int(m) for m in re.findall(r"^\[0\] step (\d+) done$", outcome.output, re.M)]
    lost = len(done) - STEPS  # steps done again after the relaunch: those past the commit it resumed from
    line = next(line for line in outcome.output.splitlines() if "preempted: relaunch 1 (max_preemptions)" in line)
    print(f"\n[cluster] host B's executor decommissioned (SIGPWR): the run ended {seconds:.1f} s after the signal; "
          f"{event['seconds']:.1f} s from the notice to training resumed; {lost} steps lost\n[cluster]   {line}")
    assert lost == 0 and sorted(done) == list(range(1, STEPS + 1)), done
    assert not cluster.wait_no_ranks(timeout=30)


def _executors(cluster) -> set:
    return {(e["host"], e["port"]) for e in cluster.driver.executors()}


@pytest.mark.timeout(480)  # the cut-off host's ranks take up to ~60 s to end themselves, its executor longer to return
def test_a_host_cut_off_goes_on_with_the_other_host_down_to_min_np(cluster):
    before = _executors(cluster)  # not while a run goes: the driver answers one request at a time
    pending = cluster.driver.submit("elastic_train", NP, runner={"max_restarts": 1, "min_np": 2, "start_timeout": 20})
    for r in range(NP):
        pending.wait_for_output(f"[{r}] rank {r} pid", timeout=120)
    ranks = _faults.wait_for_ranks(cluster, NP, timeout=30)
    pending.wait_for_output("[0] commit of step 10 is on the driver", timeout=120)
    b = ranks[3][0]
    faulted = time.monotonic()
    _faults.link_down(b)
    try:
        outcome = pending.result(300)
    finally:
        _faults.heal(cluster)
    seconds = time.monotonic() - faulted
    assert outcome.ok, f"the run did not survive host B's link going down: {outcome.error}"
    event = outcome.restarts[0]
    assert (event["np_before"], event["np_after"]) == (4, 2), event
    assert re.match(rf"ranks? [23](,3)? on host {b.hostname} ", event["lost"]), event  # silent, by its heartbeats
    assert f"on {b.address}" in outcome.output or b.hostname in outcome.output  # its executor was replaced
    weights, steps = outcome.values[0]
    assert steps == STEPS and len(outcome.hosts) == 2 and b.hostname not in outcome.hosts
    line = next(line for line in outcome.output.splitlines() if "restart 1 of 1 after" in line)
    print(f"\n[cluster] host B's link down: the run ended {seconds:.1f} s after the fault, with np=2\n[cluster]   {line}")
    left = cluster.wait_no_ranks(timeout=90)  # the cut-off host's ranks end when they notice the driver is gone
    assert not left, left
    deadline = time.monotonic() + 150  # host B's executor, which the restart asked Spark to replace, comes back
    while (len(now := _executors(cluster)) < len(cluster.hosts) or now == before) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert cluster.driver.run("whoami", NP, timeout=240).ok
