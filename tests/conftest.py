"""Shared fixtures: one real local Spark session for the whole test run."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile

import _jvm
import _s3
import pytest

from sparkhvd.runner._warm.protocol import WORKER_MODULE

os.environ.setdefault("PYSPARK_PYTHON", sys.executable)  # executors run this interpreter

# Every run keeps its log folder (sparkhvd-<run>-* in the temp dir), and so do the drivers the tests
# start in subprocesses: give the whole session one temp dir of its own, removed at the end, so the
# suite leaves nothing behind. Subprocesses inherit it through TMPDIR.
_SESSION_TMP = tempfile.mkdtemp(prefix="sparkhvd-tests-")
os.environ["TMPDIR"] = tempfile.tempdir = _SESSION_TMP
# The JVMs read java.io.tmpdir, not TMPDIR (Spark extracts liblz4-java-*.so there): every pyspark
# driver the suite starts, here or in a subprocess (a notebook's kernel, spark-submit), and its executors, get the
# same folder, and tests/_jvm.py's options: C1 only, one collector thread, no verification of Spark's jars (a session's
# JVM with a SQL job, a Python job and a Parquet file took 16.6 CPU-s instead of 19.4, means of 4 runs), and the
# archive of Spark's classes that the pytest-xdist controller builds (pytest_configure): a driver's JVM took 5.2
# CPU-s instead of 7.9 with it (3 runs each, alternated).
if "PYTEST_XDIST_WORKER" not in os.environ and _jvm.ARCHIVE_ENV not in os.environ:
    os.environ[_jvm.ARCHIVE_ENV] = os.path.join(_SESSION_TMP, "spark-classes.jsa")  # the workers inherit it
_JVM_OPTS = f"-Djava.io.tmpdir={_SESSION_TMP} {_jvm.opts()}"
os.environ.setdefault("PYSPARK_SUBMIT_ARGS", f"--driver-java-options '{_JVM_OPTS}' --conf "
                                             f"'spark.executor.extraJavaOptions={_JVM_OPTS}' pyspark-shell")
os.environ.setdefault("SPARK_SUBMIT_OPTS", _JVM_OPTS)  # spark-submit's own driver JVM (the CLI's tests)
# Every process this session starts inherits this mark, the warm zygotes too (whatever TMPDIR a test gives its
# ranks, which starts a zygote of that temp folder's own): how the session finds the zygotes to end. Each
# pytest-xdist worker marks its own, so a worker that finishes first ends only its own zygotes.
_SESSION_MARK = f"SPARKHVD_TEST_SESSION={os.getpid()}-{os.urandom(4).hex()}"
os.environ["SPARKHVD_TEST_SESSION"] = _SESSION_MARK.split("=", 1)[1]


_archive_builder = None  # the process building the JVMs' class archive (tests/_jvm.py), in the xdist controller


def pytest_configure(config):
    """In the pytest-xdist controller (make test), start building the JVMs' class archive beside the workers' start;
    a JVM started before it is written runs without it."""
    global _archive_builder
    if getattr(config, "workerinput", None) is None and getattr(config.option, "numprocesses", None):
        import subprocess

        _archive_builder = subprocess.Popen([sys.executable, _jvm.__file__, os.environ[_jvm.ARCHIVE_ENV]],
                                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                            stderr=subprocess.DEVNULL, start_new_session=True)


def pytest_unconfigure(config):
    if _archive_builder is not None:  # a short run ends before it does: it and its JVM end here
        import signal

        try:
            os.killpg(_archive_builder.pid, signal.SIGKILL)
        except OSError:
            pass
        _archive_builder.wait()
    stop_session_zygotes()
    shutil.rmtree(_SESSION_TMP, ignore_errors=True)


def session_zygotes() -> list:
    """The pids of the warm zygotes (runner/_warm/server.py) this test session started: they run detached,
    with this session's mark in their environment."""
    from sparkhvd.runner._warm.client import marked

    return marked(_SESSION_MARK)


def stop_session_zygotes() -> None:
    """End this session's zygotes (their running ranks die with them), so no process is left behind."""
    import signal

    for pid in session_zygotes():
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


@pytest.fixture(scope="module")
def s3():
    """moto's S3 server on 127.0.0.1 for the module, and a bucket on it (tests/_s3.py); skipped without moto."""
    yield from _s3.s3_fixture()


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
    processes = psutil.Process().children(recursive=True)
    for zygote in session_zygotes():  # ranks forked by a warm zygote are its children, not ours
        try:
            processes += psutil.Process(zygote).children(recursive=True)
        except psutil.NoSuchProcess:
            pass
    for p in processes:
        try:
            if p.status() != psutil.STATUS_ZOMBIE and WORKER_MODULE in " ".join(p.cmdline()):
                found.append(p)
        except psutil.NoSuchProcess:
            pass
    return found


@pytest.fixture
def rank_processes():
    """Returns the live rank processes under this test process (none should be left behind)."""
    return _live_rank_processes


