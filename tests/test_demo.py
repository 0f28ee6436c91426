"""The demo (`make demo`) runs and prints rank 0's loss per epoch and the returned value."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_demo_trains_and_returns_weights():
    out = subprocess.run([sys.executable, os.path.join(ROOT, "notebooks", "demo.py")], capture_output=True,
                         text=True, timeout=280, env=dict(os.environ, PYSPARK_PYTHON=sys.executable))
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    losses = [float(x) for x in re.findall(r"^\[0\] epoch \d loss (\S+)$", out.stdout, re.M)]
    assert len(losses) == 5 and losses[-1] < losses[0]
    assert "[1] epoch" not in out.stdout  # only rank 0 prints
    assert "rank 0 returned 4 tensors" in out.stdout
