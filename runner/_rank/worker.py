"""The rank process: ``python -m sparkhvd.runner._rank.worker``, started by the task agent.

Reads the run secret from stdin, connects to the driver, fetches and runs the user's function, and
sends back its value or its exception. pyspark's ``TaskContext.get()`` there is its Spark task's
(``runner/_rank/task_context.py``). A second connection waits for the driver's ABORT and ends the
process at once, even when the main thread is blocked inside a collective (``runner/_rank/exit.py``);
a failure is reported as ``runner/_rank/failure.py`` says.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time

import cloudpickle

from ..._common import commits as _commits
from ..._common import context as _context
from ..._common import driver_messages as dm
from ..._common import protocol as _protocol
from ..._common import settings
from ..._common import traces as _traces
from ..._common.client import ServiceClient
from ..._common.protocol import SECRET_BYTES
from ..._common.topology import Placement
from .._payload import payload as _payload
from .._shared.host import rank_address
from . import aliases as _aliases
from . import lightning_nodes as _lightning_nodes
from . import startup
from . import steps as _steps
from . import task_context as _task_context
from .exit import die_with_parent, end, finished, leave, watch
from .failure import report_failure
from .heartbeat import Heartbeat

FAILED_EXIT_CODE = 1
_EXIT_GRACE_S = 30.0  # a rank whose interpreter has not exited this long after its result is ended
_FAILED_FLUSH_S = 1.0  # within the driver's grace for the other ranks' reports
_FINISHED_FLUSH_S = 10.0
CLOCK_SAMPLES = 5  # round trips to the driver that measure this rank's clock offset (the timeline's): the shortest


def main() -> int:
    """Join the run, run the user's function and ship its value; returns the exit code."""
    die_with_parent()
    _aliases.install()  # before the function is unpickled: it, or its module, may import horovod.* or sparkdl
    secret = sys.stdin.buffer.read(SECRET_BYTES)
    host, port = settings.DRIVER.raw().rsplit(":", 1)
    address = (host, int(port))
    placement = Placement(**json.loads(settings.PLACEMENT.raw()))
    rank = placement.rank
    _task_context.install(placement)  # before the function is unpickled: it, or its module, may import pyspark
    _lightning_nodes.install(placement)  # Trainer(devices=, num_nodes=) on any placement, once Lightning is imported
    _steps.count_optimizer_steps()  # RunResult.metrics' steps, once torch is imported
    client = ServiceClient(address, secret)
    threading.Thread(target=watch, args=(address, secret, rank), daemon=True, name="sparkhvd-watch").start()
    beat = Heartbeat.start(address, secret, rank,  # for the stall report and lost-rank check
                           on_lost=lambda reason: leave(rank, reason))
    try:
        fn, kwargs = _payload.loads(client.ask(dm.Fetch()).blob)  # verified frame
    except ModuleNotFoundError as exc:
        report_failure(client, rank, ModuleNotFoundError(
            f"rank {rank} cannot import module {exc.name!r}, which the training function "
            f"refers to; install it where the ranks run (pip install on every executor), or define "
            "the function in the notebook or driver script.", name=exc.name))
        return FAILED_EXIT_CODE
    try:
        local_address = rank_address(host)
    except ValueError as exc:
        report_failure(client, rank, exc)
        return FAILED_EXIT_CODE
    master = (settings.MASTER_ADDR.raw(), settings.MASTER_PORT.raw())  # before the function may change them
    _context._set(_context.WorkerContext(placement=placement, run_id=settings.RUN_ID.raw(),
                                         address=address, secret=secret, client=client,
                                         local_address=local_address, torchrun_master=master if all(master) else ()))
    beat.running()
    try:
        value = fn(**kwargs)
    except BaseException as exc:  # noqa: BLE001 - the user's failure, reported whole
        _failed(client, rank, exc)
        return FAILED_EXIT_CODE
    beat.finishing(timeout=1.0)  # its final metrics reach the driver before its result
    send_timeline(client, rank)
    _context.before_exit()
    _commits.flush(_FINISHED_FLUSH_S)  # should another rank still fail, the restart resumes from the newest commit
    return _ship(client, rank, value)


def _failed(client: ServiceClient, rank: int, exc: BaseException) -> None:
    """Report the user's function's failure (or its leaving at a commit for the driver to relaunch more ranks)."""
    if isinstance(exc, _commits.RanksChanged):
        _context.before_exit()
        report_failure(client, rank, exc, quiet=True)
        return
    _commits.flush(_FAILED_FLUSH_S)  # a peer lost mid-run: the commit on its way is what a restart resumes from
    send_timeline(client, rank)  # the merged timeline shows a failed run too
    report_failure(client, rank, _explained(exc))


