"""Shared fixtures: one real local Spark session for the whole test run."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile

import pytest

os.environ.setdefault("PYSPARK_PYTHON", sys.executable)  # executors run this interpreter

# Every run keeps its log folder (sparkhvd-<run>-* in the temp dir), and so do the drivers the tests
# start in subprocesses: give the whole session one temp dir of its own, removed at the end, so the
# suite leaves nothing behind. Subprocesses inherit it through TMPDIR.
_SESSION_TMP = tempfile.mkdtemp(prefix="sparkhvd-tests-")
os.environ["TMPDIR"] = tempfile.tempdir = _SESSION_TMP
# The JVMs read java.io.tmpdir, not TMPDIR (Spark extracts liblz4-java-*.so there): every pyspark
# driver the suite starts, here or in a subprocess, and its executors, get the same folder.
_JVM_TMP = f"-Djava.io.tmpdir={_SESSION_TMP}"
os.environ.setdefault("PYSPARK_SUBMIT_ARGS", f"--driver-java-options {_JVM_TMP} --conf "
                                             f"spark.executor.extraJavaOptions={_JVM_TMP} pyspark-shell")


def pytest_unconfigure(config):
    shutil.rmtree(_SESSION_TMP, ignore_errors=True)


@pytest.fixture(scope="session")
def spark():
    """A real ``local[2]`` SparkSession, as a notebook user would have one."""
    from pyspark.sql import SparkSession

    session = (SparkSession.builder.master("local[2]").appName("sparkhvd-tests")
               .config("spark.ui.enabled", "false")
               .config("spark.ui.showConsoleProgress", "false")
               .config("spark.sql.shuffle.partitions", "2")
               .getOrCreate())
    session.sparkContext.setLogLevel("ERROR")
    yield session
    session.stop()


def _live_rank_processes() -> list:
    import psutil

    found = []
    for p in psutil.Process().children(recursive=True):
        try:
            if p.status() != psutil.STATUS_ZOMBIE and "sparkhvd.runner._worker" in " ".join(p.cmdline()):
                found.append(p)
        except psutil.NoSuchProcess:
            pass
    return found


@pytest.fixture
def rank_processes():
    """Returns the live rank processes under this test process (none should be left behind)."""
    return _live_rank_processes