#: The files that take longest in ``make test`` (from ``--durations=0`` on the 2-core machine: tests/cluster/ about
#: 250 s in all, test_notebooks.py 170 s, ... test_wheel.py 38 s), handed to the workers first, longest first, so
#: that no worker is left running a long file while the others idle (xdist's own order, by number of tests, put
#: them last). A file not listed follows, in collection order; a stale entry only costs balance.
LONGEST_FIRST = (
    "tests/cluster/", "tests/test_notebooks.py", "tests/runner/test_cli.py",
    "tests/runner/warm/test_warm_process_forks_ranks.py", "tests/frameworks/test_frameworks_torch.py",
    "tests/runner/test_faults.py", "tests/ml/test_ml_torch.py", "tests/runner/backends/test_spark_connect.py",
    "tests/test_notebook_estimators.py", "tests/runner/test_elastic_restart.py",
    "tests/runner/backends/test_preflight.py", "tests/data/test_converter.py", "tests/ml/test_ml_keras.py",
    "tests/runner/policy/test_stall_reports.py", "tests/runner/dropins/test_migration.py", "tests/test_packaging.py",
    "tests/ml/test_ml_lightning.py", "tests/test_wheel.py", "tests/collective/test_tensorflow_imports.py",
    "tests/runner/backends/test_gpu_pinning.py", "tests/frameworks/test_frameworks_tensorflow.py",
    # added 2026-12-02, their real-process loops (not yet measured with --durations)
    "tests/runner/rank/test_ddp_tutorial_ending.py", "tests/runner/test_concurrent_runs.py",
    "tests/runner/agent/test_no_line_lost.py", "tests/runner/test_driver_restart.py",
    "tests/frameworks/test_frameworks_deepspeed.py",  # added 2026-12-03: a ZeRO-2 restart, about 40 s
)


def _scope(nodeid: str) -> str:
    """What runs whole on one worker: a test file, or all of tests/cluster (which builds the testbed once)."""
    path = nodeid.split("::", 1)[0]
    return "tests/cluster/" if path.startswith("tests/cluster/") else path


def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist, the longest files first (LONGEST_FIRST); each file's tests keep their order."""
    if not getattr(config, "workerinput", None):
        return  # not an xdist worker: the order of a plain run is left as it is
    rank = {scope: i for i, scope in enumerate(LONGEST_FIRST)}
    items[:] = sorted(items, key=lambda item: rank.get(_scope(item.nodeid), len(rank)))  # stable


def pytest_xdist_make_scheduler(config, log):
    """Under pytest-xdist (``make test`` runs ``-n 4``): each test file runs whole on one worker, so its module
    fixtures run once, and the files of tests/cluster all on one worker, which builds the testbed once; the files
    are handed out in the workers' collection order (longest first, above)."""
    from xdist.scheduler import LoadScopeScheduling

    class ByFile(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _scope(nodeid)

    config.option.loadscopereorder = False  # keep the collection's order, not xdist's by-number-of-tests
    return ByFile(config, log)


# ---- the fast tier (make check: pytest -m unit) ---------------------------------------------------------

def _refuse_in_unit_test(what: str):
    def refuse(*args, **kwargs):
        raise AssertionError(f"a test marked unit {what}, which the fast tier (make check) does not allow; fake it, "
                             "or drop the unit mark so the test runs only in make test.")
    return refuse


def pytest_ignore_collect(collection_path, config):
    """Under ``-m unit`` (make check), a test file without a unit mark is not even imported: importing the
    TensorFlow tests alone would take much of the tier's minute."""
    if (config.getoption("markexpr") == "unit" and collection_path.name.startswith("test_")
            and collection_path.suffix == ".py" and "mark.unit" not in collection_path.read_text()):
        return True
    return None


def pytest_runtest_setup(item):
    if item.get_closest_marker("unit") and "spark" in item.fixturenames:
        pytest.fail("a test marked unit asks for the spark fixture, which the fast tier (make check) does not allow; "
                    "drop the unit mark so the test runs only in make test.", pytrace=False)


@pytest.fixture(autouse=True)
def _unit_tests_start_no_process(request):
    """A test marked ``unit`` fails if it starts a process or a HorovodRunner (warm zygotes included)."""
    if request.node.get_closest_marker("unit") is None:
        yield
        return
    import multiprocessing.process
    import subprocess

    from sparkhvd import HorovodRunner

    with pytest.MonkeyPatch.context() as patch:
        for owner, name in ((subprocess.Popen, "__init__"), (os, "fork"), (os, "posix_spawn"),
                            (multiprocessing.process.BaseProcess, "start")):
            patch.setattr(owner, name, _refuse_in_unit_test(f"started a process ({owner.__name__}.{name})"))
        for name in ("run", "run_all"):
            patch.setattr(HorovodRunner, name, _refuse_in_unit_test(f"started a HorovodRunner ({name})"))
        yield
