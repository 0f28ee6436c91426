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

from . import _collateral
from ._collateral import RESIZE
from ._errors import HorovodRunError, StartTimeoutError
from ._launcher import Launcher
from ._logs import LogRouter
from ._service import DriverService, Failure
from ._stall_inspector import StallInspector

FAILURE_GRACE_S = 1.0  # after the first failure, wait this long for the other ranks' errors
#: When the only errors are the survivors' (a peer closed its links), wait this long for the cause:
#: the lost rank's exit code, or Spark's word on a lost executor.
UNEXPLAINED_GRACE_S = 10.0
_LOST_POLL_S = 0.5  # how often to ask the launcher about lost executors while a failure is unexplained
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


WAIT_NOTE_S = 5.0  # a wait with no progress for this long is said once on the driver


class WaitNote:
    """Says once, on the driver, what a wait is waiting for, when it has seen no progress for ``WAIT_NOTE_S``."""

    def __init__(self, verbose: bool):
        self.verbose = verbose
        self.said = False
        self._seen = object()
        self._since = time.monotonic()

    def progress(self, seen, text) -> None:
        """``seen``: what changes on progress (a count); ``text()``: the line to print, built only when due."""
        now = time.monotonic()
        if seen != self._seen:
            self._seen, self._since = seen, now
        elif self.verbose and not self.said and now - self._since >= WAIT_NOTE_S:
            self.said = True
            print(f"[sparkhvd] {text()}", flush=True)


RESIZE_WAIT_S = 300.0  # how long the first rank to leave for a resize waits for the others (rank 0 sends its commit)
GROW_CHECK_S = 2.0  # how often to ask Spark whether a run that can grow has free task slots


def supervise(service: DriverService, launcher: Launcher, logs: LogRouter, *, np: int,
              start_timeout: float, run_id: str, can_grow=None) -> bool:
    """Return when every rank has returned its value (False), or left at a commit to be relaunched with more ranks
    (True, after ``can_grow()`` said Spark has slots for them); raise HorovodRunError otherwise."""
    start = Deadline(start_timeout, "start_timeout")
    registering = WaitNote(logs.verbosity == "all")
    started_at = time.monotonic()
    first_problem_at = None
    resize_at = None
    grow_checked_at = -GROW_CHECK_S  # the first check as soon as every rank has registered
    all_results_at = None
    lost, lost_checked_at = None, 0.0
    stalls = StallInspector(np=np, run_id=run_id, log_dir=logs.log_dir)  # the stall report, lost ranks
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
                stalls.over()  # a stall it reported ended with the run, before its next check
                launcher.join(STOP_WAIT_S)
                return False
            if failures and service.hosts_updated is not None and not dead and not launch_failure \
                    and all(f.type == RESIZE for f in failures):
                if len(failures) == np and len(exits) == np:  # every rank left at the same commit
                    if not launcher.join(STOP_WAIT_S):
                        launcher.stop()  # the stage's tasks outlive their ranks: cancel it before relaunching
                    return True
                now = time.monotonic()
                resize_at = resize_at or now
                if now - resize_at < RESIZE_WAIT_S:
                    # Rank 0 may be sending the commit the relaunch resumes from; a rank that Spark lost meanwhile
                    # is a failure, handled below, not something to wait out.
                    if now - lost_checked_at >= _LOST_POLL_S:
                        lost, lost_checked_at = launcher.lost(_unfinished_peers(service, failures, exits)), now
                    if (stalled := stalls.check(service)) is not None:  # rank 0's heartbeats stopped, say
                        stalled.failed_at = now
                        _stop(service, launcher, stalls.abort_reason)
                        raise stalled
                    if lost is None:
                        continue
            if can_grow is not None and service.hosts_updated is None and len(registered) == np and not failures \
                    and time.monotonic() - grow_checked_at >= GROW_CHECK_S:
                grow_checked_at = time.monotonic()
                if can_grow():
                    service.announce_growth()
            if len(registered) < np and not (failures or dead or launch_failure):
                registering.progress(len(registered), lambda: _registering(registered, np, started_at, launcher,
                                                                           start_timeout))
            if failures or dead or launch_failure:
                now = time.monotonic()
                if first_problem_at is None:
                    first_problem_at = now
                if not explained(failures, dead, launch_failure, lost) and now - lost_checked_at >= _LOST_POLL_S:
                    lost, lost_checked_at = launcher.lost(_unfinished_peers(service, failures, exits)), now
                known = explained(failures, dead, launch_failure, lost)
                waited = now - first_problem_at
                everyone = {f.rank for f in failures} | set(exits) | results  # every rank has had its say
                if waited >= (FAILURE_GRACE_S if known else UNEXPLAINED_GRACE_S) or len(exits) == np \
                        or launch_failure or (known and len(everyone) == np):
                    if lost is None and (unfinished := _unfinished_peers(service, failures, exits)):
                        lost = launcher.lost(unfinished)  # Spark's word on where the silent ranks ran
                    error = _failure_error(service, logs, failures, dead, launch_failure, lost, run_id, launcher)
                    error.failed_at = first_problem_at
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
            elif (stalled := stalls.check(service)) is not None:
                stalled.failed_at = time.monotonic()
                _stop(service, launcher, stalls.abort_reason)
                raise stalled
            elif len(results) == np:
                all_results_at = all_results_at or time.monotonic()
                if time.monotonic() - all_results_at < EXIT_WAIT_S:
                    continue
                warnings.warn(f"sparkhvd run {run_id}: every rank returned but ranks "
                              f"{_ranks(sorted(set(range(np)) - set(exits)))} did not exit within "
                              f"{EXIT_WAIT_S:g} s; they were stopped.", RuntimeWarning, stacklevel=3)
                _stop(service, launcher, "the run has finished")
                return False
    except KeyboardInterrupt:
        _stop(service, launcher, "the run was interrupted on the driver (KeyboardInterrupt)")
        raise


