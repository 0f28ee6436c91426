"""The ``sparkhvd run`` console script, ``python -m sparkhvd`` and spark-submit: real processes, real Spark."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap

import pytest

from sparkhvd.runner._cli import main
from sparkhvd.runner._warm.protocol import WORKER_MODULE

BIN = os.path.dirname(sys.executable)
SPARKHVD = os.path.join(BIN, "sparkhvd")  # the console script pip installed beside this interpreter

ECHO = """
    import json, os, sys
    rank = json.loads(os.environ["SPARKHVD_PLACEMENT"])["rank"]
    print("ARGV", rank, json.dumps(sys.argv[1:]), flush=True)
"""


def _script(tmp_path, body, name="train.py"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return path


def _run(args, tmp_path, timeout=120, env=None, **kw):
    env = dict(os.environ, PYSPARK_PYTHON=sys.executable, PYSPARK_DRIVER_PYTHON=sys.executable, **(env or {}))
    return subprocess.run(args, cwd=tmp_path, capture_output=True, text=True, env=env, timeout=timeout, **kw)


def test_console_script_runs_a_script_on_local_ranks_and_passes_its_arguments(tmp_path):
    _script(tmp_path, ECHO)
    out = _run([SPARKHVD, "run", "--np", "-2", "train.py", "--np", "7", "--epochs", "3", "x y"], tmp_path)
    assert out.returncode == 0, out.stderr
    for rank in (0, 1):  # options after the script path are the script's, even one named like ours
        assert f'[{rank}] ARGV {rank} ["--np", "7", "--epochs", "3", "x y"]' in out.stdout


def test_python_dash_m_sparkhvd(tmp_path):
    _script(tmp_path, ECHO)
    out = _run([sys.executable, "-m", "sparkhvd", "run", "--np", "-1", "--log-dir", str(tmp_path / "logs"),
                "train.py", "a"], tmp_path)
    assert out.returncode == 0, out.stderr
    assert '[0] ARGV 0 ["a"]' in out.stdout
    assert 'ARGV 0 ["a"]' in (tmp_path / "logs" / "rank-0.log").read_text()


def test_a_failed_run_exits_1_with_the_error_on_stderr(tmp_path):
    _script(tmp_path, "raise FileNotFoundError('no such table: events')\n")
    out = _run([SPARKHVD, "run", "--np", "-2", "train.py"], tmp_path)
    assert out.returncode == 1
    assert out.stderr.startswith("HorovodRunner run ")
    assert "FileNotFoundError: no such table: events" in out.stderr


def test_sys_exit_status_of_the_script_fails_the_run(tmp_path):
    _script(tmp_path, "import sys\nsys.exit(4)\n")
    out = _run([SPARKHVD, "run", "--np", "-1", "--max-restarts", "2", "train.py"], tmp_path)
    assert out.returncode == 1
    assert "ScriptExit: the script train.py exited with status 4 (sys.exit(4))" in out.stderr
    assert "restart" not in out.stdout  # a user's failure is never retried


KEEPER = """
    import sparkhvd.collective.torch as hvd
    from sparkhvd._common import commits

    hvd.init()
    state = hvd.elastic.TorchState(step=0, loss=10.0)

    @hvd.elastic.run
    def loop(state):
        while state.step < 6:
            state.step += 1
            state.loss = abs(state.step - 3) + 0.5  # the lowest at step 3
            state.commit()
            commits.flush(30)  # each commit reaches the storage: none is replaced by a newer one on its way

    loop(state)
