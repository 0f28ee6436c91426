"""The run's policy: a small state machine over attempts (torch elastic's ``WorkerState`` and the loop that
dispatches on it).

=========  ==========================================================  =======================================
state      what it does                                                next
=========  ==========================================================  =======================================
START      launches an attempt: a driver service and ``n`` ranks       WAIT
WAIT       polls while the tasks register                              SUPERVISE, or an ended attempt (below)
SUPERVISE  polls until every rank returned, left at a commit, or       DONE, GROW, RESTART (preempted), or an
           failed                                                      ended attempt
RESTART    the relaunch's ``n``: np, or what Spark gives back          START; FAILED without the slots
GROW       the relaunch's ``n``: Spark's free slots, up to max_np      START; FAILED if Spark fails
SHRINK     the relaunch's ``n``: the ranks the run had before growing  START
DONE       ``run`` returns the last attempt's ``RunStatus``
FAILED     ``run`` raises the error, naming every attempt's failure
=========  ==========================================================  =======================================

An attempt that failed goes to SHRINK where a grown stage did not start, to RESTART where the
failure is the infrastructure's and ``max_restarts`` allows another attempt, or where every rank's
own exception is one of ``retry_on``'s classes and ``max_retries`` allows another (a budget of its
own), and to FAILED otherwise. A preempted attempt (Spark decommissions an executor of its ranks:
they leave at a commit, or fail with the executor) goes to RESTART, counted against
``max_preemptions`` (unlimited by default) rather than ``max_restarts``. An attempt whose only errors are gloo's
mesh that did not connect while the ranks built their process group (no rank died, no executor was lost) goes to
RESTART too, up to ``MESH_RELAUNCHES`` times, whatever ``max_restarts``. WAIT and SUPERVISE read the service's ``RunStatus`` snapshots; ``_supervise.Watch``
applies the rules that say when an attempt has ended. The policy reaches the world through
small interfaces, a ``Cluster`` (launches attempts, knows the task slots) and the ``Service`` and
``Launcher`` each attempt gives it, so fakes stand in for Spark and the processes in tests
(tests/runner/policy/test_run_policy.py).
"""

from __future__ import annotations

import contextlib
import enum
import functools
import time
from dataclasses import dataclass
from typing import Callable, Protocol

from .._backends.api import Launcher
from .._service.status import RunStatus
from .._shared.errors import HorovodRunError, StartTimeoutError
from . import supervise as _supervise
from .result import RestartEvent, resumed
from .stall_inspector import StallInspector
from .supervise import FAILED, LEFT, Ended, Watch

RESTARTS = "restart"  # an infrastructure failure, counted against max_restarts
RETRIES = "retry"  # a user's exception of retry_on's classes, counted against max_retries
PREEMPTIONS = "preemption"  # Spark took back an executor of the run's ranks, counted against max_preemptions
MESH = "mesh"  # gloo did not connect the ranks while they built their process group: relaunched MESH_RELAUNCHES times
MESH_RELAUNCHES = 2  # whatever max_restarts: the ranks had not started training, a relaunch costs only the start-up


class RunState(enum.Enum):
    """Where a run is (torch elastic's WorkerState): what RunPolicy.run does next."""

    START = "start"  # launch an attempt: a driver service and n ranks
    WAIT = "wait"  # the attempt's tasks are registering
    SUPERVISE = "supervise"  # every rank has its place: watch them until they return, fail, or leave to grow
    RESTART = "restart"  # an infrastructure failure: relaunch every rank, from the last commit
    GROW = "grow"  # every rank left at a commit: relaunch with the task slots Spark has free
    SHRINK = "shrink"  # the grown stage did not start: relaunch with the ranks the run had, and grow no more
    DONE = "done"  # every rank returned: RunPolicy.run returns
    FAILED = "failed"  # a failure no restart fixes, or none left: RunPolicy.run raises


