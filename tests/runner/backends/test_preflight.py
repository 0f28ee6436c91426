"""The checks before the barrier stage, on the real local[2] session: each fails in seconds with one sentence.

The executors' interpreter is switched through ``sc.pythonExec``, the interpreter Spark really starts for
Python tasks (what PYSPARK_PYTHON sets when a SparkContext starts): no second SparkContext is needed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import os
import re
import shutil
import subprocess
import sys

import pytest

from sparkhvd import HorovodRunner
from sparkhvd.runner import StartTimeoutError
from sparkhvd.runner._backends import preflight as _preflight
from sparkhvd.runner._backends.api import check_ranks_per_task
from sparkhvd.runner._backends.spark import gpu_problem, slots_for_restart
from sparkhvd.runner._backends.spark_info import executor_resources
from sparkhvd.runner._runner_config import RunnerConfig
from sparkhvd.runner._shared import waits as _waits


def _rank():
    from sparkhvd._common import context as _context

    return _context.current().placement.rank


@contextlib.contextmanager
def executors_run(sc, python: str):
    """Spark starts ``python`` for this context's Python tasks until the block ends."""
    before = sc.pythonExec
    sc.pythonExec = python
    _preflight._checked.clear()  # what passed was another interpreter
    try:
        yield
    finally:
        sc.pythonExec = before
        _preflight._checked.clear()


@pytest.fixture(scope="module")
def bare_python(tmp_path_factory):
    """A real interpreter of the driver's Python version with nothing installed: no sparkhvd, torch or cloudpickle."""
    where = tmp_path_factory.mktemp("bare-venv")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(where)], check=True, timeout=120)
    yield str(where / "bin" / "python")
    shutil.rmtree(where, ignore_errors=True)


def test_the_executors_pass_and_a_second_run_does_not_probe_again(spark):
    sc = spark.sparkContext
    _preflight._checked.clear()
    found = _preflight.probe(sc, 2)
    assert [e.python for e in found] == [sys.executable] * 2
    assert _preflight.compare(_preflight.driver_environment(), found) is None
    _preflight.check_executors(sc, 2, 2)
    assert _preflight._checked[sc.applicationId] == _preflight._executor_ids(sc) == frozenset({"driver"})
    assert [HorovodRunner(np=2).run_all(_rank).values] == [[0, 1]]


def test_an_executor_python_without_sparkhvd_is_one_sentence_with_both_interpreters(spark, bare_python):
    sc = spark.sparkContext
    with executors_run(sc, bare_python):
        with pytest.raises(RuntimeError) as info:
            HorovodRunner(np=2).run(_rank)
    message = str(info.value)
    assert message.startswith(
        f"the executors' Python on executor host {_preflight.driver_environment().host}, {bare_python} "
        "(PYSPARK_PYTHON), cannot import sparkhvd (ModuleNotFoundError: No module named 'sparkhvd'), "
        f"but the driver runs {sys.executable}; set PYSPARK_PYTHON={sys.executable} ")
    assert f"install sparkhvd in that environment ({bare_python} -m pip install sparkhvd==" in message
    assert "\n" not in message and "at org.apache" not in message
    assert HorovodRunner(np=2).run_all(_rank).values == [0, 1]  # the session is fine afterwards


def test_an_executor_python_that_does_not_exist_is_one_sentence(spark):
    sc = spark.sparkContext
    with executors_run(sc, "/nonexistent/bin/python3"):
        with pytest.raises(RuntimeError, match=re.escape(
                "/nonexistent/bin/python3 (PYSPARK_PYTHON) does not run there (No such file or directory); set "
                "PYSPARK_PYTHON (spark.pyspark.python with spark-submit) to an interpreter with sparkhvd installed on "
                f"every executor host, such as the driver's {sys.executable}, before the SparkSession starts.")) as info:
            HorovodRunner(np=2).run(_rank)
    assert str(info.value).startswith("Spark could not start the executors' Python on host ")
    assert HorovodRunner(np=2).run_all(_rank).values == [0, 1]


