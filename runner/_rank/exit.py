"""How a rank process ends: before its function returns (the driver aborts the run or goes away, or its agent
dies), and after it (``end``, both ways of starting a rank).

``watch`` waits on a connection of its own for the driver's ABORT, so the process ends at once even when its
main thread is blocked inside a collective; ``die_with_parent`` ties the process to its task agent. ``end`` is
interpreter exit without its finalization: no destructor of what the user's code left (the torch process groups
that runner/_rank/process_groups.py keeps) runs.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import signal
import sys
import threading

from ..._common import settings
from ..._common.client import RunAborted, ServiceClient
from ..._common.driver_messages import Watch

#: The script folder's module (runner/_payload/script_folder.py), looked up in sys.modules, never imported here:
#: only a script run has unpacked a folder to remove (tests/runner/test_module_names.py checks that the name points somewhere).
SCRIPT_FOLDER_MODULE = __package__.rpartition(".")[0] + "._payload.script_folder"

ABORTED_EXIT_CODE = 75  # the driver told this rank to stop
_PR_SET_PDEATHSIG = 1

finished = threading.Event()  # the rank is finishing on its own: an abort no longer ends it
reported = threading.Event()  # this rank has said why it failed (runner/_shared/collateral.py: failure_line)


def watch(address: tuple[str, int], secret: bytes, rank: int) -> None:
    """Exit at once when the driver aborts the run or goes away."""
    try:
        client = ServiceClient(address, secret)
        client.ask(Watch(rank))
        reason = "the driver closed the run"
    except RunAborted as exc:
        reason = str(exc)
    except (OSError, ConnectionError) as exc:
        reason = f"lost the connection to the driver ({exc})"
    leave(rank, reason)


def leave(rank: int, reason: str) -> None:
    """End this process now, unless it is already finishing on its own (silently where it has already said why
    it failed)."""
    if not finished.is_set():
        if not reported.is_set():
            sys.stderr.write(f"sparkhvd: rank {rank} stopped by the driver: {reason}\n")
            sys.stderr.flush()
        folders = sys.modules.get(SCRIPT_FOLDER_MODULE)
        if folders is not None:
            folders.remove_unpacked()  # a script's shipped folder: os._exit skips its clean-up
        os._exit(ABORTED_EXIT_CODE)


def die_with_parent() -> None:
    """Ask Linux to kill this process when its task agent dies (a killed Spark task).

    A rank forked by the warm process has its parent-death signal toward the warm process already, and
    that process kills it when its agent's connection closes (runner/_warm/server.py).
    """
    if settings.WARM.get() == settings.WARM_FORKED:
        return
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        except (OSError, AttributeError):
            return
        if str(os.getppid()) != (settings.PARENT_PID.get() or str(os.getppid())):
            os._exit(ABORTED_EXIT_CODE)  # the agent died before we set the signal


def end(code: int) -> None:
    """End as interpreter exit would (join non-daemon threads, run atexit handlers, flush), then ``os._exit``:
    finalizing the interpreter would free what the user's code left alive, and a torch process group's destructor
    can deadlock on the GIL (runner/_rank/process_groups.py). Never returns."""
    try:
        threading._shutdown()  # what Py_FinalizeEx calls
    except BaseException:  # noqa: BLE001
        pass
    try:
        atexit._run_exitfuncs()
    except BaseException:  # noqa: BLE001
        pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:  # noqa: BLE001
            pass
    os._exit(code)