def _registering(registered: set, np: int, started_at: float, launcher: Launcher, start_timeout: float) -> str:
    """What the driver waits for while tasks have not registered, with Spark's word on the stage where it has one."""
    missing = sorted(set(range(np)) - registered)
    stage = getattr(launcher, "waiting_for", lambda: "")()
    return (f"{len(registered)} of {np} ranks registered after {time.monotonic() - started_at:.0f} s; waiting for "
            f"task{'s' if len(missing) > 1 else ''} {_ranks(missing)} on {launcher.description}{stage}; will wait up "
            f"to {start_timeout:g} s (start_timeout)")


def _unfinished_peers(service: DriverService, failures: list[Failure], exits: dict) -> dict:
    """``address -> (hostname, ranks)`` of the ranks that have neither exited nor reported an error."""
    with service.cv:
        if service.placements is None:
            return {}
        reported = {f.rank for f in failures} | set(exits) | set(service.results)
        peers: dict[str, tuple[str, list[int]]] = {}
        for task, placement in enumerate(service.placements):
            if placement.rank not in reported:
                reg = service.registrations[task]
                peers.setdefault(reg.peer, (reg.host, []))[1].append(placement.rank)
    return peers


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


def is_collateral(failure: Failure) -> bool:
    """Whether a rank's reported error is what another rank's failure caused (runner/_collateral.py, the rule
    its worker applied too)."""
    return _collateral.is_collateral(failure.type, failure.message)


def explained(failures: list[Failure], dead: dict, launch_failure, lost) -> bool:
    """Whether what is known names a root cause, not only the survivors' collateral errors."""
    return bool(dead or launch_failure or lost or any(not is_collateral(f) for f in failures))


