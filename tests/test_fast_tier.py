"""The fast tier's guard (tests/conftest.py): a test marked unit may start no process, no HorovodRunner and no
Spark, so make check stays fast."""

from __future__ import annotations

import multiprocessing
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from sparkhvd import HorovodRunner

pytestmark = pytest.mark.unit

_FIX = re.escape("which the fast tier (make check) does not allow")


def test_a_unit_test_that_starts_a_process_fails():
    with pytest.raises(AssertionError, match=rf"a test marked unit started a process \(Popen.__init__\), {_FIX}; "
                                             "fake it, or drop the unit mark"):
        subprocess.run([sys.executable, "-c", "pass"])
    with pytest.raises(AssertionError, match=r"started a process \(BaseProcess.start\)"):
        multiprocessing.Process(target=print).start()  # were the guard off, a harmless child


def test_a_unit_test_that_starts_a_horovod_runner_fails():
    for name in ("run", "run_all"):
        with pytest.raises(AssertionError, match=rf"a test marked unit started a HorovodRunner \({name}\), {_FIX}"):
            getattr(HorovodRunner(np=-2), name)(print)


def test_a_unit_test_that_asks_for_spark_fails_before_it_runs(pytestconfig):
    root = str(Path(__file__).with_name("conftest.py"))  # tests/data has a conftest.py of its own
    conftest = next(p for p in pytestconfig.pluginmanager.get_plugins() if getattr(p, "__file__", None) == root)
    item = SimpleNamespace(get_closest_marker=lambda name: name == "unit" or None, fixturenames=["tmp_path", "spark"])
    with pytest.raises(pytest.fail.Exception, match=rf"a test marked unit asks for the spark fixture, {_FIX}"):
        conftest.pytest_runtest_setup(item)
    conftest.pytest_runtest_setup(SimpleNamespace(get_closest_marker=lambda name: None, fixturenames=["spark"]))
