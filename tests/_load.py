"""A busy machine for the tests that need one: CPU-bound processes beside the run."""

from __future__ import annotations

import contextlib
import subprocess
import sys


@contextlib.contextmanager
def cpu_hogs(n: int):
    """``n`` CPU-bound processes while it lasts, killed and reaped at its end."""
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        yield
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