def _failure_error(service, logs, failures: list[Failure], dead: dict, launch_failure, lost, run_id, launcher):
    """One HorovodRunError whose headline is the root cause; collateral errors come after it."""
    failures = sorted(failures, key=lambda f: f.arrived)
    causes = [f for f in failures if not is_collateral(f)]
    collateral = [f for f in failures if is_collateral(f)]
    where = _where(service)
    lines = []
    if causes:
        lines.append(_grouped(causes))
    for rank, code in sorted(dead.items()):
        how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
        text = f"rank {rank}'s process{where(rank)} {how} before returning a result"
        tail = logs.tail(rank)
        text += "; its last output lines:\n    " + "\n    ".join(tail[-10:]) if tail else "; it printed nothing"
        lines.append(text)
    if lost:
        lines.append(lost)
    if launch_failure:
        lines.append(f"{launcher.description}: {launch_failure}")
    silent = _silent_ranks(service, failures, dead)
    silent_only = silent and not lines
    if silent_only:
        lines.append(f"rank{'s' if len(silent) > 1 else ''} {_ranks(silent)}{where(silent[0]) if len(silent) == 1 else ''} "
                     "stopped without a word: no error, no exit code and no result reached the driver, so their "
                     "process, executor or host was lost (look in the Spark executor logs of that host)")
    if collateral:
        lead = "then, as a consequence, " if lines else ""
        lines.append(lead + _grouped(collateral, one_line=True))
    lines[0] = f"HorovodRunner run {run_id} failed: {lines[0]}"
    first = (causes or collateral or [None])[0]
    if first is not None:
        lines.append(f"\nTraceback of rank {first.rank} (the first to fail{'' if causes else ', after the cause'}):"
                     f"\n{first.traceback.rstrip()}")
    lines.append(f"\nEach rank's full output is in {logs.log_dir}/rank-<rank>.log.")
    ordered = causes + collateral
    headline = lines[0].split(" failed: ", 1)[1].split("; its last output lines", 1)[0].split("\n", 1)[0]
    # Infrastructure, which a restart can outlive: a process killed, an executor, host or peer lost. Not a user's
    # exception, nor a SparkContext that is gone.
    retryable = not causes and not launcher.fatal
    error = HorovodRunError("\n".join(lines), failures=[(f.rank, f.type, f.message, f.traceback) for f in ordered],
                            log_dir=logs.log_dir, run_id=run_id, retryable=retryable, cause=headline)
    if silent_only:
        error.silent_ranks = silent
    if first is not None and first.pickled:
        try:
            import cloudpickle

            error.__cause__ = cloudpickle.loads(first.pickled)  # an authenticated frame
        except Exception:  # noqa: BLE001 - the class may not exist on the driver
            pass
    return error


def _grouped(failures: list[Failure], one_line: bool = False) -> str:
    """``ranks 0,3: KeyError: 'label'; rank 1: ...``; ``one_line``: each error as its first line (collateral errors,
    whose whole text, a TensorFlow wrapper's many lines say, is in ``HorovodRunError.failures`` and the logs)."""
    groups: dict[str, list[int]] = {}
    for f in failures:
        text = _collateral.headline(f.type, f.message) if one_line else f"{f.type}: {f.message}"
        groups.setdefault(text, []).append(f.rank)
    return "; ".join(f"rank{'s' if len(r) > 1 else ''} {_ranks(sorted(r))}: {text}" for text, r in groups.items())


def _silent_ranks(service, failures, dead) -> list:
    """Ranks that have neither returned, failed nor exited, and whose heartbeats have stopped."""
    now = time.monotonic()
    with service.cv:
        if service.placements is None:
            return []
        done = set(service.results) | set(service.exits)
        heard = {rank: (now - at, float(meta.get("interval") or 5)) for rank, (meta, at) in service.progress.items()}
    done |= {f.rank for f in failures} | set(dead)
    alive = {rank for rank, (ago, interval) in heard.items() if ago <= 2 * interval + 1}
    return [r for r in range(service.np) if r not in done and r not in alive]


def _where(service):
    """``rank -> " on host H (address)"`` when the run spans several hosts, else ``""``."""
    with service.cv:
        by_rank = {} if service.placements is None else {
            p.rank: service.registrations[t] for t, p in enumerate(service.placements)}
    if len({reg.host_id for reg in by_rank.values()}) < 2:
        return lambda rank: ""
    return lambda rank: f" on host {by_rank[rank].host} ({by_rank[rank].peer})" if rank in by_rank else ""