def send_timeline(client: ServiceClient, rank: int) -> None:
    """Send the driver the timeline traces this rank recorded (``_common/traces.py``), if any: the run's merged
    trace (runner/_service/timeline.py). A trace over the frame's limit loses its latest events, halved until it
    fits; a driver that cannot take it costs the rank nothing."""
    segments = _traces.recorded()
    if not segments:
        return
    limit = _protocol.MAX_BLOB_BYTES - 1024
    blob = json.dumps(segments).encode()
    while len(blob) > limit:
        longest = max(segments, key=lambda s: len(s["events"]))
        if len(longest["events"]) < 2:
            return
        longest["events"] = longest["events"][:len(longest["events"]) // 2]
        blob = json.dumps(segments).encode()
    try:
        offset_us, error_us = clock_offset(client)
        client.ask(dm.Timeline(rank=rank, offset_us=offset_us, error_us=error_us), blob)
    except Exception as exc:  # noqa: BLE001 - a diagnostic: the rank's result or error goes on
        sys.stderr.write(f"sparkhvd: rank {rank} could not send its timeline to the driver: {type(exc).__name__}: "
                         f"{exc}\n")


def clock_offset(client: ServiceClient, samples: int = CLOCK_SAMPLES) -> tuple:
    """What to add to this rank's wall clock to have the driver's, in microseconds, and its error: of ``samples``
    round trips to the driver, the shortest's (NTP's rule: the driver read its clock somewhere in the trip, so the
    offset is within half of it)."""
    best = None
    for _ in range(samples):
        sent = time.time()
        reading = dm.decode(dm.ClockReading, client.ask(dm.Clock()).meta)
        back = time.time()
        if best is None or back - sent < best[0]:
            best = (back - sent, reading.now_us - (sent + back) / 2 * 1e6)
    trip, offset = best
    return round(offset), round(trip / 2 * 1e6)


def _explained(exc: BaseException) -> BaseException:
    """``exc``, or where it is torch's refusal to build the default process group a second time after
    ``hvd.init()`` built it, the same error with a sentence saying which to call."""
    builder = _context.default_group_builder()
    if builder is None or type(exc) is not ValueError or not _raised_in(exc, "init_process_group"):
        return exc
    explained = ValueError(f"{exc} {builder} already built this rank's default process group; call "
                           f"dist.init_process_group() before {builder} (which then uses that group), or only when "
                           "not dist.is_initialized().")
    return explained.with_traceback(exc.__traceback__)


def _raised_in(exc: BaseException, function: str) -> bool:
    """Whether ``function`` is among the frames ``exc`` passed through."""
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_name == function:
            return True
        tb = tb.tb_next
    return False


def _ship(client: ServiceClient, rank: int, value) -> int:
    """Send the function's return value to the driver (where the driver keeps it); returns the exit code."""
    if rank != 0 and settings.RETURN.get() == "0":
        client.ask(dm.Result(rank))  # run() keeps rank 0's only: nothing to ship
        return 0
    try:
        blob = cloudpickle.dumps(value)
    except Exception as exc:  # noqa: BLE001
        report_failure(client, rank, TypeError(
            f"the training function's return value ({type(value).__name__}) cannot be pickled: "
            f"{exc}; return plain Python objects, NumPy arrays or tensors"))
        return FAILED_EXIT_CODE
    limit = _protocol.MAX_BLOB_BYTES  # read now: the driver service takes no larger frame
    if len(blob) > limit:
        size, blob = len(blob), None
        report_failure(client, rank, ValueError(
            f"rank {rank}'s return value ({type(value).__name__}) pickles to {_size(size)}, over the "
            f"{_size(limit)} the driver takes; save it to shared storage on the rank (torch.save to a path every "
            "host and the driver reach) and return the path instead."))
        return FAILED_EXIT_CODE
    client.ask(dm.Result(rank), blob)
    return 0


def _size(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB" if n >= 1e5 else f"{n} bytes"


def run() -> int:
    """The rank process up to its exit (``python -m``, and a rank forked by the warm process:
    runner/_warm/child.py; both then ``end``); returns the exit code."""
    code = main()
    finished.set()
    sys.stdout.flush()
    sys.stderr.flush()
    # Exit joins the user's non-daemon threads; don't let one hang the run.
    timer = threading.Timer(_EXIT_GRACE_S, os._exit, (code,))
    timer.daemon = True
    timer.start()
    return code


if __name__ == "__main__":  # a fresh rank; a forked one runs startup.prepare in runner/_warm/child.py
    startup.prepare()
    end(run())  # interpreter exit without finalization, as a forked rank ends (runner/_rank/exit.py)
