"""One run's supervision: what happens when a rank fails, dies, never starts, or Ctrl-C.

The driver service records what the ranks report; the launcher knows whether the tasks are
still alive. This loop reads both and decides: success once every rank has returned and
exited; failure on the first rank error, dead rank or launch failure (after a short grace
period that collects the other ranks' errors), or when ranks miss ``start_timeout``. On
failure it aborts the run (every worker's watch connection gets ABORT), stops the launcher
(cancels the Spark job group, or kills the local processes) and waits for the tasks to end,
so the SparkContext is ready for the next run and no process is left behind.
"""

from __future__ import annotations

import signal
import time
import warnings

from ._errors import HorovodRunError, StartTimeoutError
from ._launcher import Launcher
from ._logs import LogRouter
from ._service import DriverService, Failure

FAILURE_GRACE_S = 1.0  # after the first failure, wait this long for the other ranks' errors
ABORT_GRACE_S = 5.0  # after ABORT, wait this long for the rank processes to report their exit
STOP_WAIT_S = 15.0  # after an abort, wait this long for the tasks to end
EXIT_WAIT_S = 35.0  # after every result, wait this long for the rank processes to exit
_POLL_S = 0.05


class Deadline:
    """One start-up deadline whose message names the setting to raise."""

    def __init__(self, seconds: float, setting: str):
        self.seconds = seconds
        self.setting = setting
        self._end = time.monotonic() + seconds

    def expired(self) -> bool:
        return time.monotonic() >= self._end

    def message(self, what: str) -> str:
        return f"{what} within {self.seconds:g} s; raise {self.setting}"


def supervise(service: DriverService, launcher: Launcher, logs: LogRouter, *, np: int,
              start_timeout: float, run_id: str) -> None:
    """Return when every rank has returned its value; raise HorovodRunError otherwise."""
    start = Deadline(start_timeout, "start_timeout")
    first_problem_at = None
    all_results_at = None
    try:
        while True:
            with service.cv:
                service.cv.wait(_POLL_S)
                registered = set(service.registrations)
                failures = list(service.failures)
                exits = dict(service.exits)
                results = set(service.results)
            launch_failure = launcher.failure()
            dead = {r: c for r, c in exits.items() if r not in results and r not in {f.rank for f in failures}}
            if len(results) == np and len(exits) == np:
                launcher.join(STOP_WAIT_S)
                return
            if failures or dead or launch_failure:
                now = time.monotonic()
                first_problem_at = first_problem_at or now
                settled = len(exits) == np or launch_failure
                if now - first_problem_at >= FAILURE_GRACE_S or settled:
                    error = _failure_error(service, logs, failures, dead, launch_failure, run_id, launcher)
                    _stop(service, launcher, "another rank failed")
                    raise error
            elif len(registered) < np and start.expired():
                missing = sorted(set(range(np)) - registered)
                _stop(service, launcher, "the run did not start in time")
                raise StartTimeoutError(
                    f"{len(missing)} of {np} ranks (task{'s' if len(missing) > 1 else ''} "
                    f"{_ranks(missing)}) did not register with the driver "
                    + start.message(f"on {launcher.description}") + ", or look in the executor "
                    f"logs for why task {missing[0]} did not start.", log_dir=logs.log_dir, run_id=run_id)
            elif len(results) == np:
                all_results_at = all_results_at or time.monotonic()
                if time.monotonic() - all_results_at < EXIT_WAIT_S:
                    continue
                warnings.warn(f"sparkhvd run {run_id}: every rank returned but ranks "
                              f"{_ranks(sorted(set(range(np)) - set(exits)))} did not exit within "
                              f"{EXIT_WAIT_S:g} s; they were stopped.", RuntimeWarning, stacklevel=3)
                _stop(service, launcher, "the run has finished")
                return
    except KeyboardInterrupt:
        _stop(service, launcher, "the run was interrupted on the driver (KeyboardInterrupt)")
        raise


def _stop(service: DriverService, launcher: Launcher, reason: str) -> None:
    # Ctrl-C again while cleaning up would leave processes behind: hold it off briefly.
    previous = _ignore_sigint()
    try:
        service.abort(reason)
        _wait_for_exits(service, ABORT_GRACE_S)  # gracefully first: the ranks leave on ABORT
        launcher.stop()  # then by force: cancel the Spark job group, kill local processes
        launcher.join(STOP_WAIT_S)
    finally:
        _restore_sigint(previous)


def _wait_for_exits(service: DriverService, timeout: float) -> None:
    """Wait until every started rank's agent has reported its process's exit.

    An agent reports only after reaping its rank process, so afterwards none is left running.
    Ranks start only once all have registered: before that there is nothing to wait for.
    """
    deadline = time.monotonic() + timeout
    with service.cv:
        while service.placements is not None and len(service.exits) < service.np:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            service.cv.wait(remaining)


def _ignore_sigint():
    try:
        return signal.signal(signal.SIGINT, signal.SIG_IGN)
    except ValueError:  # not the main thread
        return None


def _restore_sigint(previous) -> None:
    if previous is not None:
        signal.signal(signal.SIGINT, previous)


def _ranks(ranks) -> str:
    return ",".join(str(r) for r in ranks)


def _failure_error(service, logs, failures: list[Failure], dead: dict, launch_failure, run_id, launcher):
    failures = sorted(failures, key=lambda f: f.arrived)
    lines = []
    if failures:
        first = failures[0]
        groups: dict[tuple, list[int]] = {}
        for f in failures:
            groups.setdefault((f.type, f.message), []).append(f.rank)
        summary = "; ".join(f"rank{'s' if len(r) > 1 else ''} {_ranks(sorted(r))}: {t}: {m}"
                            for (t, m), r in groups.items())
        lines.append(f"HorovodRunner run {run_id} failed: {summary}")
        lines.append(f"\nTraceback of rank {first.rank} (the first to fail):\n{first.traceback.rstrip()}")
    for rank, code in sorted(dead.items()):
        how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
        text = f"rank {rank}'s process {how} before returning a result"
        tail = logs.tail(rank)
        if tail:
            text += "; its last output lines:\n    " + "\n    ".join(tail[-10:])
        lines.append(text if lines else f"HorovodRunner run {run_id} failed: {text}")
    if launch_failure:
        text = f"{launcher.description}: {launch_failure}"
        lines.append(text if lines else f"HorovodRunner run {run_id} failed: {text}")
    lines.append(f"\nEach rank's full output is in {logs.log_dir}/rank-<rank>.log.")
    error = HorovodRunError("\n".join(lines),
                            failures=[(f.rank, f.type, f.message, f.traceback) for f in failures],
                            log_dir=logs.log_dir, run_id=run_id)
    if failures and failures[0].pickled:
        try:
            import cloudpickle

            error.__cause__ = cloudpickle.loads(failures[0].pickled)  # an authenticated frame
        except Exception:  # noqa: BLE001 - the class may not exist on the driver
            pass
    return error
