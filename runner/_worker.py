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

from .._common import commits as _commits
from .._common import context as _context
from .._common import protocol as _protocol
from .._common import settings
from .._common.client import RunAborted, ServiceClient
from .._common.network import local_address
from .._common.protocol import FILE_ONLY, FLUSH_CHARS, MAX_LINE_BYTES, SECRET_BYTES, Kind
from .._common.topology import Placement
from . import _aliases, _payload
from ._collateral import failure_line
from ._heartbeat import Heartbeat
from ._host import address_of, interface_of

ABORTED_EXIT_CODE = 75  # the driver told this rank to stop
FAILED_EXIT_CODE = 1
_EXIT_GRACE_S = 30.0  # a rank whose interpreter has not exited this long after its result is ended


def main() -> int:
    _die_with_parent()
    _aliases.install()  # before the function is unpickled: it, or its module, may import horovod.* or sparkdl
    secret = sys.stdin.buffer.read(SECRET_BYTES)
    host, port = settings.DRIVER.raw().rsplit(":", 1)
    address = (host, int(port))
    placement = Placement(**json.loads(settings.PLACEMENT.raw()))
    client = ServiceClient(address, secret)
    threading.Thread(target=_watch, args=(address, secret, placement.rank), daemon=True,
                     name="sparkhvd-watch").start()
    beat = Heartbeat.start(address, secret, placement.rank,  # for the stall report and lost-rank check
                           on_lost=lambda reason: _leave(placement.rank, reason))

    import cloudpickle

    try:
        fn, kwargs = _payload.loads(client.request(Kind.FETCH).blob)  # verified frame
    except ModuleNotFoundError as exc:
        _report_failure(client, placement.rank, ModuleNotFoundError(
            f"rank {placement.rank} cannot import module {exc.name!r}, which the training function "
            f"refers to; install it where the ranks run (pip install on every executor), or define "
            "the function in the notebook or driver script.", name=exc.name))
        return FAILED_EXIT_CODE
    try:
        local_address = _network(host)
    except ValueError as exc:
        _report_failure(client, placement.rank, exc)
        return FAILED_EXIT_CODE
    _context._set(_context.WorkerContext(placement=placement, run_id=settings.RUN_ID.raw(),
                                         address=address, secret=secret, client=client,
                                         local_address=local_address))
    beat.running()
    try:
        value = fn(**kwargs)
    except BaseException as exc:  # noqa: BLE001 - the user's failure, reported whole
        if isinstance(exc, _commits.RanksChanged):  # left at a commit for the driver to relaunch more ranks
            _context.before_exit()
            _report_failure(client, placement.rank, exc, quiet=True)
            return FAILED_EXIT_CODE
        _commits.flush(_FAILED_FLUSH_S)  # a peer lost mid-run: the commit on its way is what a restart resumes from
        _report_failure(client, placement.rank, exc)
        return FAILED_EXIT_CODE
    beat.finishing()
    _context.before_exit()
    _commits.flush(_FINISHED_FLUSH_S)  # should another rank still fail, the restart resumes from the newest commit
    if placement.rank != 0 and settings.RETURN.get() == "0":
        client.request(Kind.RESULT, {"rank": placement.rank})  # run() keeps rank 0's only: nothing to ship
        return 0
    try:
        blob = cloudpickle.dumps(value)
    except Exception as exc:  # noqa: BLE001
        _report_failure(client, placement.rank, TypeError(
            f"the training function's return value ({type(value).__name__}) cannot be pickled: "
            f"{exc}; return plain Python objects, NumPy arrays or tensors"))
        return FAILED_EXIT_CODE
    limit = _protocol.MAX_BLOB_BYTES  # read now: the driver service takes no larger frame
    if len(blob) > limit:
        size, blob = len(blob), None
        _report_failure(client, placement.rank, ValueError(
            f"rank {placement.rank}'s return value ({type(value).__name__}) pickles to {_size(size)}, over the "
            f"{_size(limit)} the driver takes; save it to shared storage on the rank (torch.save to a path every "
            "host and the driver reach) and return the path instead."))
        return FAILED_EXIT_CODE
    client.request(Kind.RESULT, {"rank": placement.rank}, blob)
    return 0


_FAILED_FLUSH_S = 1.0  # within the driver's grace for the other ranks' reports
_FINISHED_FLUSH_S = 10.0


