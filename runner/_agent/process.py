"""Starting and ending the rank's process: forked from the warm process where it serves, else a fresh Python.

Either way the result has ``subprocess.Popen``'s surface (``pid``, ``stdin``, ``stdout``, ``stderr``,
``wait()``, ``poll()``), and the rank runs in a session of its own, so ``kill_group`` ends it with
everything it started.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from ..._common import settings
from .._warm import client as _warm_client
from .._warm.protocol import WORKER_ARGV


def start_rank(python: str | None, env: dict, rank: int, preload: tuple = ()):
    """Start the rank's process: forked from this executor's warm process (runner/_warm/client.py) when
    there is one, else a fresh ``python -m sparkhvd.runner._rank.worker rank=<rank>`` (the argument only
    names the rank in ps: /proc/<pid>/environ of a forked rank is the warm process's). ``preload``: what the
    warm process must have imported besides torch (runner/_payload/frameworks.py)."""
    argv = (*WORKER_ARGV, f"rank={rank}")
    if _warm_client.enabled(python):
        try:
            return _warm_client.spawn(env, argv=argv, preload=preload)
        except Exception as exc:  # noqa: BLE001 - any failure of the warm path: a fresh process
            if settings.WARM_DEBUG.get():
                sys.stderr.write(f"sparkhvd: the warm zygote did not start this rank ({type(exc).__name__}: {exc}); "
                                 "starting a fresh process.\n")
    return subprocess.Popen([python or sys.executable, *argv],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=env, start_new_session=True)


def kill_group(proc) -> None:
    """Kill the rank's process and everything it started (its own session and group)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
