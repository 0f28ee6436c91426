"""The code keeps its shape: layers point down with no cycles (import-linter), and ruff finds nothing.

The contracts are in pyproject.toml ([tool.importlinter]; docs/layout.md draws them), and so is ruff's
configuration ([tool.ruff]).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_the_layers_point_down_and_no_package_has_an_import_cycle():
    result = _run(str(Path(sys.executable).parent / "lint-imports"), "--no-cache")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


def test_ruff_finds_nothing():
    result = _run(sys.executable, "-m", "ruff", "check", "--no-cache", ".")
    assert result.returncode == 0, result.stdout + result.stderr