"""


def test_a_run_with_storage_lists_the_commits_it_kept(tmp_path):
    _script(tmp_path, KEEPER)
    storage = tmp_path / "storage"
    out = _run([SPARKHVD, "run", "--np", "-2", "--run-id", "cli1", "--storage", str(storage), "--keep-commits", "1",
                "--keep-best", "loss:min", "train.py"], tmp_path)
    assert out.returncode == 0, out.stderr
    listed = out.stdout.split(f"sparkhvd run: the run left 2 commits in {storage}:\n", 1)[1].splitlines()[:2]
    assert [line.split(": ", 1)[0] for line in listed] == ["  TorchState-0 commit 6 (step=6 loss=3.5)",
                                                           "  TorchState-0 commit 3 (step=3 loss=0.5)"], out.stdout
    for line in listed:
        assert os.path.exists(line.split(": ", 1)[1]), line


@pytest.mark.parametrize("argv, message", [
    (["run", "--np", "-1", "nope.py"], "the script 'nope.py' does not exist"),
    (["run", "--np", "0", "train.py"], "np=0 runs nothing; use np>0"),
    (["run", "--np", "-2", "--master", "local[2]", "train.py"],
     "--master, --remote and --conf configure the Spark session that --np N>0 runs on; --np -2 runs 2 processes on "
     "this machine without Spark: drop them, or use --np 2."),
    (["run", "--np", "2", "--master", "local[2]", "--remote", "sc://h:15002", "train.py"],
     "--master local[2] and --remote sc://h:15002 both say where to run: a Spark Connect server has its own master; "
     "give one of them."),
    (["run", "--np", "2", "--conf", "spark.ui.enabled", "train.py"],
     "--conf 'spark.ui.enabled' is not KEY=VALUE; write e.g. --conf spark.executor.memory=4g."),
    (["run", "--np", "-1", "--max-restarts", "-1", "train.py"], "max_restarts=-1 must be a whole number >= 0"),
    (["run", "--np", "-1", "--retry-on", "NoSuchError", "train.py"], "--retry-on NoSuchError names no exception "
     "class; give a builtin's name (OSError, TimeoutError) or module.Class of one the driver can import."),
    (["run", "--np", "-1", "--retry-on", "os.path", "train.py"], "--retry-on os.path names no exception class"),
    (["run", "--np", "-1", "--max-retries", "2", "train.py"], "max_retries=2 retries the exceptions named by "
     "retry_on, and retry_on is empty"),
    (["run", "--np", "-1", "--max-preemptions", "-2", "train.py"], "max_preemptions=-2 must be a whole number >= 0 "
     "or None (no limit)"),
    (["run", "--np", "-1", "--run-id", "r", "--storage", "/tmp/x", "--keep-best", "loss", "train.py"],
     "--keep-best 'loss' is not FIELD:min or FIELD:max; write e.g. --keep-best val_loss:min."),
    (["run", "--np", "-1", "--run-id", "r", "--storage", "/tmp/x", "--keep-best", "loss:lowest", "train.py"],
     "keep_best=('loss', 'lowest') must be (field, 'min') or (field, 'max')"),
    (["run", "--np", "-1", "--storage", "/tmp/x", "train.py"], "storage='/tmp/x' keeps a run's commits under its "
     "run_id, so that a new driver resumes them; pass run_id='...' too."),
    (["run", "train.py"], "the following arguments are required: --np"),
    (["run", "--np", "two", "train.py"], "argument --np: invalid int value: 'two'"),
    ([], "the following arguments are required: COMMAND"),
])
@pytest.mark.unit
def test_bad_usage_exits_2_with_the_reason(tmp_path, monkeypatch, capsys, argv, message):
    _script(tmp_path, "pass\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f"sparkhvd{' run' if argv else ''}: error: {message}" in err, err


def test_a_session_that_cannot_start_exits_1_with_the_fix(tmp_path):
    """What stops a Spark session before any rank (here no usable Java; np above the cluster's slots is the other
    case, refused in tests/runner/backends/test_ranks_in_a_spark_barrier_stage.py) is one line and exit status 1."""
    _script(tmp_path, "pass\n")
    java = tmp_path / "jdk" / "bin" / "java"
    java.parent.mkdir(parents=True)
    java.write_text("#!/bin/sh\necho 'openjdk version \"11.0.2\" 2019-01-15' >&2\n")
    java.chmod(0o755)
    out = _run([SPARKHVD, "run", "--np", "2", "--master", "local[2]", "train.py"], tmp_path,
               env={"JAVA_HOME": str(tmp_path / "jdk")})
    assert out.returncode == 1, out.stderr
    assert re.fullmatch(r"sparkhvd run: JavaNotFoundError: Spark needs Java 17\+ but .*/jdk/bin/java \(from JAVA_HOME=.*\) "
                        r"is Java 11; install Java 17 or newer.*\n", out.stderr, re.S), out.stderr


SLEEP = """
    import time
    print("rank is up", flush=True)
    while True:
        time.sleep(1)
"""


def _rank_pids(pid: int) -> list:
    import psutil

    ranks = []
    for p in psutil.Process(pid).children(recursive=True):
        try:
            if WORKER_MODULE in " ".join(p.cmdline()):
                ranks.append(p)
        except psutil.NoSuchProcess:
            pass
    return ranks


@pytest.mark.parametrize("np, signum, status", [
    (-2, signal.SIGTERM, 143),
    (-2, signal.SIGINT, 130),
    pytest.param(2, signal.SIGTERM, 143, marks=pytest.mark.slow),
])
@pytest.mark.timeout(120)
def test_a_signal_stops_every_rank_and_exits_128_plus_its_number(tmp_path, np, signum, status):
    import psutil

    _script(tmp_path, SLEEP)
    # Fresh rank processes, found among the command's descendants (ranks forked by a warm process that an earlier
    # run started are its children, not the command's)
    env = dict(os.environ, PYSPARK_PYTHON=sys.executable, SPARKHVD_WARM="0")
    proc = subprocess.Popen([SPARKHVD, "run", "--np", str(np), "train.py"], cwd=tmp_path, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        for line in proc.stdout:  # wait until a rank has printed: every rank process exists by then
            if "rank is up" in line:
                break
        ranks = _rank_pids(proc.pid)
        assert len(ranks) == abs(np)
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == status, err[-3000:]
    assert f"sparkhvd run: stopped by {signal.Signals(signum).name}; every rank was stopped." in err
    _, alive = psutil.wait_procs(ranks, timeout=30)  # generous: they are gone long before
    assert alive == []


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_spark_submit_runs_the_cli_on_spark_submits_master(tmp_path):
    import pyspark

    _script(tmp_path, ECHO)
    submit = os.path.join(os.path.dirname(pyspark.__file__), "bin", "spark-submit")
    cli = subprocess.run([sys.executable, "-c", "import sparkhvd.runner._cli as c; print(c.__file__)"],
                         capture_output=True, text=True, check=True).stdout.strip()
    out = _run([submit, "--master", "local[3]", "--conf", "spark.ui.enabled=false", cli,
                "run", "--np", "2", "train.py", "--epochs", "3"], tmp_path, timeout=150)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "on a Spark barrier stage on local[3]" in out.stdout  # spark-submit's master, not an embedded one
    for rank in (0, 1):
        assert f'ARGV {rank} ["--epochs", "3"]' in out.stdout
