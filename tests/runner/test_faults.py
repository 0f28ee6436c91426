"""Faults on one host: each ends in one error whose headline is the root cause.

The multi-host faults (a lost executor, a dropped link, a partition) are in tests/cluster/.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest
from _paths import SCRIPTS

from sparkhvd import HorovodRunError, HorovodRunner


@pytest.mark.timeout(120)
def test_a_rank_killed_inside_an_allreduce_heads_the_error_before_the_survivors(rank_processes):
    def train():
        import torch

        import sparkhvd.collective.torch as hvd

        hvd.init()
        t = torch.ones(16 << 20)  # 64 MB: the kill lands inside gloo's transfer or the control exchange
        for step in range(1000):
            if hvd.rank() == 1 and step == 3:
                print("rank 1 is about to be killed", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            hvd.allreduce_(t, op=hvd.Sum)
        return "unreachable"

    started = time.monotonic()
    with pytest.raises(HorovodRunError) as info:
        HorovodRunner(np=-2).run(train)
    print(f"rank killed by a signal: the error came {time.monotonic() - started:.1f} s after the run started")
    text = str(info.value)
    headline = text.splitlines()[0]
    assert "failed: rank 1's process was killed by signal 9 before returning a result" in headline, text
    assert "rank 1 is about to be killed" in text
    if "rank 0:" in text:  # the survivor's own error, when it reported one, comes after the cause
        assert text.index("then, as a consequence, rank 0:") > text.index("killed by signal 9")
    assert rank_processes() == []


def test_run_ships_rank_zero_value_only_and_run_all_every_value():
    import threading

    def train():
        import sparkhvd.collective.torch as hvd

        hvd.init()
        return "rank 0's value" if hvd.rank() == 0 else threading.Lock()  # rank 1's could not even be pickled

    runner = HorovodRunner(np=-2)
    assert runner.run(train) == "rank 0's value"
    assert runner.last_result.values == ["rank 0's value", None]
    with pytest.raises(HorovodRunError, match=r"rank 1: TypeError: the training function's return value \(lock\) "
                                              "cannot be pickled"):
        runner.run_all(train)


def test_a_value_too_large_to_send_names_its_size_and_the_limit():
    def train():
        from sparkhvd._common import protocol as _protocol

        _protocol.MAX_BLOB_BYTES = 10_000  # stands in for the 2 GiB limit in this rank's process
        return b"x" * 200_000

    with pytest.raises(HorovodRunError, match=r"rank 0: ValueError: rank 0's return value \(bytes\) pickles to "
                                              r"0\.2 MB, over the 10000 bytes the driver takes; save it to shared "
                                              r"storage on the rank .* and return the path instead\."):
        HorovodRunner(np=-1).run(train)


def test_tracebacks_show_the_users_frames_not_sparkhvds(capsys):
    def train():
        import sparkhvd.collective.torch as hvd

        hvd.init()
        hvd.allreduce("not a tensor")  # the user's line, raised deep inside sparkhvd

    with pytest.raises(HorovodRunError) as info:
        HorovodRunner(np=-1).run(train)
    # The rank's output shows one line; its traceback is the error's, printed once.
    assert [line for line in capsys.readouterr().out.splitlines() if line.startswith("[0] ")] == [
        "[0] sparkhvd: rank 0 failed: TypeError: allreduce takes a torch.Tensor, got str. (whole traceback in "
        "rank-0.log)"]
    text = str(info.value)
    assert 'hvd.allreduce("not a tensor")' in text
    assert "rank 0: TypeError: allreduce takes a torch.Tensor, got str." in text
    for ours in ("_ops.py", "_rank/worker.py", "_submit.py", "/_engine/", "/_common/"):
        assert ours not in text
    assert "inside sparkhvd hidden; the whole traceback is in this rank's log" in text
    with open(os.path.join(info.value.log_dir, "rank-0.log")) as f:
        assert "_ops.py" in f.read()  # the whole traceback stays in the rank's log


def test_a_rank_that_stops_because_another_failed_shows_one_line_and_logs_its_traceback(monkeypatch, capsys):
    """The first traceback a reader meets is the cause's: no rank streams one; the error holds the cause's."""
    from sparkhvd.runner._policy import supervise as _supervise

    # The driver waits for rank 0's own error, as it does whenever rank 0 reports within the grace period.
    monkeypatch.setattr(_supervise, "FAILURE_GRACE_S", 120.0)

    def train():
        import torch

        import sparkhvd.collective.torch as hvd

        hvd.init()
        if hvd.rank() == 1:
            raise ValueError("rank 1's part of the data has no rows")
        hvd.allreduce(torch.ones(1), name="never_completes")  # rank 1 is gone: MeshError

    with pytest.raises(HorovodRunError) as info:
        HorovodRunner(np=-2).run(train)
    out = capsys.readouterr().out
    text = str(info.value)
    assert "Traceback" not in out, out
    shown = sorted(line for line in out.splitlines() if re.match(r"\[\d\] ", line))
    # Rank 0's allreduce meets rank 1's closed link in flight ("failed"), or, where rank 1 failed first, at its start
    # ("cannot run"): either is the consequence, never the cause.
    collateral = r"MeshError: allreduce (failed|cannot run): .*rank 1('s control link| closed its control link)"
    assert re.match(r"\[0\] sparkhvd: rank 0 stopped as a consequence of another rank's failure: " + collateral,
                    shown[0]), out
    assert shown[0].endswith(" (whole traceback in rank-0.log)") and len(shown) == 2, out
    assert shown[1] == ("[1] sparkhvd: rank 1 failed: ValueError: rank 1's part of the data has no rows (whole "
                        "traceback in rank-1.log)"), out
    lines = text.splitlines()
    assert lines[0].endswith("failed: rank 1: ValueError: rank 1's part of the data has no rows"), text
    assert re.match(r"then, as a consequence, rank 0: " + collateral, lines[1]), text
    assert text.count("Traceback (most recent call last)") == 1 and "Traceback of rank 1 (the first to fail)" in text
    logs = {}
    for rank in (0, 1):
        with open(os.path.join(info.value.log_dir, f"rank-{rank}.log")) as f:
            logs[rank] = f.read()
    assert re.search(r"(?s)Traceback \(most recent call last\):\n.*_rank/worker\.py.*in train\n.*_engine/\w+\.py.*\n"
                     r"sparkhvd\.collective\._engine\.mesh\.MeshError: allreduce (failed|cannot run): ", logs[0]), logs[0]  # whole
    assert re.search(r"(?s)Traceback \(most recent call last\):\n.*_rank/worker\.py.*in train\n.*\nValueError: rank 1's "
                     r"part of the data has no rows\n", logs[1]), logs[1]
    assert "stopped by the driver" not in logs[0]  # said once: an abort after its report adds nothing


@pytest.mark.unit
def test_the_rule_for_collateral_errors_is_one_for_the_ranks_and_the_driver():
    import doctest

    from sparkhvd.runner._shared import collateral as _collateral

    assert doctest.testmod(_collateral).failed == 0  # the examples in failure_line's docstring
    tf_wrapped = ("Graph execution error:\n\nDetected at node cond/PyFunc defined at (most recent call last):\n"
                  "  File x\n\nsparkhvd.collective._engine.mesh.MeshError: allreduce failed: rank 1's control link failed\n"
                  "\t [[{{node PyFunc}}]] [Op:__inference_train_function_1]")
    assert _collateral.is_collateral("UnknownError", tf_wrapped)
    assert _collateral.headline("UnknownError", tf_wrapped) == ("MeshError: allreduce failed: rank 1's control link "
                                                                 "failed (raised inside TensorFlow's UnknownError)")
    assert not _collateral.is_collateral("UnknownError", "Graph execution error:\n\nValueError: bad shape")
    assert _collateral.headline("ValueError", "\nfirst\nsecond") == "ValueError: first"
    cut = _collateral.HEADLINE_CHARS - len("KeyError: …")
    assert _collateral.headline("KeyError", "x" * 1000) == "KeyError: " + "x" * cut + "…"
    assert _collateral.headline("StopIteration", "") == "StopIteration"


def test_network_interface_is_checked_on_the_driver_and_on_every_rank():
    with pytest.raises(ValueError, match=r"network_interface='eth0,eth1' must be the name of one network "
                                         r"interface, such as 'eth0', present on every host"):
        HorovodRunner(np=-1, network_interface="eth0,eth1")
    with pytest.raises(HorovodRunError, match=r"ranks 0,1: ValueError: network_interface='nosuch9' has no IPv4 "
                                              r"address on host .* \(its interfaces with one: .*lo 127\.0\.0\.1.*\); "
                                              r"pass the name of the interface"):
        HorovodRunner(np=-2, network_interface="nosuch9").run(lambda: 1)


def _gloo_interface():
    import torch

    import sparkhvd.collective.torch as hvd

    hvd.init()
    total = hvd.allreduce(torch.tensor([float(hvd.rank() + 1)]), op=hvd.Sum).item()
    return os.environ.get("GLOO_SOCKET_IFNAME"), os.environ.get("NCCL_SOCKET_IFNAME"), total


def test_gloo_uses_the_interface_that_reaches_the_driver_or_the_chosen_one(monkeypatch):
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    monkeypatch.delenv("NCCL_SOCKET_IFNAME", raising=False)
    # np<0: the driver listens on loopback, so the ranks talk over lo whatever the hostname resolves to.
    assert HorovodRunner(np=-2).run_all(_gloo_interface).values == [("lo", None, 3.0)] * 2
    assert HorovodRunner(np=-2, network_interface="lo").run_all(_gloo_interface).values == [("lo", "lo", 3.0)] * 2


def test_the_configuration_bounds_the_slots():
    from pyspark import SparkConf

    from sparkhvd.runner._backends.spark import max_slots

    conf = SparkConf(loadDefaults=False)
    assert max_slots("local-cluster[2, 1, 1024]", conf) == 2
    assert max_slots("yarn", conf) is None and max_slots("spark://master:7077", conf) is None
    conf.set("spark.cores.max", "6").set("spark.task.cpus", "2")
    assert max_slots("spark://master:7077", conf) == 3
    assert max_slots("local-cluster[2,3,1024]", conf) == 2  # 1 slot of 2 cpus per 3-core executor


def test_spark_reason_keeps_what_spark_says_and_drops_the_java_stack(spark):
    from sparkhvd.runner._backends.spark_info import spark_reason

    with pytest.raises(Exception) as info:
        spark.sparkContext.parallelize([1], 1).map(lambda x: x / 0).collect()
    reason = spark_reason(info.value)
    assert "ZeroDivisionError: division by zero" in reason.splitlines()[-1]
    assert "\tat " not in reason and "An error occurred while calling" not in reason


@pytest.mark.slow
@pytest.mark.timeout(260)
def test_spark_faults_name_their_cause():
    """A real standalone cluster (local-cluster): an executor JVM killed, then (in the same application, as it ends
    it) spark.stop() mid-run."""
    # Fresh rank processes: the fault injector finds them among the driver's descendants, where ranks forked by a
    # warm process that an earlier application started (the key is shared across applications) are not.
    env = dict(os.environ, PYSPARK_PYTHON=sys.executable, SPARKHVD_WARM="0")
    proc = subprocess.run([sys.executable, os.path.join(SCRIPTS, "fault_job.py"), "executor", "stop"],
                          capture_output=True, text=True, env=env, timeout=240)
    out = proc.stdout
    assert proc.returncode == 0, out[-3000:] + proc.stderr[-3000:]
    import json

    reports = {r["fault"]: r for r in (json.loads(line[len("RESULT "):]) for line in out.splitlines()
                                       if line.startswith("RESULT "))}
    assert sorted(reports) == ["executor", "stop"], out[-3000:]
    for fault, report in reports.items():
        print(f"{fault}: the error came {report['seconds']:.1f} s after the fault; leftovers {report['left']}; "
              f"next run {report['next']}")
        assert report["left"] == [], report
    executor, stop = reports["executor"], reports["stop"]
    assert ("which Spark lost: Command exited with code 137" in executor["error"].splitlines()[0]
            or "ExecutorLostFailure" in executor["error"].split("then, as a consequence")[0]), executor["error"]
    assert executor["next"] == 7
    print(f"np=3 on 2 slots refused after {executor['refused']}")
    assert re.search(r"np=3 needs 3 task slots but the cluster has [0-2] \(local-cluster\[2,1,1024\], at most 2 "
                     r"by its configuration\); use np<=2", executor["refused"]), executor["refused"]
    headline = stop["error"].splitlines()[0]
    assert "the SparkContext was stopped while the run was going (spark.stop(), or the session ended); " \
           "start a new SparkSession to run again" in headline, stop["error"]
    assert "AttributeError" not in stop["error"]