def test_an_executor_python_that_is_not_python_is_one_sentence_with_sparks_reason(spark):
    with executors_run(spark.sparkContext, "/bin/false"):
        with pytest.raises(RuntimeError, match=re.escape(
                "sparkhvd's pre-flight Spark job, which asks each executor's Python (/bin/false) what it has "
                "installed, failed before any rank started: ")) as info:
            HorovodRunner(np=2).run(_rank)
    assert str(info.value).endswith(
        f"; point PYSPARK_PYTHON at a working Python {sys.version_info[0]}.{sys.version_info[1]} with sparkhvd "
        f"installed, such as the driver's {sys.executable}, or read the executor logs.")


def _other_minor_python() -> str | None:
    pyenv = os.path.expanduser("~/.pyenv/versions/3.{minor}*/bin/python3.{minor}")
    for minor in range(10, 16):
        if minor == sys.version_info[1]:
            continue
        for found in [shutil.which(f"python3.{minor}"), *sorted(glob.glob(pyenv.format(minor=minor)))]:
            if found and subprocess.run([found, "-c", "pass"], capture_output=True, timeout=30).returncode == 0:
                return found
    return None


def test_an_executor_python_of_another_minor_version_is_one_sentence(spark):
    other = _other_minor_python()
    if other is None:
        pytest.skip("no python3.X of another minor version on PATH")
    mine = f"{sys.version_info[0]}.{sys.version_info[1]}"
    with executors_run(spark.sparkContext, other):
        with pytest.raises(RuntimeError, match=rf"the executors' Python, {re.escape(other)} \(PYSPARK_PYTHON\), is "
                                               rf"Python 3\.\d+ but the driver runs Python {re.escape(mine)} "
                                               rf"\({re.escape(sys.executable)}\); Spark and cloudpickle need the same "
                                               r"Python minor version on both: set PYSPARK_PYTHON"):
            HorovodRunner(np=2).run(_rank)


def test_pysparks_own_version_mismatch_text_becomes_one_sentence():
    from pyspark.errors.error_classes import ERROR_CLASSES_MAP

    template = "\n".join(ERROR_CLASSES_MAP["PYTHON_VERSION_MISMATCH"]["message"])  # what the worker raises
    text = template.replace("<worker_version>", "3.99").replace("<driver_version>", "3.11")
    assert _preflight.job_failure(text, "/opt/py399/bin/python") == (
        "the executors' Python, /opt/py399/bin/python (PYSPARK_PYTHON), is Python 3.99 but the driver runs Python "
        f"3.11 ({sys.executable}); Spark and cloudpickle need the same Python minor version on both: set "
        f"PYSPARK_PYTHON to the driver's interpreter ({sys.executable}) or another Python 3.11 with sparkhvd "
        "installed, before the SparkSession starts.")
    assert _preflight.job_failure("Job aborted: java.lang.OutOfMemoryError", None) is None


@pytest.mark.parametrize("package", ["sparkhvd", "cloudpickle", "torch"])
def test_another_package_version_on_the_executors_names_both_versions_and_the_fix(spark, package):
    found = _preflight.probe(spark.sparkContext, 2)  # what the executors really have
    theirs = found[0].packages[package]
    real = _preflight.driver_environment()
    driver = dataclasses.replace(real, packages={**real.packages, package: "0.0.1"})
    assert _preflight.compare(driver, found) == (
        f"the executors' Python on executor host {found[0].host}, {found[0].python}, has {package} {theirs} but the "
        f"driver's, {driver.python}, has {package} 0.0.1; ranks must load what the driver pickled with the same "
        f"versions: run `{found[0].python} -m pip install {package}==0.0.1` on that host, or set "
        f"PYSPARK_PYTHON={driver.python} (the driver's interpreter, where that path exists on every executor host) in "
        f"the environment before the SparkSession starts, or spark.pyspark.python={driver.python} with spark-submit.")


