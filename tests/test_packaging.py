"""Import weight, the Java check, and scheduled jobs through spark-submit."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import textwrap

import pytest

from sparkhvd.runner import JavaNotFoundError
from sparkhvd.runner._backends.java import check_java


def test_import_sparkhvd_imports_neither_torch_nor_pyspark():
    code = ("import sys, sparkhvd, sparkhvd.data, sparkhvd.ml\n"
            "heavy = [m for m in ('torch', 'pyspark', 'tensorflow') if m in sys.modules]\n"
            "print(heavy, sparkhvd.__version__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.split()[0] == "[]", out.stdout + out.stderr


def test_lazy_names_resolve_and_unknown_names_fail():
    import sparkhvd

    assert sparkhvd.HorovodRunner.__name__ == "HorovodRunner"
    with pytest.raises(AttributeError, match="module 'sparkhvd' has no attribute 'Nope'"):
        sparkhvd.Nope


def _fake_java(tmp_path, version_line):
    home = tmp_path / "jdk"
    (home / "bin").mkdir(parents=True)
    java = home / "bin" / "java"
    java.write_text(f"#!/bin/sh\necho '{version_line}' >&2\n")
    java.chmod(java.stat().st_mode | stat.S_IEXEC)
    return home


def test_java_check_accepts_this_machine():
    check_java()


@pytest.mark.parametrize("line, version", [('openjdk version "11.0.2" 2019-01-15', 11),
                                           ('java version "1.8.0_392"', 8)])
def test_java_too_old_is_one_sentence_with_the_fix(tmp_path, monkeypatch, line, version):
    monkeypatch.setenv("JAVA_HOME", str(_fake_java(tmp_path, line)))
    with pytest.raises(JavaNotFoundError, match=rf"^Spark needs Java 17\+ but .*/bin/java \(from JAVA_HOME=.*\) "
                                                rf"is Java {version}; install Java 17 or newer"):
        check_java()


@pytest.mark.unit
def test_java_missing_is_one_sentence_with_the_fix(tmp_path, monkeypatch):
    monkeypatch.delenv("JAVA_HOME", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(JavaNotFoundError, match=r"^Spark needs Java 17\+ but no java was found on PATH; install"):
        check_java()


def test_java_unreadable_version(tmp_path, monkeypatch):
    monkeypatch.setenv("JAVA_HOME", str(_fake_java(tmp_path, "garbage")))
    with pytest.raises(JavaNotFoundError, match=r"-version` could not be read; install Java 17"):
        check_java()


def test_make_reports_old_java(tmp_path):
    home = _fake_java(tmp_path, 'openjdk version "11.0.2"')
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run(["make", "-s", "check-java"], cwd=root, capture_output=True, text=True,
                         env=dict(os.environ, JAVA_HOME=str(home)), timeout=60)
    assert out.returncode != 0
    assert "error: Spark needs Java 17+ but" in out.stderr and "is Java 11" in out.stderr


def _spark_submit(tmp_path, body):
    import pyspark

    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(body))
    submit = os.path.join(os.path.dirname(pyspark.__file__), "bin", "spark-submit")
    env = dict(os.environ, PYSPARK_PYTHON=sys.executable, PYSPARK_DRIVER_PYTHON=sys.executable)
    return subprocess.run([submit, "--master", "local[2]", "--conf", "spark.ui.enabled=false", str(script)],
                          capture_output=True, text=True, env=env, timeout=240)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_spark_submit_job_returns_values_and_a_rank_that_fails_exits_it_non_zero(tmp_path):
    """One spark-submit (a JVM and a Spark application are the cost): a run that returns every rank's value, then
    a run whose rank raises, which ends the job with a non-zero status and the rank's error."""
    out = _spark_submit(tmp_path, """
        from pyspark.sql import SparkSession
        from sparkhvd import HorovodRunner
        spark = SparkSession.builder.getOrCreate()
        def train(base):
            from sparkhvd._common import context as _context
            return base + _context.current().placement.rank
        print("JOB RESULT", HorovodRunner(np=2).run_all(train, base=40).values, flush=True)
        def fail():
            raise FileNotFoundError("no such table: events")
        HorovodRunner(np=2).run(fail)
    """)
    assert "JOB RESULT [40, 41]" in out.stdout, out.stderr[-3000:]
    assert out.returncode != 0
    assert "FileNotFoundError: no such table: events" in out.stdout + out.stderr
    assert "sparkhvd.runner.HorovodRunError: HorovodRunner run" in out.stdout + out.stderr
