"""Several runs at once from one driver (two notebook threads, a sweep), on the real local[2] session and real ranks.

The training functions meet through files in tmp_path: each says it has started, then waits for the others (and,
where the test holds them, for a release file), so the runs truly overlap while the test looks at them.
"""

from __future__ import annotations

import inspect
import os
import re
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from sparkhvd import HorovodRunner
from sparkhvd.runner._backends import running
from sparkhvd.runner._runner_config import RunnerConfig

LINES = 20  # each run prints this many lines of its own
MEET_S = 60.0  # how long a function waits for the others before it gives up (a test never waits this long)


def _meet(where, tag, others, hold=False):
    """Say ``tag`` has started; wait for ``others`` (and the release file where ``hold``); print LINES lines."""
    import os
    import time

    open(os.path.join(where, f"{tag}.started"), "w").close()
    wanted = [f"{other}.started" for other in others] + (["release"] if hold else [])
    deadline = time.monotonic() + MEET_S
    while not all(os.path.exists(os.path.join(where, name)) for name in wanted):
        if time.monotonic() > deadline:
            raise TimeoutError(f"run {tag} waited {MEET_S:g} s for {wanted} in {where}; found {os.listdir(where)}")
        time.sleep(0.02)
    for i in range(LINES):
        print(f"line {i} of run {tag}")
    return tag


class Runs:
    """Runs in threads of their own: ``start(tag, np, ...)``; ``results`` and ``errors`` by tag."""

    def __init__(self, where):
        self.where = where
        self.results, self.errors, self.threads = {}, {}, []

    def start(self, tag, np, others, hold=False):
        def go():
            try:
                self.results[tag] = HorovodRunner(np=np).run_all(_meet, where=self.where, tag=tag, others=others,
                                                                  hold=hold)
            except BaseException as exc:  # noqa: BLE001 - the test asserts on it
                self.errors[tag] = exc

        thread = threading.Thread(target=go, name=f"run-{tag}", daemon=True)
        self.threads.append(thread)
        thread.start()

    def wait_started(self, *tags):
        """Until every ``tags`` function has started; fails at once where a run failed first."""
        deadline = time.monotonic() + MEET_S
        while not all(os.path.exists(os.path.join(self.where, f"{t}.started")) for t in tags):
            assert not self.errors, self.errors
            assert time.monotonic() < deadline, f"not every run of {tags} started: {os.listdir(self.where)}"
            time.sleep(0.05)

    def join(self):
        for thread in self.threads:
            thread.join(MEET_S)
        assert not self.errors, self.errors
        assert not any(t.is_alive() for t in self.threads)


def own_lines_only(result, tag):
    """Each of the run's log files holds its own LINES lines, in order, and no other run's."""
    assert sorted(result.log_paths) == [0]
    with open(result.log_paths[0]) as f:
        text = f.read()
    assert re.findall(r"^line \d+ of run (\S+)$", text, re.M) == [tag] * LINES, text
    assert re.findall(r"^line (\d+) of run", text, re.M) == [str(i) for i in range(LINES)]


