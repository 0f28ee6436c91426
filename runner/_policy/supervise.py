"""One attempt's ranks, watched poll by poll: what happens when a rank fails, dies, never starts, or Ctrl-C.

The driver service records what the ranks report, and hands it out as ``RunStatus`` snapshots;
the launcher knows whether the tasks are still alive. ``Watch`` reads both on each poll of the
run's WAIT and SUPERVISE states (``_policy/policy.py``) and says when the attempt has ended:
every rank returned and exited; every rank left at a commit for a relaunch with more ranks;
or a failure, on the first rank error, dead rank or launch failure (after a short grace period
that collects the other ranks' errors), when ranks miss ``start_timeout``, or on a stall. On
failure it aborts the attempt (every worker's watch connection gets ABORT), stops the launcher
(cancels the Spark job group, or kills the local processes) and waits for the tasks to end, so
the SparkContext is ready for the next attempt and no process is left behind.
"""

from __future__ import annotations

import signal
import time
import warnings
from dataclasses import dataclass

from .._service.status import RunStatus
from .._shared.collateral import RESIZE
from .._shared.errors import HorovodRunError, StartTimeoutError
from .._shared.waits import Deadline, WaitNote
from .failure_report import explained, failure_error

POLL_S = 0.05  # how long each poll waits for news from the ranks
FAILURE_GRACE_S = 1.0  # after the first failure, wait this long for the other ranks' errors
#: When the only errors are the survivors' (a peer closed its links), wait this long for the cause:
#: the lost rank's exit code, or Spark's word on a lost executor.
UNEXPLAINED_GRACE_S = 10.0
_LOST_POLL_S = 0.5  # how often to ask the launcher about lost executors while a failure is unexplained
ABORT_GRACE_S = 5.0  # after ABORT, wait this long for the rank processes to report their exit
STOP_WAIT_S = 15.0  # after an abort, wait this long for the tasks to end
EXIT_WAIT_S = 35.0  # after every result, wait this long for the rank processes to exit
RESIZE_WAIT_S = 300.0  # how long the first rank to leave for a resize waits for the others (rank 0 sends its commit)
GROW_CHECK_S = 2.0  # how often to ask Spark whether a run that can grow has free task slots
PREEMPT_CHECK_S = 1.0  # how often to ask Spark whether it is decommissioning an executor of the run's ranks

RETURNED = "returned"  # every rank returned its value
LEFT = "left"  # every rank left at the same commit, to be relaunched with more ranks
FAILED = "failed"


@dataclass(frozen=True)
class Ended:
    """How an attempt ended: ``RETURNED``, ``LEFT``, or ``FAILED`` with the error to raise or restart after."""

    how: str
    error: HorovodRunError | None = None


