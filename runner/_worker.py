"""The rank process: ``python -m sparkhvd.runner._worker``, started by the task agent.

Reads the run secret from stdin, connects to the driver, fetches and runs the user's
function, and sends back its value or its exception. A second connection waits for the
driver's ABORT and ends the process at once, even when the main thread is blocked inside a
collective.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import sys
import threading
import traceback

from . import _context
from ._agent import ENV_DRIVER, ENV_PARENT, ENV_PLACEMENT, ENV_RUN_ID
from ._client import RunAborted, ServiceClient
from ._protocol import SECRET_BYTES, Kind
from ._topology import Placement

ABORTED_EXIT_CODE = 75  # the driver told this rank to stop
FAILED_EXIT_CODE = 1
_EXIT_GRACE_S = 30.0  # a rank whose interpreter has not exited this long after its result is ended


def main() -> int:
    _die_with_parent()
    secret = sys.stdin.buffer.read(SECRET_BYTES)
    host, port = os.environ[ENV_DRIVER].rsplit(":", 1)
    address = (host, int(port))
    placement = Placement(**json.loads(os.environ[ENV_PLACEMENT]))
    client = ServiceClient(address, secret)
    threading.Thread(target=_watch, args=(address, secret, placement.rank), daemon=True,
                     name="sparkhvd-watch").start()

    import cloudpickle

    try:
        fn, kwargs = cloudpickle.loads(client.request(Kind.FETCH).blob)  # verified frame
    except ModuleNotFoundError as exc:
        _report_failure(client, placement.rank, ModuleNotFoundError(
            f"rank {placement.rank} cannot import module {exc.name!r}, which the training function "
            f"refers to; install it where the ranks run (pip install on every executor), or define "
            "the function in the notebook or driver script.", name=exc.name))
        return FAILED_EXIT_CODE
    _context._set(_context.WorkerContext(placement=placement, run_id=os.environ[ENV_RUN_ID],
                                         address=address, secret=secret, client=client))
    try:
        value = fn(**kwargs)
    except BaseException as exc:  # noqa: BLE001 - the user's failure, reported whole
        _report_failure(client, placement.rank, exc)
        return FAILED_EXIT_CODE
    try:
        blob = cloudpickle.dumps(value)
    except Exception as exc:  # noqa: BLE001
        _report_failure(client, placement.rank, TypeError(
            f"the training function's return value ({type(value).__name__}) cannot be pickled: "
            f"{exc}; return plain Python objects, NumPy arrays or tensors"))
        return FAILED_EXIT_CODE
    client.request(Kind.RESULT, {"rank": placement.rank}, blob)
    return 0


def _report_failure(client: ServiceClient, rank: int, exc: BaseException) -> None:
    import cloudpickle

    # Drop our own frame: the user's traceback starts at their function.
    tb = exc.__traceback__.tb_next if exc.__traceback__ is not None else None
    text = "".join(traceback.format_exception(type(exc), exc, tb))
    sys.stderr.write(text)
    sys.stderr.flush()
    try:
        pickled = cloudpickle.dumps(exc)
    except Exception:  # noqa: BLE001 - the text is enough
        pickled = b""
    try:
        client.request(Kind.ERROR, {"rank": rank, "type": type(exc).__name__,
                                    "message": str(exc), "traceback": text}, pickled)
    except (OSError, ConnectionError, RunAborted):
        pass


def _watch(address: tuple[str, int], secret: bytes, rank: int) -> None:
    """Exit at once when the driver aborts the run or goes away."""
    try:
        client = ServiceClient(address, secret)
        client.request(Kind.WATCH, {"rank": rank})
        reason = "the driver closed the run"
    except RunAborted as exc:
        reason = str(exc)
    except (OSError, ConnectionError) as exc:
        reason = f"lost the connection to the driver ({exc})"
    if not _finished.is_set():
        sys.stderr.write(f"sparkhvd: rank {rank} stopped by the driver: {reason}\n")
        sys.stderr.flush()
        os._exit(ABORTED_EXIT_CODE)


def _die_with_parent() -> None:
    """Ask Linux to kill this process when its task agent dies (a killed Spark task)."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            return
        if str(os.getppid()) != os.environ.get(ENV_PARENT, str(os.getppid())):
            os._exit(ABORTED_EXIT_CODE)  # the agent died before we set the signal


_finished = threading.Event()

if __name__ == "__main__":
    code = main()
    _finished.set()
    sys.stdout.flush()
    sys.stderr.flush()
    # Interpreter shutdown joins the user's non-daemon threads; don't let one hang the run.
    timer = threading.Timer(_EXIT_GRACE_S, os._exit, (code,))
    timer.daemon = True
    timer.start()
    sys.exit(code)
