"""The slots this driver's running sparkhvd runs hold (runner/_backends/running.py): the arithmetic in the fast tier,
and what the Spark backend makes of it on the real local[2] session. Whole runs at once: tests/runner/test_concurrent_runs.py.
"""

from __future__ import annotations

import contextlib
import re

import pytest

from sparkhvd.runner._agent.spec import TaskSpec
from sparkhvd.runner._backends import running
from sparkhvd.runner._backends.running import Stage
from sparkhvd.runner._backends.spark import SparkLauncher, free_slots, slots_for_restart


@contextlib.contextmanager
def holding(*stages: Stage):
    """``stages`` hold their slots in the registry until the block ends."""
    for stage in stages:
        running.hold(stage)
    try:
        yield
    finally:
        for stage in stages:
            running.release(stage.group)


@pytest.mark.unit
def test_a_run_fits_in_what_the_others_leave_and_is_refused_beyond_it():
    others = [Stage("app", "aaaa", "sparkhvd-aaaa-0", 2), Stage("app", "bbbb", "sparkhvd-bbbb-0", 1),
              Stage("app", "bbbb", "sparkhvd-bbbb-1", 1)]  # run bbbb's old stage, its tasks still ending
    assert running.free(8, others) == 4
    assert running.refusal(4, 8, "spark://m:7077", others) is None
    assert running.refusal(9, 8, "spark://m:7077", others) is None  # above the cluster: the slot check's sentence
    assert running.refusal(6, 8, "spark://m:7077", others) == (
        "np=6 needs 6 task slots but the cluster has 8 (spark://m:7077) and 2 sparkhvd runs of this driver still "
        "running hold 4 of them (run aaaa: 2 tasks, run bbbb: 2 tasks), leaving 4 free; use np<=4, start this run "
        "once one of them has ended, or use np=-6 to run on the driver.")
    one = [Stage("app", "cccc", "sparkhvd-cccc-0", 3)]
    assert running.free(2, one) == 0  # never below 0 (executors lost under a running stage)
    assert running.refusal(1, 2, "local[2]", one) == (
        "np=1 needs 1 task slot but the cluster has 2 (local[2]) and 1 sparkhvd run of this driver still running "
        "hold 3 of them (run cccc: 3 tasks), leaving 0 free; start this run once it has ended, or use np=-1 to run "
        "on the driver.")
    assert running.refusal(1, 2, "local[2]", []) is None


@pytest.mark.unit
def test_hold_checks_and_holds_in_one_step_and_release_gives_the_slots_back():
    first = Stage("unit-app", "aaaa", "sparkhvd-aaaa-0", 1)
    with holding(first):
        running.hold(Stage("unit-app", "bbbb", "sparkhvd-bbbb-0", 1), slots=2, master="local[2]")
        assert [s.run_id for s in running.held("unit-app")] == ["aaaa", "bbbb"]
        assert running.held("unit-app", other_than="aaaa") == [Stage("unit-app", "bbbb", "sparkhvd-bbbb-0", 1)]
        assert running.held("another-app") == []
        with pytest.raises(RuntimeError, match=re.escape(
                "np=1 needs 1 task slot but the cluster has 2 (local[2]) and 2 sparkhvd runs of this driver still "
                "running hold 2 of them (run aaaa: 1 task, run bbbb: 1 task), leaving 0 free; ")):
            running.hold(Stage("unit-app", "cccc", "sparkhvd-cccc-0", 1), slots=2, master="local[2]")
        running.hold(Stage("unit-app", "aaaa", "sparkhvd-aaaa-1", 1), slots=2, master="local[2]")  # its own: not others'
        running.release("sparkhvd-bbbb-0")
        running.release("sparkhvd-bbbb-0")  # idempotent
        running.release("sparkhvd-aaaa-1")
        assert running.held("unit-app") == [first]
    assert running.held("unit-app") == []


def test_a_first_stage_is_refused_at_launch_where_other_runs_took_the_slots_since_its_preflight(spark):
    """Two runs past their pre-flight at the same moment: the second to launch is refused, not left waiting."""
    sc = spark.sparkContext
    launcher = SparkLauncher(sc, 1)
    spec = TaskSpec(address=("127.0.0.1", 1), secret=b"s", run_id="late")
    with holding(Stage(sc.applicationId, "early", "sparkhvd-early-0", 2)):
        with pytest.raises(RuntimeError, match=re.escape(
                "np=1 needs 1 task slot but the cluster has 2 (local[2]) and 1 sparkhvd run of this driver still "
                "running hold 2 of them (run early: 2 tasks), leaving 0 free; start this run once it has ended, or "
                "use np=-1 to run on the driver.")):
            launcher.start(spec)
        assert launcher._thread is None  # nothing was submitted
        assert [s.run_id for s in running.held(sc.applicationId)] == ["early"]
    launcher.stop()


def test_a_restart_and_a_growing_run_count_what_other_runs_hold(spark):
    sc = spark.sparkContext
    with holding(Stage(sc.applicationId, "other", "sparkhvd-other-0", 1)):
        assert slots_for_restart(sc, 2, 1, 0.2, verbose=False, run_id="mine") == 1  # min_np=1: goes on with 1
        with pytest.raises(RuntimeError, match=r"after the failure Spark had 1 task slot free for the restart within "
                                               r"start_timeout=0.2 s, not the 2 it needs; pass min_np=<n> \(n <= 1\)"):
            slots_for_restart(sc, 2, None, 0.2, verbose=False, run_id="mine")
        assert slots_for_restart(sc, 2, None, 0.2, verbose=False, run_id="other") == 2  # a run's own stage is its own
        assert free_slots(sc) == 1  # submitted, not yet running: Spark's tracker does not see it