class Watch:
    """The rules of one attempt, applied to one ``RunStatus`` at a time; keeps the times they need."""

    def __init__(self, service, launcher, logs, *, np: int, start_timeout: float, run_id: str, stalls,
                 can_grow=None, clock=time.monotonic, retry_on: tuple = (), stragglers=None, live=None):
        self.service, self.launcher, self.logs = service, launcher, logs
        self.np, self.start_timeout, self.run_id = np, start_timeout, run_id
        self.stalls = stalls  # the stall report and lost ranks (_stall_inspector.StallInspector)
        self.stragglers = stragglers  # the straggler line (stragglers.Stragglers); None: none
        self.live = live  # (status) -> None: the run's live view (live.py) drawn from each poll; None: none
        self.can_grow = can_grow  # () -> whether Spark has task slots for more ranks; None: the run cannot grow
        self.retry_on = retry_on  # module.qualname of the exception classes the run retries (failure_report.retried)
        self.clock = clock
        self.start = Deadline(start_timeout, "start_timeout", clock)
        self.note = WaitNote(logs.verbosity == "all", clock)
        self.started_at = clock()
        self.first_problem_at: float | None = None
        self.resize_at: float | None = None
        self.grow_checked_at = -GROW_CHECK_S  # the first check as soon as every rank has registered
        self.all_results_at: float | None = None
        self.lost: str | None = None  # Spark's word on lost executors, asked while a failure is unexplained
        self.lost_checked_at = 0.0
        self.preempted: str | None = None  # Spark's decommission notice for executors of these ranks, once seen
        self.preempted_at: float | None = None  # when the driver saw it
        self.preempt_checked_at = -PREEMPT_CHECK_S
        self.stamps: dict[str, float] = {}  # when a failed attempt's ranks had exited and its tasks ended (stop)

    def registering(self, status: RunStatus) -> Ended | None:
        """One poll while tasks register (the WAIT state): a failure, the start timeout, or None to go on."""
        launch_failure = self.launcher.failure()
        dead = status.dead()
        if status.failures or dead or launch_failure:
            return self._problem(status, dead, launch_failure)
        registered = status.registered
        self.note.progress(len(registered), lambda: self._registering(registered))
        if self.start.expired():
            return self._start_timeout(registered)
        return None

    def running(self, status: RunStatus) -> Ended | None:
        """One poll once every rank has its place (the SUPERVISE state): how the attempt ended, or None."""
        self._observe(status)
        launch_failure = self.launcher.failure()
        dead = status.dead()
        if status.finished():
            self.stalls.over()  # a stall it reported ended with the run, before its next check
            self.launcher.join(STOP_WAIT_S)
            return Ended(RETURNED)
        if status.failures and status.hosts_updated is not None and not dead and not launch_failure \
                and all(f.type == RESIZE for f in status.failures):
            if len(status.failures) == self.np and len(status.exits) == self.np:  # every rank left at the same commit
                if not self.launcher.join(STOP_WAIT_S):
                    self.launcher.stop()  # the stage's tasks outlive their ranks: cancel it before relaunching
                return Ended(LEFT)
            now = self.clock()
            self.resize_at = self.resize_at or now
            if now - self.resize_at < RESIZE_WAIT_S:
                # Rank 0 may be sending the commit the relaunch resumes from; a rank that Spark lost meanwhile is a
                # failure, handled below, not something to wait out.
                self._ask_lost(status, now)
                if (stalled := self.stalls.check(self.service)) is not None:  # rank 0's heartbeats stopped, say
                    return self._stalled(stalled, now)
                if self.lost is None:
                    return None
        self._ask_preempted(status)
        if self.can_grow is not None and status.hosts_updated is None and not status.failures \
                and self.clock() - self.grow_checked_at >= GROW_CHECK_S:
            self.grow_checked_at = self.clock()
            if self.can_grow():
                self.service.announce_growth()
        if status.failures or dead or launch_failure:
            return self._problem(status, dead, launch_failure)
        if (stalled := self.stalls.check(self.service)) is not None:
            return self._stalled(stalled, self.clock())
        if len(status.results) == self.np:
            return self._exiting(status)
        return None

    def _observe(self, status: RunStatus) -> None:
        """The straggler check and the live view read the poll's status; one that fails is off from then on."""
        for name, what in (("stragglers", "the straggler check"), ("live", "the live view")):
            observer = getattr(self, name)
            if observer is None:
                continue
            try:
                observer.check(status) if name == "stragglers" else observer(status)
            except Exception as exc:  # noqa: BLE001 - a diagnostic must not take the run down
                setattr(self, name, None)
                warnings.warn(f"sparkhvd run {self.run_id}: {what} failed ({type(exc).__name__}: {exc}) and is off "
                              "for the rest of this attempt; please report it with the run's logs.",
                              RuntimeWarning, stacklevel=2)

    def interrupted(self) -> None:
        """Ctrl-C on the driver: stop every rank before the KeyboardInterrupt goes on."""
        stop(self.service, self.launcher, INTERRUPTED)

    def _ask_preempted(self, status: RunStatus) -> None:
        """Ask the launcher, at most every ``PREEMPT_CHECK_S``, whether Spark is taking back an executor of the
        ranks; on the first notice, tell rank 0 at its next commit that every rank leaves at the one after it
        (Horovod's ``HostsUpdatedInterrupt``, hosts removed), and say so."""
        now = self.clock()
        if self.preempted is not None or status.failures or now - self.preempt_checked_at < PREEMPT_CHECK_S:
            return
        self.preempt_checked_at = now
        notice = self.launcher.preempted(status.unfinished())
        if notice is None:
            return
        self.preempted, self.preempted_at = notice, now
        self.service.announce_preemption()
        print(f"[sparkhvd] run {self.run_id}: preempted: {notice}; every rank leaves at one of its next two "
              "hvd.elastic commits (the first after rank 0 hears of it), and the run resumes from that commit on the "
              "executors Spark keeps.", flush=True)

    def _ask_lost(self, status: RunStatus, now: float) -> None:
        """Ask the launcher, at most every ``_LOST_POLL_S``, whether Spark lost the executors of the ranks not done."""
        if now - self.lost_checked_at >= _LOST_POLL_S:
            self.lost, self.lost_checked_at = self.launcher.lost(status.unfinished()), now

    def _problem(self, status: RunStatus, dead: dict, launch_failure) -> Ended | None:
        """A rank failed or died, or the launch failed: the run's error once the grace period has collected the
        other ranks' errors (or Spark's word on the cause), else None."""
        failures, exits = list(status.failures), status.exits
        now = self.clock()
        if self.first_problem_at is None:
            self.first_problem_at = now
        if not explained(failures, dead, launch_failure, self.lost):
            self._ask_lost(status, now)
        # A rank whose agent vanished explains the others' errors too: Spark's word on its executor, which standalone
        # gives only spark.standalone.executorRemoveDelayOnDisconnection (5 s) later where the Worker says nothing
        # (its host lost), is taken if it has come by the end of the grace.
        known = explained(failures, dead, launch_failure, self.lost) or bool(status.vanished())
        waited = now - self.first_problem_at
        everyone = status.failed | set(exits) | set(status.results)  # every rank has had its say
        if not (waited >= (FAILURE_GRACE_S if known else UNEXPLAINED_GRACE_S) or len(exits) == self.np
                or launch_failure or (known and len(everyone) == self.np)):
            return None
        if self.lost is None and (unfinished := status.unfinished()):
            self.lost = self.launcher.lost(unfinished)  # Spark's word on where the silent ranks ran
        error = failure_error(self.service, self.logs, failures, dead, launch_failure, self.lost, self.run_id,
                              self.launcher, self.retry_on)
        error.failed_at = self.first_problem_at
        stop(self.service, self.launcher, "another rank failed", self.stamps)
        return Ended(FAILED, error)

    def _start_timeout(self, registered: frozenset) -> Ended:
        missing = sorted(set(range(self.np)) - registered)
        stop(self.service, self.launcher, "the run did not start in time", self.stamps)
        return Ended(FAILED, StartTimeoutError(
            f"{len(missing)} of {self.np} ranks (task{'s' if len(missing) > 1 else ''} "
            f"{_ranks(missing)}) did not register with the driver "
            + self.start.message(f"on {self.launcher.description}") + ", or look in the executor "
            f"logs for why task {missing[0]} did not start.", log_dir=self.logs.log_dir, run_id=self.run_id))

    def _stalled(self, error: HorovodRunError, now: float) -> Ended:
        error.failed_at = now
        stop(self.service, self.launcher, self.stalls.abort_reason, self.stamps)
        return Ended(FAILED, error)

    def _exiting(self, status: RunStatus) -> Ended | None:
        """Every rank returned: wait ``EXIT_WAIT_S`` for their processes to exit, then stop them."""
        self.all_results_at = self.all_results_at or self.clock()
        if self.clock() - self.all_results_at < EXIT_WAIT_S:
            return None
        warnings.warn(f"sparkhvd run {self.run_id}: every rank returned but ranks "
                      f"{_ranks(sorted(set(range(self.np)) - set(status.exits)))} did not exit within "
                      f"{EXIT_WAIT_S:g} s; they were stopped.", RuntimeWarning, stacklevel=6)
        stop(self.service, self.launcher, "the run has finished")
        return Ended(RETURNED)

    def _registering(self, registered: frozenset) -> str:
        """What the driver waits for while tasks have not registered, with Spark's word on the stage where it has
        one."""
        missing = sorted(set(range(self.np)) - registered)
        stage = self.launcher.waiting_for()
        return (f"{len(registered)} of {self.np} ranks registered after {self.clock() - self.started_at:.0f} s; "
                f"waiting for task{'s' if len(missing) > 1 else ''} {_ranks(missing)} on "
                f"{self.launcher.description}{stage}; will wait up to {self.start_timeout:g} s (start_timeout)")


INTERRUPTED = "the run was interrupted on the driver (KeyboardInterrupt)"


def stop(service, launcher, reason: str, stamps: dict | None = None) -> None:
    """Abort the attempt's ranks, let them leave, then stop what is left by force. ``stamps`` gets the
    ``time.monotonic()`` when the ranks had exited (``exited``) and when the tasks had ended (``cancelled``)."""
    # Ctrl-C again while cleaning up would leave processes behind: hold it off briefly.
    previous = _ignore_sigint()
    stamps = {} if stamps is None else stamps
    try:
        service.abort(reason)
        # Gracefully first: the ranks leave on ABORT. Those on an executor Spark lost may never say so.
        service.wait_for_exits(ABORT_GRACE_S, lost=lambda: launcher.lost_ranks(service.status().unfinished()))
        stamps["exited"] = time.monotonic()
        launcher.stop()  # then by force: cancel the Spark job group, kill local processes
        launcher.join(STOP_WAIT_S)
        stamps["cancelled"] = time.monotonic()
    finally:
        _restore_sigint(previous)


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