class Service(Protocol):
    """What the policy asks of one attempt's driver service (runner/_service/service.py: DriverService). A hosted
    attempt's ``RemoteService`` (runner/_policy/hosted.py) has ``hosted = True`` and ``outcome(wait)``: rank 0's task
    applied the rules, and WAIT hands over to ``RunPolicy._hosted``."""

    np: int

    def status(self, wait: float = 0.0) -> RunStatus:
        """What the ranks have reported, after waiting up to ``wait`` seconds for news."""

    def announce_growth(self) -> None:
        """Tell rank 0, at its next commit, that the run can have more ranks."""

    def abort(self, reason: str) -> None:
        """Tell every rank to stop."""

    def wait_for_exits(self, timeout: float, lost: Callable[[], set] | None = None) -> None:
        """Wait until every started rank's process has exited, or is one of ``lost()``, at most ``timeout``
        seconds."""

    def close(self) -> None:
        """Stop serving."""


class Cluster(Protocol):
    """Where the ranks run: Spark's task slots, or processes on the driver (runner/_horovod_runner.py)."""

    def start(self, n: int, attempt: int, on_restore: Callable | None) -> tuple[Service, Launcher]:
        """A driver service for ``n`` ranks, and ``n`` ranks launched against it (``attempt``: 0, 1, ...).
        ``on_restore(commit_meta)``: called when rank 0 first loads a commit."""

    def free_slots(self) -> int:
        """Task slots no running task holds (0 where the run cannot grow)."""

    def slots_for_restart(self, want: int, least: int | None, timeout: float) -> int:
        """Ranks a restart can have: ``want``, or at once at least ``least``; RuntimeError after ``timeout``."""

    def replace_hosts(self, hosts: frozenset) -> None:
        """Ask the cluster to replace the executors on ``hosts``, whose ranks went silent."""


@dataclass(frozen=True)
class Ending:
    """Why an attempt ended without finishing the run: what RESTART, GROW and SHRINK relaunch after."""

    lost: str | None  # the failure's cause; None: every rank left at a commit for the run to grow
    failed_at: float  # when the driver saw it
    counted: bool = True  # one of max_restarts (SHRINK's relaunch is not)
    cut_off: frozenset = frozenset()  # hosts whose ranks went silent: Spark is asked to replace their executors
    stamps: tuple = ()  # (step, time.monotonic()) of the failed attempt's end: RestartEvent.stamps
    budget: str = RESTARTS  # which budget the relaunch counts against: RESTARTS, RETRIES or PREEMPTIONS


