"""The zygote's preload (runner/_warm/server.py): an import that fails part-way makes it refuse to fork ranks.

A failed import removes its own module but keeps the submodules it had finished, so every rank forked from
that state would fail at its own import of the module (as ranks once did with torch._dynamo: "partially
initialized module 'torch._inductor' has no attribute 'custom_graph_pass'"); a fresh process imports it.
"""

from __future__ import annotations

import sys
import textwrap

import pytest

from sparkhvd.runner._warm import server as _warm_server

pytestmark = pytest.mark.unit


@pytest.fixture
def packages(tmp_path, monkeypatch):
    """A folder on sys.path where a test writes packages; what they import leaves sys.modules afterwards."""
    monkeypatch.syspath_prepend(str(tmp_path))
    before = set(sys.modules)
    yield tmp_path
    for name in set(sys.modules) - before:
        del sys.modules[name]


def _package(root, name: str, init: str, **modules: str) -> None:
    folder = root / name
    folder.mkdir()
    (folder / "__init__.py").write_text(textwrap.dedent(init))
    for module, text in modules.items():
        (folder / f"{module}.py").write_text(textwrap.dedent(text))


def test_an_import_that_fails_part_way_is_the_reason_not_to_fork(packages):
    _package(packages, "halfway_pkg", """
        from . import done
        raise OSError("the cache folder is gone")
    """, done="VALUE = 1\n")
    why = _warm_server._import_whole("halfway_pkg")
    assert why == ("preloading halfway_pkg failed (OSError: the cache folder is gone) with 1 of its modules left "
                   "imported, which a forked rank's own import of it would trip over")
    assert "halfway_pkg" not in sys.modules and "halfway_pkg.done" in sys.modules  # Python's own leftovers


def test_a_module_that_is_not_installed_is_no_reason(packages):
    assert _warm_server._import_whole("sparkhvd_no_such_module_here") is None


def test_a_module_that_imports_is_no_reason(packages):
    _package(packages, "whole_pkg", "from . import done\n", done="VALUE = 1\n")
    assert _warm_server._import_whole("whole_pkg") is None
    assert sys.modules["whole_pkg"].done.VALUE == 1


def test_a_missing_dependency_found_part_way_is_a_reason(packages):
    _package(packages, "needs_pkg", """
        from . import done
        import sparkhvd_no_such_dependency
    """, done="VALUE = 1\n")
    why = _warm_server._import_whole("needs_pkg")
    assert why.startswith("preloading needs_pkg failed (ModuleNotFoundError: No module named "
                          "'sparkhvd_no_such_dependency') with 1 of its modules left imported"), why