def _size(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB" if n >= 1e5 else f"{n} bytes"


def _network(driver_host: str) -> str:
    """Choose this rank's address for its peers and point gloo at the same interface.

    gloo otherwise picks the address the hostname resolves to, which on many hosts is loopback
    (Debian's 127.0.1.1): its peers on other hosts are then refused.
    """
    chosen = settings.NETWORK_INTERFACE.get()
    try:
        local = address_of(chosen) if chosen else local_address(driver_host)
    except OSError as exc:
        raise ValueError(f"this rank cannot tell which of its addresses reaches the driver at {driver_host} ({exc}); "
                         "pass network_interface= with the name of the interface the hosts reach each other "
                         "on.") from exc
    if "GLOO_SOCKET_IFNAME" not in os.environ:
        interface = interface_of(local)
        if interface is not None:
            os.environ["GLOO_SOCKET_IFNAME"] = interface
    return local


def _report_failure(client: ServiceClient, rank: int, exc: BaseException, quiet: bool = False) -> None:
    """Tell the driver that this rank failed. Its output shows one line (runner/_collateral.py:
    ``failure_line``); the whole traceback goes to the rank's log file only, and the driver's error
    shows the first failing rank's, without sparkhvd's frames. So a rank that only stopped because
    another failed never prints a traceback that a reader could take for the cause."""
    import cloudpickle

    if quiet:
        sys.stderr.write(f"sparkhvd: rank {rank} leaves at this commit: {exc}\n")
    else:
        whole = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        if not _to_log_file(client, rank, whole):
            sys.stderr.write(whole)  # the driver did not take it: the whole traceback, in the rank's output
        sys.stderr.write(failure_line(rank, type(exc).__name__, str(exc)) + "\n")
    sys.stderr.flush()
    _reported.set()  # an abort from here on ends the process without another line: this one said why
    text = user_traceback(exc)
    try:
        pickled = cloudpickle.dumps(exc)
    except Exception:  # noqa: BLE001 - the text is enough
        pickled = b""
    try:
        client.request(Kind.ERROR, {"rank": rank, "type": type(exc).__name__,
                                    "message": str(exc), "traceback": text}, pickled)
    except (OSError, ConnectionError, RunAborted):
        pass


def _to_log_file(client: ServiceClient, rank: int, text: str) -> bool:
    """Send ``text`` to this rank's log file on the driver, not to its screen; False where it could not be sent.

    In frames of at most ``FLUSH_CHARS`` characters of lines of at most ``MAX_LINE_BYTES`` characters, as the
    agent sends the rank's output (runner/_agent.py), so that each frame's metadata stays under the protocol's
    limit. Sent on the connection the error report follows on: the driver has written it before it hears of the
    failure."""
    lines = [line[i:i + MAX_LINE_BYTES] for line in text.splitlines() for i in range(0, max(len(line), 1),
                                                                                       MAX_LINE_BYTES)]
    try:
        batch: list = []
        size = 0
        for line in lines:
            if batch and size + len(line) > FLUSH_CHARS:
                client.notify(Kind.LOG, {"rank": rank, "stream": FILE_ONLY, "lines": batch})
                batch, size = [], 0
            batch.append(line)
            size += len(line) + 1
        if batch:
            client.notify(Kind.LOG, {"rank": rank, "stream": FILE_ONLY, "lines": batch})
    except (OSError, ConnectionError):
        return False
    return True


_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_OURS = tuple(os.path.join(_PACKAGE, part) for part in ("runner" + os.sep, "collective" + os.sep, "data" + os.sep,
                                                         "__init__.py"))


def user_traceback(exc: BaseException) -> str:
    """``exc``'s traceback without sparkhvd's own frames (those stay in the rank's log)."""
    formatted = traceback.TracebackException(type(exc), exc, exc.__traceback__)
    hidden = 0
    seen = set()
    chain = [formatted]
    while chain:
        te = chain.pop()
        if id(te) in seen:
            continue
        seen.add(id(te))
        kept = [frame for frame in te.stack if not frame.filename.startswith(_OURS)]
        hidden += len(te.stack) - len(kept)
        te.stack = traceback.StackSummary.from_list(kept)
        chain += [t for t in (te.__cause__, te.__context__) if t is not None]
    text = "".join(formatted.format())
    if hidden:
        text += (f"({hidden} frame{'s' if hidden > 1 else ''} inside sparkhvd hidden; the whole traceback is in "
                 "this rank's log)\n")
    return text


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
    _leave(rank, reason)


def _leave(rank: int, reason: str) -> None:
    """End this process now, unless it is already finishing on its own (silently where it has already said why
    it failed)."""
    if not _finished.is_set():
        if not _reported.is_set():
            sys.stderr.write(f"sparkhvd: rank {rank} stopped by the driver: {reason}\n")
            sys.stderr.flush()
        folders = sys.modules.get(f"{__package__}._script_folder")  # __name__ is __main__ under python -m
        if folders is not None:
            folders.remove_unpacked()  # a script's shipped folder: os._exit skips its clean-up
        os._exit(ABORTED_EXIT_CODE)


def _die_with_parent() -> None:
    """Ask Linux to kill this process when its task agent dies (a killed Spark task).

    A rank forked by the zygote has its parent-death signal toward the zygote already, and the
    zygote kills it when its agent's connection closes (runner/_zygote.py).
    """
    if settings.WARM.get() == settings.WARM_FORKED:
        return
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            return
        if str(os.getppid()) != (settings.PARENT_PID.get() or str(os.getppid())):
            os._exit(ABORTED_EXIT_CODE)  # the agent died before we set the signal


_finished = threading.Event()
_reported = threading.Event()  # this rank has said why it failed (runner/_collateral.py: failure_line)


def run() -> int:
    """The rank process up to interpreter exit (``python -m`` and a rank forked by the zygote, runner/_zygote.py);
    returns the exit code."""
    code = main()
    _finished.set()
    sys.stdout.flush()
    sys.stderr.flush()
    # Interpreter shutdown joins the user's non-daemon threads; don't let one hang the run.
    timer = threading.Timer(_EXIT_GRACE_S, os._exit, (code,))
    timer.daemon = True
    timer.start()
    return code


if __name__ == "__main__":
    sys.exit(run())