@pytest.mark.timeout(120)  # the third run refused only at its start_timeout (600 s) would fail here
def test_two_spark_runs_at_once_keep_their_logs_and_a_third_over_the_free_slots_is_refused(spark, tmp_path):
    sc, where = spark.sparkContext, str(tmp_path)
    runs = Runs(where)
    runs.start("a", 1, ["b"], hold=True)
    runs.start("b", 1, ["a"], hold=True)
    runs.wait_started("a", "b")  # both ranks run: each run's barrier stage holds one of local[2]'s two slots
    stages = running.held(sc.applicationId)
    assert sorted(s.tasks for s in stages) == [1, 1] and len({s.run_id for s in stages}) == 2
    a, b = sorted(s.run_id for s in stages)
    third = HorovodRunner._from_config(RunnerConfig(np=1, start_timeout=600))
    try:
        with pytest.raises(RuntimeError, match="^" + re.escape(
                f"np=1 needs 1 task slot but the cluster has 2 (local[2]) and 2 sparkhvd runs of this driver still "
                f"running hold 2 of them (run {a}: 1 task, run {b}: 1 task), leaving 0 free; start this run once one "
                "of them has ended, or use np=-1 to run on the driver.") + "$") as info:
            third.run(_meet, where=where, tag="c", others=[])
    finally:
        open(os.path.join(where, "release"), "w").close()
    assert type(info.value) is RuntimeError  # the pre-flight's refusal, not a StartTimeoutError
    assert not os.path.exists(os.path.join(where, "c.started"))
    runs.join()
    assert {tag: r.value for tag, r in runs.results.items()} == {"a": "a", "b": "b"}
    assert runs.results["a"].log_dir != runs.results["b"].log_dir
    for tag, result in runs.results.items():
        own_lines_only(result, tag)
    assert running.held(sc.applicationId) == []  # each stage gave its slot back when its job ended
    assert HorovodRunner(np=2).run(_meet, where=where, tag="d", others=[]) == "d"  # and both slots are free again


@pytest.mark.timeout(120)
def test_runs_on_the_driver_run_at_once_with_each_other_and_with_a_spark_run(spark, tmp_path):
    where = str(tmp_path)
    runs = Runs(where)
    tags = {"local1": -1, "local2": -1, "spark": 1}
    for tag, np in tags.items():
        runs.start(tag, np, [other for other in tags if other != tag])  # each returns once all three have started
    runs.join()
    assert {tag: r.value for tag, r in runs.results.items()} == {tag: tag for tag in tags}
    assert len({r.log_dir for r in runs.results.values()}) == 3
    for tag, result in runs.results.items():
        own_lines_only(result, tag)
    assert running.held(spark.sparkContext.applicationId) == []  # np<0 holds no task slot


_EMBEDDED = """
    import os, threading, time
    from sparkhvd import HorovodRunner

    {meet}
    MEET_S, LINES = {meet_s!r}, 1
    where, done = {where!r}, {{}}
    first = threading.Thread(target=lambda: done.update(a=HorovodRunner(np=1).run(_meet, where=where, tag="a",
                                                                                    others=[], hold=True)))
    first.start()
    while not os.path.exists(os.path.join(where, "a.started")) and first.is_alive():
        time.sleep(0.05)
    try:
        HorovodRunner(np=3).run(_meet, where=where, tag="b", others=[])
    except RuntimeError as exc:
        print("REFUSED", exc)
    open(os.path.join(where, "release"), "w").close()
    first.join(60)
    print("FIRST", done.get("a"))
"""


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_sparkhvds_own_session_is_not_stopped_under_a_run_for_a_bigger_one(tmp_path):
    """Without a SparkSession, sparkhvd starts local[2] for np=1; np=3 meanwhile would stop it under the first run."""
    meet = textwrap.indent(inspect.getsource(_meet), "    ").lstrip()  # the script's own: pickled by value
    script = textwrap.dedent(_EMBEDDED.format(meet=meet, meet_s=MEET_S, where=str(tmp_path)))
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=170,
                          cwd=str(tmp_path))
    said = dict(line.split(" ", 1) for line in proc.stdout.splitlines() if line.startswith(("REFUSED", "FIRST")))
    assert said.get("FIRST") == "a", proc.stdout[-3000:] + proc.stderr[-3000:]
    assert re.fullmatch(re.escape("np=3 needs 3 task slots but the session sparkhvd started for the runs of this "
                                  "driver, local[2], has 2, and run ") + r"[0-9a-f]{8}" + re.escape(
        " still uses it; start this run once it has ended (sparkhvd then starts a local[3] session), start a "
        "SparkSession with 3 or more cores before the first run, or use np=-3 to run on the driver."),
        said.get("REFUSED", "")), proc.stdout[-3000:]