def test_a_package_missing_on_the_executors_and_another_python_in_the_probes_data(spark):
    found = _preflight.probe(spark.sparkContext, 2)
    driver = _preflight.driver_environment()
    other_build = dataclasses.replace(driver, packages={**driver.packages, "torch": "2.13.0+cu128"})
    gpu_build = [dataclasses.replace(e, packages={**e.packages, "torch": "2.13.0+cpu"}) for e in found]
    assert _preflight.compare(other_build, gpu_build) is None  # a CPU driver with GPU executors: the same torch
    without_torch = [dataclasses.replace(e, packages={**e.packages, "torch": None},
                                         errors={"torch": "PackageNotFoundError: No package metadata was found for "
                                                          "torch"}) for e in found]
    assert (f"has no torch (PackageNotFoundError: No package metadata was found for torch) but the driver's, "
            f"{driver.python}, has torch {driver.packages['torch']}") in _preflight.compare(driver, without_torch)
    older = [dataclasses.replace(e, version="3.9.18") for e in found]
    assert _preflight.compare(driver, older).startswith(
        f"the executors on executor host {found[0].host} run Python 3.9.18 ({found[0].python}) but the driver runs "
        f"Python {driver.version} ({driver.python}); cloudpickle cannot move functions between Python 3.9 and "
        f"{driver.minor}: set PYSPARK_PYTHON={driver.python} ")


def test_gpus_requested_but_none_in_the_clusters_resources(spark):
    sc = spark.sparkContext
    executors = executor_resources(sc)  # local[2]: the driver, 2 cores, no GPU
    assert executors == [("driver", executors[0][1], 2, 0)]
    assert gpu_problem(2, 0.0, executors, 1, sc.master) is None
    assert gpu_problem(2, 1.0, executors, 1, sc.master) == (
        "np=2 asks each task for one GPU, as spark.executor.resource.gpu.amount=1 says, but none of Spark's 1 executor "
        "(local[2]) has a GPU resource; give the executors GPUs (spark.executor.resource.gpu.discoveryScript, and "
        "spark.worker.resource.gpu.* on a standalone cluster), or unset spark.executor.resource.gpu.amount to run on "
        "CPUs.")


def test_np_above_the_gpu_slots_names_each_executor():
    executors = [("0", "10.0.0.1", 4, 1), ("1", "10.0.0.2", 4, 1)]  # as executor_resources reports them
    assert gpu_problem(2, 1.0, executors, 1, "spark://m:7077") is None
    assert gpu_problem(3, 1.0, executors, 1, "spark://m:7077") == (
        "np=3 needs 3 GPUs, one per task, but Spark's executors can run 2 GPU tasks at once (executor 0 on 10.0.0.1: "
        "1 GPU, 4 cores, executor 1 on 10.0.0.2: 1 GPU, 4 cores; spark.task.cpus=1); use np<=2, or add executors "
        "with GPUs.")


def test_k_gpus_per_task_count_gpu_slots_in_tasks_of_k():
    executors = [("0", "10.0.0.1", 4, 2), ("1", "10.0.0.2", 4, 3)]  # 2 and 3 GPUs: one task of 2 on each
    assert gpu_problem(4, 2.0, executors, 1, "spark://m:7077", per_task=2) is None
    assert gpu_problem(6, 2.0, executors, 1, "spark://m:7077", per_task=2) == (
        "np=6 needs 6 GPUs, 2 per task (spark.task.resource.gpu.amount=2), but Spark's executors can run 2 GPU tasks "
        "at once (executor 0 on 10.0.0.1: 2 GPUs, 4 cores, executor 1 on 10.0.0.2: 3 GPUs, 4 cores; "
        "spark.task.cpus=1); use np<=4, or add executors with GPUs.")


def test_np_that_is_not_a_multiple_of_the_gpus_per_task_is_refused_with_the_nearest_two():
    check_ranks_per_task(4, 2)
    check_ranks_per_task(3, 1)
    with pytest.raises(RuntimeError, match=re.escape(
            "np=3 is not a multiple of spark.task.resource.gpu.amount=2: each Spark task holds 2 GPUs and runs one "
            "rank on each; use np=2 or np=4, or set spark.task.resource.gpu.amount=1 for one rank per task.")):
        check_ranks_per_task(3, 2)
    with pytest.raises(RuntimeError, match=r"^max_np=3 is not a multiple of spark.task.resource.gpu.amount=4: .*; "
                                           r"use max_np=4, or set"):
        check_ranks_per_task(3, 4, "max_np")


