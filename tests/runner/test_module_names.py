"""Every module named by a string points at a module that exists: a move that leaves one behind fails here, not
silently in a run (an aborted script's folder left unpacked, ranks not found by the tests, a zygote never reused)."""

from __future__ import annotations

import importlib
import os

import pytest
import tomllib
from _paths import ROOT, TESTS

import sparkhvd
import sparkhvd.runner
from sparkhvd.runner._rank import aliases, failure
from sparkhvd.runner._rank import exit as rank_exit
from sparkhvd.runner._shared.package import PACKAGE_DIR
from sparkhvd.runner._warm import protocol

pytestmark = pytest.mark.unit


def _exists(module: str) -> bool:
    """Whether sparkhvd has a module or package of that name, found by its file: nothing is imported (a parent
    package such as sparkhvd.collective.tensorflow would import TensorFlow)."""
    first, *parts = module.split(".")
    assert first == "sparkhvd", module
    path = os.path.join(PACKAGE_DIR, *parts)
    return os.path.isfile(path + ".py") or os.path.isfile(os.path.join(path, "__init__.py"))


def test_the_warm_process_starts_and_forks_modules_that_exist():
    assert _exists(protocol.SERVER_MODULE) and protocol.SERVER_MODULE.endswith("._warm.server")
    assert protocol.WORKER_ARGV == ("-m", protocol.WORKER_MODULE) and _exists(protocol.WORKER_MODULE)


def test_a_rank_that_leaves_looks_up_the_script_folder_module_that_unpacks():
    assert rank_exit.SCRIPT_FOLDER_MODULE == "sparkhvd.runner._payload.script_folder"
    assert hasattr(importlib.import_module(rank_exit.SCRIPT_FOLDER_MODULE), "remove_unpacked")


def test_every_horovod_alias_stands_in_with_a_module_that_exists():
    for alias, target in aliases.ALIASES.items():
        modules = [] if target is None else [target] if isinstance(target, str) else list(target.values())
        for module in modules:  # imported by tests/runner/dropins/test_migration.py
            assert _exists(module), f"{alias} -> {module}"


def test_every_public_name_resolves():
    for package in (sparkhvd, sparkhvd.runner):
        for name in package.__all__:
            assert getattr(package, name) is not None, f"{package.__name__}.{name}"
    assert sparkhvd.log_to_driver is importlib.import_module("sparkhvd.runner._horovod_runner").log_to_driver


def test_the_console_script_points_at_its_main():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        module, _, function = tomllib.load(f)["project"]["scripts"]["sparkhvd"].partition(":")
    assert callable(getattr(importlib.import_module(module), function))


def test_the_package_folder_holds_the_package_and_a_ranks_hidden_frames_are_under_it():
    assert os.path.samefile(PACKAGE_DIR, os.path.dirname(sparkhvd.__file__))
    for prefix in failure._OURS:
        assert os.path.exists(prefix.rstrip(os.sep)), prefix


def test_the_suites_longest_files_exist(pytestconfig):
    root = os.path.join(TESTS, "conftest.py")  # tests/data and tests/cluster have a conftest.py of their own
    conftest = next(p for p in pytestconfig.pluginmanager.get_plugins() if getattr(p, "__file__", None) == root)
    for entry in conftest.LONGEST_FIRST:
        assert os.path.exists(os.path.join(ROOT, entry)), entry