class RunPolicy:
    """Runs attempts until the run is DONE (``run`` returns the last ``RunStatus``) or FAILED (``run`` raises)."""

    def __init__(self, cluster: Cluster, logs, *, np: int, start_timeout: float, run_id: str, max_restarts: int = 0,
                 min_np: int | None = None, max_np: int | None = None, stalls=StallInspector, clock=time.monotonic,
                 retry_on: tuple = (), max_retries: int = 0, max_preemptions: int | None = None,
                 stragglers=None, live=None):
        self.cluster, self.logs, self.run_id = cluster, logs, run_id
        self.np, self.min_np, self.start_timeout = np, min_np, start_timeout
        self.attempts = max_restarts + 1
        self.retry_on = retry_on  # module.qualname of the user's exception classes that max_retries relaunches
        # relaunches each kind of failure may have (None: no limit), and has had
        self.budgets = {RESTARTS: max_restarts, RETRIES: max_retries, PREEMPTIONS: max_preemptions,
                        MESH: MESH_RELAUNCHES}
        self.used = {RESTARTS: 0, RETRIES: 0, PREEMPTIONS: 0, MESH: 0}
        self.stalls = stalls  # (np=, run_id=, log_dir=) -> a stall inspector for one attempt
        self.stragglers = stragglers  # () -> the straggler line's watcher for one attempt (stragglers.py); None: none
        self.live = live  # the run's live view (live.py), drawn from every attempt's polls; None: none
        self.clock = clock
        self.state = RunState.START
        self.history: list[RunState] = [self.state]  # every state entered, in order
        self.n = np  # the ranks of the current attempt
        self.target = max_np or np  # what a run shrunk by a restart, or started below max_np, grows back to
        self.grew_from: int | None = None  # the np before this attempt grew the run
        self.attempt = -1  # the current attempt: 0, then one more per relaunch
        self.errors: list[HorovodRunError] = []  # every failed attempt's error, in order
        self.restarts: list[RestartEvent] = []
        self.ending: Ending | None = None
        self.status: RunStatus | None = None  # the current attempt's latest snapshot
        self.error: HorovodRunError | None = None  # FAILED: what run() raises
        self._error_cause: BaseException | None = None
        self.service: Service | None = None
        self.launcher: Launcher | None = None
        self.watch: Watch | None = None
        self._ended_attempt = -1  # the last attempt whose service is closed: an exception has nothing of it to stop

    def run(self) -> RunStatus:
        """Go from state to state until DONE (return the last attempt's status) or FAILED (raise its error)."""
        handlers = {RunState.START: self._start, RunState.WAIT: self._wait, RunState.SUPERVISE: self._supervise,
                    RunState.RESTART: self._restart, RunState.GROW: self._grow, RunState.SHRINK: self._shrink}
        try:
            while self.state not in (RunState.DONE, RunState.FAILED):
                self.state = handlers[self.state]()
                self.history.append(self.state)
        except BaseException as exc:
            self._abandon(exc)
            raise
        if self.state is RunState.FAILED:
            raise self.error from self._error_cause
        return self.status

    # ---- one attempt ------------------------------------------------------------------------------

    def _start(self) -> RunState:
        self.attempt += 1
        event = self.restarts[-1] if self.restarts else None
        on_restore = None if event is None else functools.partial(resumed, event, self.run_id)
        self.service = self.watch = None  # the previous attempt's, closed
        self.service, self.launcher = self.cluster.start(self.n, self.attempt, on_restore)
        if event is not None:
            event.stamps["launched"] = self.clock()
        can_grow = None if self.n >= self.target else (lambda: self.cluster.free_slots() > 0)
        self.watch = Watch(self.service, self.launcher, self.logs, np=self.n, start_timeout=self.start_timeout,
                           run_id=self.run_id, can_grow=can_grow, clock=self.clock, retry_on=self.retry_on,
                           stalls=self.stalls(np=self.n, run_id=self.run_id, log_dir=self.logs.log_dir),
                           stragglers=None if self.stragglers is None else self.stragglers(),
                           live=None if self.live is None else functools.partial(self.live.check,
                                                                                   attempt=self.attempt))
        self.status = None
        return RunState.WAIT

    def _wait(self) -> RunState:
        """Poll until every task has registered (SUPERVISE, which reads the same snapshot first) or the attempt
        ended: a failure, or ``start_timeout``."""
        if getattr(self.service, "hosted", False):
            return self._hosted()
        with self._polling():
            while True:
                self.status = self.service.status(_supervise.POLL_S)
                if self.status.placed:
                    return RunState.SUPERVISE
                ended = self.watch.registering(self.status)
                if ended is not None:
                    break
        return self._ended(ended)

    def _hosted(self) -> RunState:
        """An attempt whose driver service runs in rank 0's task (runner/_policy/hosted.py): that task applied the
        WAIT and SUPERVISE rules; wait for what it reports in the stage's rows, then end the attempt on it."""
        with self._polling():
            while (outcome := self.service.outcome(_supervise.POLL_S)) is None:
                pass
        self.status, self.watch = outcome.status, outcome.watch
        return self._ended(outcome.ended)

    def _supervise(self) -> RunState:
        """Poll until the attempt ended: every rank returned, left at a commit, or failed."""
        with self._polling():
            while (ended := self.watch.running(self.status)) is None:
                self.status = self.service.status(_supervise.POLL_S)
        return self._ended(ended)

    @contextlib.contextmanager
    def _polling(self):
        """An exception while polling ends the attempt: Ctrl-C stops its ranks first; the service is closed."""
        try:
            yield
        except BaseException as exc:
            self._abandon(exc)
            raise

    def _abandon(self, exc: BaseException) -> None:
        """An exception ends the current attempt, in whichever state it came (Ctrl-C may come while START has
        launched the ranks but not yet watches them): Ctrl-C stops its ranks first; its service is closed. Once
        per attempt, and not at all once the attempt has ended (its ranks stopped, its service closed)."""
        if self.service is None or self._ended_attempt == self.attempt:
            return
        self._ended_attempt = self.attempt
        try:
            if isinstance(exc, KeyboardInterrupt):
                if self.watch is not None:
                    self.watch.interrupted()
                else:
                    _supervise.stop(self.service, self.launcher, _supervise.INTERRUPTED)
        finally:
            self.service.close()

    def _ended(self, ended: Ended) -> RunState:
        """The attempt is over: close its service, and choose the next state."""
        if self.attempt and self.restarts:  # this attempt's start-up steps, on the restart that launched it
            self.restarts[-1].stamps.update(getattr(self.service, "milestones", {}))
        try:
            if ended.how == FAILED:
                return self._failed(ended.error)
            resumed(self.restarts[-1] if self.restarts else None, self.run_id, None,
                    at=self.status.placed_at)  # where no rank asked for a commit
            if ended.how == LEFT and self.watch.preempted is not None:  # every rank left at a commit: relaunch
                return self._preempted(Ending(f"a preemption: {self.watch.preempted}", self.watch.preempted_at,
                                              budget=PREEMPTIONS, stamps=(("failed", self.watch.preempted_at),
                                                                          ("exited", self.clock()),
                                                                          ("cancelled", self.clock()))))
            if ended.how == LEFT:
                self.ending = Ending(lost=None, failed_at=self.clock())
                return RunState.GROW
            return RunState.DONE
        finally:
            self.service.close()
            self._ended_attempt = self.attempt

    def _failed(self, error: HorovodRunError) -> RunState:
        if isinstance(error, StartTimeoutError) and self.grew_from is not None:
            # The slots Spark had free went to another job before the larger stage started: go on with the ranks
            # the run had, from the commit they left at, and grow no more.
            self.ending = Ending(f"the np={self.n} stage did not start within start_timeout: Spark's free task "
                                 "slots were taken", self.clock(), counted=False)
            return RunState.SHRINK
        if isinstance(error, StartTimeoutError) and self.attempt:
            error.retryable, error.cause = True, "the relaunched ranks did not start in time"
        self.errors.append(error)
        preempted = self.watch is not None and self.watch.preempted is not None
        budget = RETRIES if error.retry_on else (PREEMPTIONS if preempted else RESTARTS) if error.retryable else None
        if budget == RESTARTS and getattr(error, "mesh_setup", False) and self.used[MESH] < self.budgets[MESH]:
            budget = MESH
        if budget is None:
            return self._fail(error.__cause__)
        failed_at = getattr(error, "failed_at", self.clock())
        cause = f"a preemption: {self.watch.preempted}, then {error.cause}" if budget == PREEMPTIONS else error.cause
        return self._relaunch_after(Ending(cause, failed_at,
                                           cut_off=frozenset(self.status.hosts_of(getattr(error, "silent_ranks", ()))),
                                           stamps=(("failed", failed_at), *self.watch.stamps.items()), budget=budget),
                                    error.__cause__)

    def _preempted(self, ending: Ending) -> RunState:
        """Every rank left at a commit after a preemption notice: RESTART from it, where max_preemptions allows."""
        if self.used[PREEMPTIONS] == self.budgets[PREEMPTIONS]:
            self.errors.append(HorovodRunError(
                f"HorovodRunner run {self.run_id} failed: {ending.lost}; every rank left at its last commit, and "
                f"max_preemptions={self.budgets[PREEMPTIONS]} relaunches were used up: raise max_preemptions, or "
                "pass max_preemptions=None for no limit.", log_dir=self.logs.log_dir, run_id=self.run_id,
                retryable=True, cause=ending.lost))
        return self._relaunch_after(ending, None)

    def _relaunch_after(self, ending: Ending, cause: BaseException | None) -> RunState:
        """RESTART after ``ending``, where its budget allows another relaunch; FAILED where it is used up."""
        if self.used[ending.budget] == self.budgets[ending.budget]:
            return self._fail(cause, exhausted=ending.budget)
        self.used[ending.budget] += 1
        self.ending = ending
        return RunState.RESTART

    def _fail(self, cause: BaseException | None, exhausted: str | None = None) -> RunState:
        """FAILED, with the error naming every attempt's failure; ``exhausted``: the budget the last one ran out of."""
        why = None
        if exhausted == RESTARTS and self.used[RETRIES] == 0:
            mesh = (f", and {self.used[MESH]} relaunch{'es' if self.used[MESH] > 1 else ''} after gloo did not connect "
                    "the ranks" if self.used[MESH] else "")
            why = (f"every one of its {self.attempts + self.used[MESH]} attempts (max_restarts={self.attempts - 1}"
                   f"{mesh}) ended in a failure")
        elif exhausted == RESTARTS:
            why = f"its max_restarts={self.budgets[RESTARTS]} restarts after infrastructure failures were used up"
        elif exhausted == RETRIES:
            why = (f"its max_retries={self.budgets[RETRIES]} retries of {self.errors[-1].retry_on} were used up "
                   "(retry_on)")
        elif exhausted == PREEMPTIONS:
            why = (f"its max_preemptions={self.budgets[PREEMPTIONS]} relaunches after preemptions were used up; "
                   "raise max_preemptions, or pass max_preemptions=None for no limit")
        self.error, self._error_cause = final_error(self.errors, why), cause
        return RunState.FAILED

    # ---- the next attempt's ranks ------------------------------------------------------------------

    def _restart(self) -> RunState:
        if self.ending.cut_off:
            self.cluster.replace_hosts(self.ending.cut_off)
        self.grew_from = None
        try:
            n = self.cluster.slots_for_restart(self.np, self.min_np, self.start_timeout)
        except RuntimeError as exc:
            return self._no_slots(exc)
        return self._relaunch(n, slots=self.clock())

    def _grow(self) -> RunState:
        self.grew_from = None
        try:
            n = min(self.target, max(self.n, self.cluster.free_slots()))
        except RuntimeError as exc:
            return self._no_slots(exc)
        self.grew_from = self.n
        return self._relaunch(n)

    def _shrink(self) -> RunState:
        self.target, self.grew_from = self.grew_from, None
        return self._relaunch(self.target)

    def _no_slots(self, exc: RuntimeError) -> RunState:
        self.errors.append(HorovodRunError(f"HorovodRunner run {self.run_id} failed: {exc}.",
                                           log_dir=self.logs.log_dir, run_id=self.run_id))
        return self._fail(None)

    def _relaunch(self, n: int, **stamps: float) -> RunState:
        ending = self.ending
        most = self.budgets[ending.budget]
        event = RestartEvent(attempt=self.used[ending.budget] + 1, attempts=None if most is None else most + 1,
                             lost=ending.lost, np_before=self.n, np_after=n, failed_at=ending.failed_at,
                             counted=ending.counted, stamps={**dict(ending.stamps), **stamps}, kind=ending.budget)
        self.restarts.append(event)
        self.logs.note(f"----- sparkhvd: {event.what()} -----")
        self.n = n
        return RunState.START


def final_error(errors: list[HorovodRunError], exhausted: str | None) -> HorovodRunError:
    """The error that ends a run: the last attempt's, naming every earlier failure in order where it restarted;
    ``exhausted``: why the last failure was not relaunched where a budget ran out, None where no relaunch fixes it."""
    last = errors[-1]
    if len(errors) == 1:
        return last
    why = exhausted or (f"after {len(errors) - 1} restart{'s' if len(errors) > 2 else ''}, a failure that no restart "
                        "can fix")
    head, _, rest = str(last).partition("\n")
    lines = [f"HorovodRunner run {last.run_id} failed: {why}; in order:"]
    lines += [f"  {i}. {e.cause}" for i, e in enumerate(errors, 1)]
    lines.append(f"\nThe last failure in full: {head.split(' failed: ', 1)[-1]}" + (f"\n{rest}" if rest else ""))
    error = type(last)("\n".join(lines), failures=last.failures, log_dir=last.log_dir, run_id=last.run_id,
                       retryable=last.retryable, cause=last.cause)
    error.attempts = list(errors)
    error.retry_on = last.retry_on
    return error