@pytest.mark.timeout(120)
def test_a_rank_that_does_not_register_is_said_once_with_the_numbers(spark, capsys, monkeypatch):
    monkeypatch.setattr(_waits, "WAIT_NOTE_S", 0.5)
    runner = HorovodRunner._from_config(RunnerConfig(np=2, start_timeout=5, stall_tasks=frozenset({0})))  # task 0 never registers
    with pytest.raises(StartTimeoutError):
        runner.run(_rank)
    said = [line for line in capsys.readouterr().out.splitlines() if "ranks registered after" in line]
    assert len(said) == 1, said
    assert re.fullmatch(r"\[sparkhvd\] [01] of 2 ranks registered after \d+ s; waiting for tasks? 0(,1)? on a Spark "
                        r"barrier stage on local\[2\]( \(Spark [^)]*\))?; will wait up to 5 s \(start_timeout\)",
                        said[0]), said


@pytest.mark.timeout(120)
def test_nothing_is_said_while_waiting_with_log_callback_only(spark, capsys, monkeypatch):
    monkeypatch.setattr(_waits, "WAIT_NOTE_S", 0.5)
    runner = HorovodRunner._from_config(RunnerConfig(np=2, start_timeout=3, driver_log_verbosity="log_callback_only",
                                                     stall_tasks=frozenset({0})))
    with pytest.raises(StartTimeoutError):
        runner.run(_rank)
    assert "[sparkhvd]" not in capsys.readouterr().out


def test_waiting_for_restart_slots_is_said_once_then_fails_with_the_fix(spark, capsys, monkeypatch):
    monkeypatch.setattr(_waits, "WAIT_NOTE_S", 0.2)
    sc = spark.sparkContext
    with pytest.raises(RuntimeError, match=r"after the failure Spark had 2 task slots free for the restart within "
                                           r"start_timeout=1.5 s, not the 3 it needs; pass min_np=<n> \(n <= 2\)"):
        slots_for_restart(sc, 3, None, 1.5)
    assert capsys.readouterr().out.splitlines() == [
        "[sparkhvd] waiting for 3 task slots for the restart: Spark has 2 (local[2], cores 2, 1 per task); will wait "
        "up to 1.5 s (start_timeout)"]
    assert slots_for_restart(sc, 3, 2, 1.0, verbose=False) == 2
    assert capsys.readouterr().out == ""


_USER_SESSION = """
import sys, time
from pyspark.sql import SparkSession
from sparkhvd import HorovodRunner
spark = SparkSession.builder.master("local[2]").config("spark.ui.enabled", "false").getOrCreate()
spark.sparkContext.setLogLevel("OFF")
started = time.monotonic()
try:
    HorovodRunner(np=2).run(print)
except RuntimeError as exc:
    print("ERROR", type(exc).__name__, exc)
print("SECONDS", time.monotonic() - started)
spark.stop()
"""


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_users_own_session_whose_executors_run_a_python_without_sparkhvd(bare_python):
    """The measured case: a session built in a driver whose PYSPARK_PYTHON is another venv's interpreter."""
    env = dict(os.environ, PYSPARK_PYTHON=bare_python)
    proc = subprocess.run([sys.executable, "-c", _USER_SESSION], capture_output=True, text=True, env=env, timeout=110)
    lines = dict(line.split(" ", 1) for line in proc.stdout.splitlines() if line.startswith(("ERROR", "SECONDS")))
    assert "ERROR" in lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert lines["ERROR"].startswith("RuntimeError the executors' Python on executor host ")
    assert (f"{bare_python} (PYSPARK_PYTHON), cannot import sparkhvd (ModuleNotFoundError: No module "
            f"named 'sparkhvd'), but the driver runs {sys.executable}; set PYSPARK_PYTHON={sys.executable}") \
        in lines["ERROR"]
    assert float(lines["SECONDS"]) < 30  # in seconds, not at start_timeout
