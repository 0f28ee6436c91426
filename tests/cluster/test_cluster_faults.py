"""Faults on the 2-host cluster: each ends in one error whose first line is the root cause.

np=4 (ranks 0,1 on host A, 2,3 on host B) in an allreduce loop; the fault hits host B once every
rank is looping. Each test prints the seconds from the fault to the error, checks the headline,
that no rank process is left on any host, and that the next run works. The executors run with
short stall and heartbeat settings (conftest.FAULT_SETTINGS). Seconds are printed, not asserted.
"""

from __future__ import annotations

import re
import signal
import time

import pytest

from . import _faults

pytestmark = [pytest.mark.slow, pytest.mark.cluster]

NP = 4


def _looping(cluster):
    """Start the loop; returns it and (host A, host B): the hosts of ranks 0,1 and of ranks 2,3."""
    pending = cluster.driver.submit("allreduce_loop", NP)
    for r in range(NP):
        pending.wait_for_output(f"[{r}] rank {r} pid", timeout=120)
    ranks = _faults.wait_for_ranks(cluster, NP, timeout=30)
    time.sleep(2.0)  # well inside the loop, and past a heartbeat (1 s here) that says so
    return pending, ranks[0][0], ranks[3][0]


def _after(cluster, pending, what: str, bound: float = 120):
    """The failed run's Outcome, the seconds it took, and then: nothing left, the next run fine."""
    faulted = time.monotonic()
    outcome = pending.result(bound)
    seconds = time.monotonic() - faulted
    _faults.heal(cluster)
    assert not outcome.ok, f"the run succeeded despite: {what}"
    left = cluster.wait_no_ranks(timeout=90)  # a cut-off host's ranks end when they notice the driver is gone
    left_after = time.monotonic() - faulted
    deadline = time.monotonic() + 120  # a lost executor is replaced by the master
    while len(cluster.driver.executors()) < len(cluster.hosts) and time.monotonic() < deadline:
        time.sleep(0.5)
    nxt = cluster.driver.run("whoami", NP, timeout=240)
    print(f"\n[cluster] {what}: error after {seconds:.1f} s: {outcome.headline()[:300]}\n"
          f"[cluster]   leftovers: {left or 'none'} ({left_after:.0f} s after the fault); next run "
          f"{'OK' if nxt.ok else 'FAILED'} in {nxt.seconds:.1f} s")
    assert not left, f"rank processes left running after {what}: {left}"
    assert nxt.ok, f"the next run failed after {what}: {nxt.error}\n{nxt.diagnosis()}"
    return outcome


def test_a_rank_killed_by_a_signal_heads_the_error(cluster):
    pending, _, b = _looping(cluster)
    _faults.kill_rank(cluster, 3, signal.SIGKILL)
    outcome = _after(cluster, pending, "SIGKILL of rank 3")
    assert outcome.headline().endswith(f"failed: rank 3's process on host {b.hostname} ({b.address}) was killed by "
                                       "signal 9 before returning a result; its last output lines:"), outcome.error


def test_an_executor_killed_names_the_lost_executor_and_its_host(cluster):
    pending, _, b = _looping(cluster)
    _faults.kill_executor(cluster, b)
    outcome = _after(cluster, pending, "kill -9 of host B's executor JVM")
    headline = outcome.headline()
    # Spark's own account (the lost executor, or its job failure naming ExecutorLostFailure) comes first;
    # the survivors' broken links only after it.
    assert ("ranks 2,3 ran on executor" in headline and f"on host {b.hostname} ({b.address}), which Spark lost: "
            "Command exited with code 137" in headline) or "ExecutorLostFailure" in headline, outcome.error
    assert "MeshError" not in headline and "Connection reset" not in headline


def test_a_hosts_link_down_names_the_silent_host(cluster):
    pending, _, b = _looping(cluster)
    _faults.link_down(b)
    outcome = _after(cluster, pending, "host B's link down")
    assert re.search(rf"failed: ranks? [23](,3)? on host {b.hostname} \({re.escape(b.address)}\) ha(s|ve) not been "
                     r"heard from for [89]", outcome.headline()), outcome.error


def test_two_hosts_cut_off_from_each_other_end_in_the_stall_report(cluster):
    pending, a, b = _looping(cluster)
    _faults.partition(a, b)
    outcome = _after(cluster, pending, "hosts A and B cut off from each other")
    text = outcome.error
    assert "failed after a stall of 12 s (HOROVOD_STALL_SHUTDOWN_TIME_SECONDS=12)" in outcome.headline(), text
    assert "allreduce" in text and "loop." in text  # the op and its name
    assert re.search(r"the network between (these hosts|hosts \S+, \S+) is cut", text), text
    assert "same order" not in text, text
