"""The run's policy (runner/_policy/policy.py, runner/_policy/supervise.py): every transition of its state machine, driven by a
fake cluster, fake driver services and fake launchers on a fake clock: no process, no Spark, no sleep.

The real-process tests (test_ranks_on_the_driver.py, test_elastic_restart.py, test_faults.py, test_ranks_in_a_spark_barrier_stage.py,
test_stall_reports.py, test_host_identity.py) prove the same policy with real ranks.
"""

from __future__ import annotations

import contextlib
import threading
from types import MappingProxyType

import pytest

from sparkhvd._common.client import ServiceClient
from sparkhvd._common.driver_messages import Exit, Register
from sparkhvd._common.topology import assign_ranks
from sparkhvd.runner._backends.api import Launcher
from sparkhvd.runner._policy import supervise as _supervise
from sparkhvd.runner._policy.policy import RunPolicy, RunState
from sparkhvd.runner._service.logs import LogRouter
from sparkhvd.runner._service.service import DriverService, Failure, Registration
from sparkhvd.runner._service.status import RunStatus
from sparkhvd.runner._shared.errors import HorovodRunError, StartTimeoutError

pytestmark = pytest.mark.unit

S = RunState
RUN = "r1"
MAX_POLLS = 20_000  # 1,000 s of fake time at 50 ms a poll


class Clock:
    """The fake time: each poll of a fake service moves it on by the poll's wait."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class FakeService:
    """A driver service whose ranks do what the test scripted: ``(seconds after the attempt started, action)``.

    Each ``status(wait)`` moves the clock on by ``wait``, applies the actions due, and answers a ``RunStatus``.
    """

    def __init__(self, np: int, clock: Clock, script, hosts=None):
        self.np, self.clock = np, clock
        self.hosts = hosts or ["h"] * np  # task -> host
        start = clock.now
        self.script = sorted(((start + at, action) for at, action in script), key=lambda e: e[0])
        self.registrations, self.placements, self.placed_at = {}, None, None
        self.results, self.failures, self.exits, self.progress = {}, [], {}, {}
        self.hosts_updated = None
        self.agents_gone: set = set()  # tasks whose agent's connection closed
        self.aborted, self.closed, self.waited_for_exits = None, 0, []
        self.on_growth = None  # the script's reaction when the driver announces growth
        self.on_preemption = None  # and a preemption
        self.preemptions = 0
        self.interrupt_at = None
        self.polls = 0

    def status(self, wait: float = 0.0) -> RunStatus:
        self.polls += 1
        assert self.polls < MAX_POLLS, "the fake attempt never ended: a rule of the policy did not fire"
        self.clock.now += wait
        if self.interrupt_at is not None and self.clock.now >= self.interrupt_at:
            raise KeyboardInterrupt
        while self.script and self.script[0][0] <= self.clock.now:
            self.script.pop(0)[1](self)
        return RunStatus(np=self.np, at=self.clock.now, registrations=MappingProxyType(dict(self.registrations)),
                         placements=self.placements, placed_at=self.placed_at,
                         results=MappingProxyType(dict(self.results)), failures=tuple(self.failures),
                         exits=MappingProxyType(dict(self.exits)), progress=MappingProxyType(dict(self.progress)),
                         hosts_updated=self.hosts_updated, agents_gone=frozenset(self.agents_gone))

    def announce_growth(self) -> None:
        self.hosts_updated = (0.0, 2)
        if self.on_growth is not None:
            self.script += [(self.clock.now + at, action) for at, action in self.on_growth]
            self.script.sort(key=lambda e: e[0])

    def announce_preemption(self) -> None:
        self.hosts_updated, self.preemptions = (0.0, 1), self.preemptions + 1
        if self.on_preemption is not None:
            self.script += [(self.clock.now + at, action) for at, action in self.on_preemption]
            self.script.sort(key=lambda e: e[0])

    def abort(self, reason: str) -> None:
        self.aborted = reason

    def wait_for_exits(self, timeout: float, lost=None) -> None:
        self.waited_for_exits.append(timeout)

    def close(self) -> None:
        self.closed += 1


class FakeLauncher(Launcher):
    """A launcher whose launch fails at ``failure_at`` (with ``failure``), whose Spark lost an executor at
    ``lost_at`` (``lost``), and began to decommission one at ``preempted_at`` (``preempted``)."""

    def start(self, spec) -> None:
        pass  # FakeCluster.start hands the policy a launched attempt

    def __init__(self, n: int, clock: Clock, *, failure=None, failure_at=0.0, lost=None, lost_at=0.0, fatal=False,
                 joins=True, preempted=None, preempted_at=0.0):
        self.description = f"{n} fake tasks"
        self.clock, self.start = clock, clock.now
        self.fatal, self.joins = fatal, joins
        self._failure, self._failure_at, self._lost, self._lost_at = failure, failure_at, lost, lost_at
        self.stopped, self.joined, self.asked_lost, self.asked_preempted = 0, [], [], []
        self._preempted, self._preempted_at = preempted, preempted_at

    def failure(self):
        return self._failure if self._failure and self.clock.now - self.start >= self._failure_at else None

    def lost(self, unfinished: list):
        self.asked_lost.append(unfinished)
        return self._lost if self._lost and self.clock.now - self.start >= self._lost_at else None

    def preempted(self, unfinished: list):
        self.asked_preempted.append(self.clock.now - self.start)
        return self._preempted if self._preempted and self.clock.now - self.start >= self._preempted_at else None

    def join(self, timeout: float) -> bool:
        self.joined.append(timeout)
        return self.joins

    def stop(self) -> None:
        self.stopped += 1


class FakeStalls:
    """The stall inspector: returns ``error`` from the check ``at`` seconds after the attempt started."""

    def __init__(self, clock: Clock, error=None, at=0.0, reason="the run stalled"):
        self.clock, self.start, self.error, self.at, self.abort_reason = clock, clock.now, error, at, reason
        self.overs = 0

    def check(self, service):
        if self.error is not None and self.clock.now - self.start >= self.at:
            error, self.error = self.error, None
            return error
        return None

    def over(self) -> None:
        self.overs += 1


class FakeCluster:
    """Launches each attempt from ``attempts[i]``: a dict with the service's ``script``, and optionally ``hosts``,
    ``launcher`` (FakeLauncher keywords), ``stall`` (FakeStalls keywords) and ``on_growth`` (a script)."""

    def __init__(self, clock: Clock, attempts: list, *, free=0, restart_slots=None):
        self.clock, self.attempts, self.free, self.restart_slots = clock, attempts, free, restart_slots
        self.services, self.launchers, self.stalls = [], [], []
        self.started, self.restart_asks, self.replaced, self.free_asked = [], [], [], 0

    def start(self, n: int, attempt: int, on_restore):
        spec = self.attempts[attempt]
        self.started.append(n)
        service = FakeService(n, self.clock, spec["script"](n), hosts=spec.get("hosts"))
        service.on_growth, service.on_preemption = spec.get("on_growth"), spec.get("on_preemption")
        launcher = FakeLauncher(n, self.clock, **spec.get("launcher", {}))
        self.services.append(service)
        self.launchers.append(launcher)
        return service, launcher

    def stall_inspector(self, **kw):
        spec = self.attempts[len(self.stalls)].get("stall", {})
        self.stalls.append(FakeStalls(self.clock, **spec))
        return self.stalls[-1]

    def free_slots(self) -> int:
        """``free``: a number, or a list of the answers in turn (the last one repeats); an exception is raised."""
        self.free_asked += 1
        free = self.free[min(self.free_asked, len(self.free)) - 1] if isinstance(self.free, list) else self.free
        if isinstance(free, Exception):
            raise free
        return free

    def slots_for_restart(self, want: int, least, timeout: float) -> int:
        self.restart_asks.append((want, least, timeout))
        if isinstance(self.restart_slots, Exception):
            raise self.restart_slots
        return want if self.restart_slots is None else self.restart_slots

    def replace_hosts(self, hosts) -> None:
        self.replaced.append(set(hosts))


# ---- what the scripted ranks do ------------------------------------------------------------------------

def register(tasks=None):
    def action(s: FakeService):
        for t in range(s.np) if tasks is None else tasks:
            s.registrations[t] = Registration(task=t, host=s.hosts[t].split("@")[0], pid=100 + t, gpus=[],
                                              peer=s.hosts[t].split("@")[-1], host_id=s.hosts[t])
        if len(s.registrations) == s.np:
            s.placements, s.placed_at = tuple(assign_ranks([s.hosts[t] for t in range(s.np)])), s.clock.now
    return action


def returned(ranks=None):
    def action(s: FakeService):
        for r in range(s.np) if ranks is None else ranks:
            s.results[r], s.exits[r] = b"value", 0
    return action


def fails(rank: int, kind: str = "ValueError", message: str = "no rows"):
    def action(s: FakeService):
        s.failures.append(Failure(rank=rank, type=kind, message=message, traceback=f"Traceback: {kind}\n",
                                  arrived=s.clock.now))
    return action


def exits(rank: int, code: int):
    def action(s: FakeService):
        s.exits[rank] = code
    return action


def leaves(ranks=None):
    """Ranks leave at a commit for the run to grow (they raise RanksChanged and exit)."""
    def action(s: FakeService):
        for r in range(s.np) if ranks is None else ranks:
            fails(r, "RanksChanged", "the ranks changed")(s)
            s.exits[r] = 0
    return action


def ok(at: float = 0.5):
    """An attempt whose ranks register at once and all return at ``at``."""
    return {"script": lambda n: [(0.1, register()), (at, returned())]}


def killed(rank: int = 1, at: float = 0.5):
    """An attempt whose rank ``rank`` is killed (SIGKILL) at ``at``; the others stop as a consequence."""
    return {"script": lambda n: [(0.1, register()), (at, exits(rank, -9)),
                                 *[(at + 0.1, fails(r, "MeshError", f"rank {rank} closed its control link"))
                                   for r in range(n) if r != rank]]}


def never_registers():
    return {"script": lambda n: [(0.1, register(range(n - 1)))]}


@pytest.fixture
def run(tmp_path):
    """``run(attempts, cluster keywords..., policy keywords...)`` -> (policy, cluster, status or error)."""
    def go(attempts, *, free=0, restart_slots=None, np=2, start_timeout=10.0, **kw):
        clock = Clock()
        cluster = FakeCluster(clock, attempts, free=free, restart_slots=restart_slots)
        logs = LogRouter(str(tmp_path), "all")
        policy = RunPolicy(cluster, logs, np=np, start_timeout=start_timeout, run_id=RUN,
                           stalls=cluster.stall_inspector, clock=clock, **kw)
        try:
            outcome = policy.run()
        except HorovodRunError as error:
            outcome = error
        finally:
            logs.close()
        assert all(s.closed == 1 for s in cluster.services)  # every attempt's service, closed once
        return policy, cluster, outcome
    return go


# ---- START -> WAIT -> SUPERVISE -> DONE ----------------------------------------------------------------

def test_every_rank_returns_then_done(run):
    policy, cluster, status = run([ok(at=0.5)])
    assert policy.history == [S.START, S.WAIT, S.SUPERVISE, S.DONE]
    assert sorted(status.results) == [0, 1] and status.finished()
    service, launcher = cluster.services[0], cluster.launchers[0]
    assert service.aborted is None and launcher.stopped == 0 and launcher.joined == [_supervise.STOP_WAIT_S]
    assert cluster.stalls[0].overs == 1 and policy.restarts == [] and policy.errors == []


def test_ranks_that_return_but_never_exit_are_stopped_after_the_exit_wait(run):
    attempt = {"script": lambda n: [(0.1, register()), (0.5, returned([0])), (0.5, lambda s: s.results.update({1: b""}))]}
    with pytest.warns(RuntimeWarning, match=r"^sparkhvd run r1: every rank returned but ranks 1 did not exit within "
                                            r"35 s; they were stopped\.$"):
        policy, cluster, status = run([attempt])
    assert policy.history[-1] is S.DONE and cluster.services[0].aborted == "the run has finished"
    assert cluster.launchers[0].stopped == 1


def test_registering_for_long_is_said_once_on_the_driver(run, capsys):
    policy, cluster, error = run([never_registers()], start_timeout=12.0)
    lines = [line for line in capsys.readouterr().out.splitlines() if "ranks registered after" in line]
    assert lines == ["[sparkhvd] 1 of 2 ranks registered after 5 s; waiting for task 1 on 2 fake tasks; will wait up "
                     "to 12 s (start_timeout)"]


# ---- WAIT -> FAILED --------------------------------------------------------------------------------------

def test_a_task_that_never_registers_fails_the_run_at_start_timeout(run):
    policy, cluster, error = run([never_registers()], max_restarts=3)  # the first start is never retried
    assert policy.history == [S.START, S.WAIT, S.FAILED]
    assert isinstance(error, StartTimeoutError) and not error.retryable
    assert str(error) == ("1 of 2 ranks (task 1) did not register with the driver on 2 fake tasks within 10 s; raise "
                          "start_timeout, or look in the executor logs for why task 1 did not start.")
    assert cluster.services[0].aborted == "the run did not start in time" and cluster.launchers[0].stopped == 1
    assert cluster.clock.now - 1000.0 == pytest.approx(10.0, abs=_supervise.POLL_S)


def test_a_failed_launch_fails_the_run_at_once(run):
    attempt = {"script": lambda n: [], "launcher": {"failure": "the Spark job failed: no executors", "failure_at": 0.2}}
    policy, cluster, error = run([attempt])
    assert policy.history == [S.START, S.WAIT, S.FAILED]
    assert str(error).startswith("HorovodRunner run r1 failed: 2 fake tasks: the Spark job failed: no executors\n")
    assert cluster.services[0].aborted == "another rank failed"


# ---- SUPERVISE -> FAILED ------------------------------------------------------------------------------

def test_a_users_exception_fails_the_run_after_the_grace_period_and_is_never_retried(run):
    attempt = {"script": lambda n: [(0.1, register()), (0.5, fails(1))]}
    policy, cluster, error = run([attempt], max_restarts=3)
    assert policy.history == [S.START, S.WAIT, S.SUPERVISE, S.FAILED]
    assert str(error).startswith("HorovodRunner run r1 failed: rank 1: ValueError: no rows\n")
    assert not error.retryable and error.failed_at == pytest.approx(1000.5, abs=0.06)
    assert cluster.clock.now - error.failed_at >= _supervise.FAILURE_GRACE_S  # rank 0 had its grace period
    assert cluster.services[0].aborted == "another rank failed" and cluster.launchers[0].stopped == 1


def test_every_rank_having_reported_ends_the_grace_period_early(run):
    attempt = {"script": lambda n: [(0.1, register()), (0.5, fails(1)), (0.6, fails(0, "MeshError", "rank 1 left"))]}
    policy, cluster, error = run([attempt])
    lines = str(error).splitlines()
    assert lines[:2] == ["HorovodRunner run r1 failed: rank 1: ValueError: no rows",
                         "then, as a consequence, rank 0: MeshError: rank 1 left"]
    assert cluster.clock.now < error.failed_at + _supervise.FAILURE_GRACE_S


def test_collateral_errors_alone_wait_for_the_cause_and_name_the_silent_ranks(run):
    attempt = {"script": lambda n: [(0.1, register()), (0.5, fails(0, "MeshError", "rank 1 closed its link"))]}
    policy, cluster, error = run([attempt])
    assert cluster.clock.now - error.failed_at >= _supervise.UNEXPLAINED_GRACE_S
    assert str(error).startswith("HorovodRunner run r1 failed: rank 1 stopped without a word: no error, no exit code "
                                 "and no result reached the driver")
    assert error.retryable and error.silent_ranks == [1]


def test_spark_losing_an_executor_explains_the_collateral_errors(run):
    lost = "rank 1 ran on executor 3 on host b (10.0.0.2), which Spark lost: Command exited with code 137"
    attempt = {"script": lambda n: [(0.1, register()), (0.5, fails(0, "MeshError", "rank 1 closed its link"))],
               "launcher": {"lost": lost, "lost_at": 2.0}}
    policy, cluster, error = run([attempt])
    assert str(error).startswith(f"HorovodRunner run r1 failed: {lost}\nthen, as a consequence, rank 0: MeshError")
    asked = cluster.launchers[0].asked_lost[0]
    assert [(rank, reg.task) for rank, reg in asked] == [(0, 0), (1, 1)]  # every rank without a value, the failed too
    assert cluster.clock.now - error.failed_at < _supervise.UNEXPLAINED_GRACE_S


def test_a_rank_whose_agent_vanished_explains_the_collateral_errors_after_the_short_grace(run):
    """A lost node on standalone: its agent's connection closed, and Spark says nothing of its executor until
    spark.standalone.executorRemoveDelayOnDisconnection (5 s) later. The short grace, not the 10 s one; Spark's
    word is taken where it comes within it."""
    def agent_gone(s: FakeService):
        s.agents_gone.add(1)

    attempt = {"script": lambda n: [(0.1, register()), (0.5, agent_gone), (0.5, fails(0, "MeshError", "rank 1 closed its link"))]}
    policy, cluster, error = run([attempt])
    assert _supervise.FAILURE_GRACE_S <= cluster.clock.now - error.failed_at < _supervise.UNEXPLAINED_GRACE_S / 2
    assert str(error).startswith("HorovodRunner run r1 failed: rank 1 stopped without a word: no error, no exit code "
                                 "and no result reached the driver")
    assert error.retryable and error.silent_ranks == [1]

    lost = "rank 1 ran on executor 3 on host b (10.0.0.2), which Spark lost: Command exited with code 137"
    attempt = {**attempt, "launcher": {"lost": lost, "lost_at": 0.9}}
    policy, cluster, error = run([attempt])
    assert str(error).startswith(f"HorovodRunner run r1 failed: {lost}\nthen, as a consequence, rank 0: MeshError")


def test_a_stall_past_its_shutdown_time_fails_the_run(run):
    stall = HorovodRunError("HorovodRunner run r1 failed after a stall of 60 s", run_id=RUN, retryable=True,
                            cause="the run stalled for 60 s")
    attempt = {**ok(at=1e9), "stall": {"error": stall, "at": 60.0, "reason": "the run stalled for 60 s"}}
    policy, cluster, error = run([attempt])
    assert error is stall and policy.history == [S.START, S.WAIT, S.SUPERVISE, S.FAILED]
    assert cluster.services[0].aborted == "the run stalled for 60 s"
    assert error.failed_at == pytest.approx(1060.0, abs=0.06)


def test_a_stopped_spark_context_is_never_retried(run):
    attempt = {**killed(), "launcher": {"fatal": True}}
    policy, cluster, error = run([attempt], max_restarts=3)
    assert policy.history[-1] is S.FAILED and not error.retryable and len(cluster.services) == 1


@pytest.mark.parametrize("at, state", [(0.05, S.WAIT), (3.0, S.SUPERVISE)])
def test_ctrl_c_stops_every_rank_and_goes_on(tmp_path, at, state):
    clock = Clock()
    cluster = FakeCluster(clock, [ok(at=1e9)])
    policy = RunPolicy(cluster, LogRouter(str(tmp_path), "all"), np=2, start_timeout=10.0, run_id=RUN,
                       stalls=cluster.stall_inspector, clock=clock)
    original = cluster.start

    def start(n, attempt, on_restore):
        service, launcher = original(n, attempt, on_restore)
        service.interrupt_at = clock.now + at
        return service, launcher

    cluster.start = start
    with pytest.raises(KeyboardInterrupt):
        policy.run()
    service = cluster.services[0]
    assert service.aborted == "the run was interrupted on the driver (KeyboardInterrupt)" and service.closed == 1
    assert cluster.launchers[0].stopped == 1 and policy.state is state


@pytest.mark.unit
def test_ctrl_c_after_the_launch_but_before_the_watch_still_stops_every_rank_and_closes_the_service(tmp_path):
    """START has launched the ranks; Ctrl-C lands before the attempt is watched (on a loaded driver, the ranks may
    be running by then): the ranks are stopped and the service closed, as a Ctrl-C while polling would."""
    clock = Clock()
    cluster = FakeCluster(clock, [ok(at=1e9)])

    def stalls(**kwargs):
        raise KeyboardInterrupt  # Watch() builds the attempt's stall inspector: the last step before WAIT

    policy = RunPolicy(cluster, LogRouter(str(tmp_path), "all"), np=2, start_timeout=10.0, run_id=RUN,
                       stalls=stalls, clock=clock)
    with pytest.raises(KeyboardInterrupt):
        policy.run()
    service = cluster.services[0]
    assert service.aborted == "the run was interrupted on the driver (KeyboardInterrupt)" and service.closed == 1
    assert cluster.launchers[0].stopped == 1 and policy.state is S.START


def test_ctrl_c_after_an_attempt_ended_leaves_it_as_its_failure_stopped_it(tmp_path):
    """A rank was killed: its failure stopped the attempt's ranks and closed its service. Ctrl-C while RESTART waits
    for Spark's task slots ends the run without stopping or closing that attempt a second time."""
    clock = Clock()
    cluster = FakeCluster(clock, [killed(), ok()])

    def slots_for_restart(want, least, timeout):
        raise KeyboardInterrupt

    cluster.slots_for_restart = slots_for_restart
    policy = RunPolicy(cluster, LogRouter(str(tmp_path), "all"), np=2, start_timeout=10.0, run_id=RUN,
                       stalls=cluster.stall_inspector, clock=clock, max_restarts=1)
    with pytest.raises(KeyboardInterrupt):
        policy.run()
    service, launcher = cluster.services[0], cluster.launchers[0]
    assert policy.state is S.RESTART and len(cluster.services) == 1
    assert service.aborted == "another rank failed" and service.waited_for_exits == [_supervise.ABORT_GRACE_S]
    assert service.closed == 1 and launcher.stopped == 1


# ---- SUPERVISE -> RESTART -> START ------------------------------------------------------------------------

def test_a_killed_rank_restarts_every_rank(run, capsys):
    policy, cluster, status = run([killed(rank=1), ok()], max_restarts=1)
    assert policy.history == [S.START, S.WAIT, S.SUPERVISE, S.RESTART, S.START, S.WAIT, S.SUPERVISE, S.DONE]
    [event] = policy.restarts
    assert (event.attempt, event.attempts, event.np_before, event.np_after, event.counted) == (2, 2, 2, 2, True)
    assert event.lost == "rank 1's process was killed by signal 9 before returning a result; it printed nothing"
    assert event.what() == f"restart 1 of 1 after {event.lost}"
    assert event.seconds is not None  # said once the restarted ranks started
    assert f"[sparkhvd] run r1: {event.what()}; training resumed" in capsys.readouterr().out
    assert cluster.restart_asks == [(2, None, 10.0)] and cluster.replaced == []


def test_when_restarts_run_out_the_error_names_every_failure_in_order(run):
    policy, cluster, error = run([killed(rank=1), killed(rank=0)], max_restarts=1)
    assert policy.history[-1] is S.FAILED and len(policy.errors) == 2
    assert str(error).splitlines()[:3] == [
        "HorovodRunner run r1 failed: every one of its 2 attempts (max_restarts=1) ended in a failure; in order:",
        "  1. rank 1's process was killed by signal 9 before returning a result; it printed nothing",
        "  2. rank 0's process was killed by signal 9 before returning a result; it printed nothing"]
    assert error.attempts == policy.errors


def test_a_users_exception_after_a_restart_names_the_earlier_failure_too(run):
    user = {"script": lambda n: [(0.1, register()), (0.5, fails(0))]}
    policy, cluster, error = run([killed(), user], max_restarts=3)
    assert str(error).splitlines()[0] == ("HorovodRunner run r1 failed: after 1 restart, a failure that no restart "
                                          "can fix; in order:")


def test_relaunched_ranks_that_do_not_start_are_retried(run):
    policy, cluster, status = run([killed(), never_registers(), ok()], max_restarts=2)
    assert policy.history.count(S.RESTART) == 2 and policy.history[-1] is S.DONE
    assert policy.restarts[1].lost == "the relaunched ranks did not start in time"


def test_a_restart_goes_on_with_the_slots_spark_gives_back(run):
    policy, cluster, status = run([killed(), ok()], max_restarts=1, min_np=1, restart_slots=1)
    assert cluster.started == [2, 1] and cluster.restart_asks == [(2, 1, 10.0)]
    assert policy.restarts[0].np_after == 1 and status.np == 1


def test_a_restart_without_the_slots_fails_the_run(run):
    no_slots = RuntimeError("after the failure Spark had 0 task slots free for the restart within start_timeout=10 s, "
                            "not the 2 it needs; pass min_np=<n> (n <= 1) to go on with fewer ranks, raise "
                            "start_timeout, or add executors")
    policy, cluster, error = run([killed()], max_restarts=1, restart_slots=no_slots)
    assert policy.history == [S.START, S.WAIT, S.SUPERVISE, S.RESTART, S.FAILED]
    assert str(error).splitlines()[-1] == f"The last failure in full: {no_slots}."
    assert error.__cause__ is None


def test_ranks_that_went_silent_have_their_executors_replaced(run):
    lost = HorovodRunError("HorovodRunner run r1 failed: rank 1 on host b has not been heard from", run_id=RUN,
                           retryable=True, cause="rank 1 on host b has not been heard from")
    lost.silent_ranks = [1]
    attempt = {**ok(at=1e9), "hosts": ["a@10.0.0.1", "b@10.0.0.2"], "stall": {"error": lost, "at": 30.0}}
    policy, cluster, status = run([attempt, ok()], max_restarts=1)
    assert cluster.replaced == [{"b", "10.0.0.2"}] and policy.history[-1] is S.DONE


# ---- SUPERVISE -> GROW -> START, and a grown stage that cannot start -> SHRINK -> START --------------------------

def growing(at_commit: float = 0.3):
    """An attempt that grows: the driver announces growth, every rank leaves at its next commit."""
    return {**ok(at=1e9), "on_growth": [(at_commit, leaves())]}


def test_a_run_grows_when_spark_has_free_slots(run):
    policy, cluster, status = run([growing(), ok()], np=2, max_np=4, free=4)
    assert policy.history == [S.START, S.WAIT, S.SUPERVISE, S.GROW, S.START, S.WAIT, S.SUPERVISE, S.DONE]
    assert cluster.started == [2, 4] and status.np == 4
    [event] = policy.restarts
    assert event.what() == "growing from np=2 to np=4 at a commit, as Spark has task slots for more ranks"
    assert event.lost is None and policy.errors == []
    assert cluster.launchers[0].joined == [_supervise.STOP_WAIT_S] and cluster.launchers[0].stopped == 0


def test_growth_is_announced_once_and_asked_no_more_often_than_grow_check_s(run):
    policy, cluster, status = run([{**ok(at=5.0)}], np=2, max_np=4, free=0)
    assert cluster.free_asked == 3  # at 0.1 s, 2.1 s and 4.1 s: every GROW_CHECK_S
    assert cluster.services[0].hosts_updated is None


def test_a_stage_whose_tasks_outlive_their_ranks_is_cancelled_before_growing(run):
    policy, cluster, status = run([{**growing(), "launcher": {"joins": False}}, ok()], np=2, max_np=4, free=4)
    assert cluster.launchers[0].stopped == 1 and policy.history[-1] is S.DONE


def test_a_grown_stage_that_cannot_start_goes_back_to_the_ranks_it_had(run):
    policy, cluster, status = run([growing(), never_registers(), ok()], np=2, max_np=4, free=4, max_restarts=0)
    assert policy.history == [S.START, S.WAIT, S.SUPERVISE, S.GROW, S.START, S.WAIT, S.SHRINK, S.START, S.WAIT,
                              S.SUPERVISE, S.DONE]
    assert cluster.started == [2, 4, 2] and policy.errors == [] and policy.target == 2
    back = policy.restarts[1]
    assert not back.counted and (back.np_before, back.np_after) == (4, 2)
    assert back.what() == ("going back from np=4 to np=2 after the np=4 stage did not start within start_timeout: "
                           "Spark's free task slots were taken")
    assert cluster.free_asked == 2  # the check and the growth; grown back to the target, no more


def test_all_free_slots_taken_meanwhile_relaunches_with_the_same_ranks(run):
    policy, cluster, status = run([growing(), ok()], np=2, max_np=4, free=[4, 0])  # free, then taken at the commit
    event = policy.restarts[0]
    assert cluster.started == [2, 2] and event.np_after == 2
    assert event.what() == ("relaunching with np=2 at a commit: the task slots Spark had free for more ranks were "
                            "taken meanwhile")


def test_spark_failing_to_count_its_slots_while_growing_fails_the_run(run):
    gone = RuntimeError("the SparkContext is stopped")
    policy, cluster, error = run([growing()], np=2, max_np=4, free=[4, gone], max_restarts=3)
    assert policy.history == [S.START, S.WAIT, S.SUPERVISE, S.GROW, S.FAILED]
    assert str(error) == "HorovodRunner run r1 failed: the SparkContext is stopped." and not error.retryable


def test_a_rank_lost_while_the_others_leave_for_growth_is_a_failure(run):
    lost = "rank 1 ran on executor 3 on host b (10.0.0.2), which Spark lost: heartbeat timed out"
    attempt = {**ok(at=1e9), "on_growth": [(0.3, leaves([0]))], "launcher": {"lost": lost, "lost_at": 1.0}}
    policy, cluster, status = run([attempt, ok()], np=2, max_np=4, free=4, max_restarts=1)
    assert policy.history[:4] == [S.START, S.WAIT, S.SUPERVISE, S.RESTART]
    assert policy.restarts[0].lost == lost


def test_ranks_that_left_wait_at_most_resize_wait_s_for_the_others(run, monkeypatch):
    monkeypatch.setattr(_supervise, "RESIZE_WAIT_S", 3.0)
    attempt = {**ok(at=1e9), "on_growth": [(0.3, leaves([0]))]}
    policy, cluster, error = run([attempt], np=2, max_np=4, free=4)
    assert policy.history[-1] is S.FAILED
    assert str(error).startswith("HorovodRunner run r1 failed: rank 1 stopped without a word")


# ---- SUPERVISE -> RESTART after a preemption, counted against max_preemptions ---------------------------------

NOTICE = "executor 2 on host b (10.0.0.2), which runs rank 1, is being decommissioned by Spark"


def preempted(at: float = 1.0, then=None):
    """An attempt whose executor Spark decommissions at ``at``; every rank leaves at a commit 0.3 s after the
    driver announces it (``then``: what the ranks do instead)."""
    return {**ok(at=1e9), "launcher": {"preempted": NOTICE, "preempted_at": at},
            "on_preemption": then if then is not None else [(0.3, leaves())]}


def test_a_preempted_run_leaves_at_a_commit_and_relaunches_without_using_max_restarts(run, capsys):
    policy, cluster, status = run([preempted(at=1.0), ok()], np=2, max_restarts=0)
    assert policy.history == [S.START, S.WAIT, S.SUPERVISE, S.RESTART, S.START, S.WAIT, S.SUPERVISE, S.DONE]
    [event] = policy.restarts
    assert event.kind == "preemption" and event.attempts is None and (event.np_before, event.np_after) == (2, 2)
    assert event.what() == f"preempted: relaunch 1 (max_preemptions) after a preemption: {NOTICE}"
    assert event.failed_at == pytest.approx(1001.0, abs=_supervise.PREEMPT_CHECK_S)  # the notice, not the leaving
    assert policy.used == {"restart": 0, "retry": 0, "preemption": 1, "mesh": 0} and policy.errors == []
    assert cluster.restart_asks == [(2, None, 10.0)]  # the slots Spark keeps, as after a failure
    first = cluster.launchers[0]
    assert cluster.services[0].preemptions == 1 and cluster.services[0].aborted is None and first.stopped == 0
    # asked every PREEMPT_CHECK_S until the notice, never after it
    assert len(first.asked_preempted) == 1 + int(1.0 / _supervise.PREEMPT_CHECK_S)
    out = capsys.readouterr().out
    assert f"[sparkhvd] run r1: preempted: {NOTICE}; every rank leaves at one of its next two hvd.elastic commits" in out


def test_max_preemptions_bounds_the_relaunches_and_the_error_says_so(run):
    policy, cluster, error = run([preempted(), preempted(), ok()], np=2, max_restarts=5, max_preemptions=1)
    assert policy.history[-1] is S.FAILED and cluster.started == [2, 2]
    assert str(error) == (f"HorovodRunner run r1 failed: a preemption: {NOTICE}; every rank left at its last commit, "
                          "and max_preemptions=1 relaunches were used up: raise max_preemptions, or pass "
                          "max_preemptions=None for no limit.")
    assert error.retryable and policy.used == {"restart": 0, "retry": 0, "preemption": 1, "mesh": 0}
    assert policy.restarts[0].what() == f"preempted: relaunch 1 of 1 (max_preemptions) after a preemption: {NOTICE}"

    policy, cluster, error = run([preempted()], np=2, max_preemptions=0)
    assert str(error).startswith(f"HorovodRunner run r1 failed: a preemption: {NOTICE}; every rank left at its last "
                                 "commit, and max_preemptions=0 relaunches were used up")


def test_a_preempted_executor_lost_before_the_commit_counts_as_a_preemption(run):
    # the decommission ended (the executor's JVM exited) before the ranks reached a commit
    attempt = preempted(at=1.0, then=[(0.2, exits(1, -9)), (0.3, fails(0, "MeshError", "rank 1 closed its link"))])
    policy, cluster, status = run([attempt, ok()], np=2, max_restarts=0)
    assert policy.history[-1] is S.DONE
    [event] = policy.restarts
    assert event.kind == "preemption" and event.lost.startswith(f"a preemption: {NOTICE}, then rank 1's process")
    assert policy.used["restart"] == 0


def test_without_a_notice_a_lost_executor_is_a_restart(run):
    policy, cluster, status = run([killed(), ok()], np=2, max_restarts=1)
    assert policy.restarts[0].kind == "restart" and policy.used == {"restart": 1, "retry": 0, "preemption": 0, "mesh": 0}


# ---- the snapshot ---------------------------------------------------------------------------------------

def test_the_driver_services_status_is_a_frozen_copy():
    service = DriverService(np=2, secret=b"k" * 32, payload=b"")
    try:
        service.registrations[0] = Registration(task=0, host="h", pid=1, gpus=[], peer="127.0.0.1")
        status = service.status()
        service.registrations[1] = Registration(task=1, host="h", pid=2, gpus=[], peer="127.0.0.1")
        assert status.registered == {0} and not status.placed and service.status().registered == {0, 1}
        with pytest.raises(TypeError):
            status.registrations[1] = None
        with pytest.raises(AttributeError):
            status.np = 3
    finally:
        service.close()


def test_dead_unfinished_and_silent_ranks_are_read_from_the_snapshot():
    hosts = ["a", "a", "b"]
    regs = {t: Registration(task=t, host=h, pid=t, gpus=[], peer=f"10.0.0.{ord(h) - 96}", host_id=h)
            for t, h in enumerate(hosts)}
    status = RunStatus(np=3, at=100.0, registrations=regs, placements=tuple(assign_ranks(hosts)),
                       results={0: b""}, exits={0: 0, 1: -9}, failures=(),
                       progress={2: ({"interval": 5}, 80.0)})
    assert status.dead() == {1: -9} and status.unfinished() == [(1, regs[1]), (2, regs[2])]  # rank 0 returned
    assert status.silent_ranks() == [2]  # not heard from for 20 s, over twice its 5 s interval and a second
    assert status.hosts_of([2]) == {"b", "10.0.0.2"} and not status.finished()



@contextlib.contextmanager
def placed(np: int):
    """A real driver service whose ``np`` task agents (clients) have registered: ``(service, agents, ranks)``, each
    task's rank in ``ranks``."""
    secret = b"k" * 32
    service = DriverService(np=np, secret=secret, payload=b"")
    agents = [ServiceClient(service.address, secret) for _ in range(np)]
    try:
        registering = [threading.Thread(target=agent.ask, args=(Register(task=t, host="h", host_id="h", pid=t, gpus=[],
                                                                          devices=[]),))
                       for t, agent in enumerate(agents)]
        for thread in registering:
            thread.start()
        for thread in registering:
            thread.join(60)
        yield service, agents, [p.rank for p in service.placements]
    finally:
        for agent in agents:
            agent.close()
        service.close()


def test_stopping_an_attempt_does_not_wait_for_the_exit_of_ranks_whose_agent_is_gone():
    """An executor killed with its task agent: no exit will come from its ranks, so the graceful part of a stop
    (ABORT_GRACE_S, 5 s) does not wait for them; the ranks that still have an agent are waited for."""
    with placed(3) as (service, agents, ranks):
        agents[0].ask(Exit(rank=ranks[0], code=0))
        agents[1].close()  # its executor was lost, with the agent in it
        waiting = threading.Thread(target=service.wait_for_exits, args=(600,), daemon=True)
        waiting.start()
        waiting.join(2.0)
        assert waiting.is_alive()  # task 2's agent is alive: its rank's exit is still to come
        assert service.agents_gone == {1}
        agents[2].close()
        waiting.join(60)  # not the 600 s: nothing more can come
        assert not waiting.is_alive() and service.agents_gone == {1, 2} and set(service.exits) == {ranks[0]}


def test_stopping_an_attempt_does_not_wait_for_ranks_on_an_executor_spark_lost_whose_agent_is_still_connected():
    """A stopped (or cut-off) host: Spark removed its executor, but its agent's connection stays open and no exit
    will come. ``lost()`` names its rank, asked again while the wait goes on, and the wait ends without the 600 s."""
    spark_lost: set = set()
    asked = []
    with placed(2) as (service, agents, ranks):
        agents[0].ask(Exit(rank=ranks[0], code=0))
        waiting = threading.Thread(target=service.wait_for_exits, args=(600,),
                                   kwargs={"lost": lambda: asked.append(1) or set(spark_lost)}, daemon=True)
        waiting.start()
        waiting.join(1.5)
        assert waiting.is_alive() and len(asked) >= 2  # Spark has not removed it yet: asked again, still waiting
        spark_lost.add(ranks[1])
        waiting.join(60)
        assert not waiting.is_alive() and service.agents_gone == set() and set(service.exits) == {ranks[0]}


# ---- retry_on: a user's exception of its classes, with a budget of its own ------------------------------------

OS_ERROR = ("builtins.OSError", "builtins.Exception", "builtins.BaseException", "builtins.object")


def raises(rank: int, classes=OS_ERROR, message: str = "503 Service Unavailable"):
    """An attempt whose rank ``rank`` raises an exception of ``classes`` (its MRO, as the rank reports it)."""
    def action(s: FakeService):
        s.failures.append(Failure(rank=rank, type=classes[0].rsplit(".", 1)[1], message=message,
                                  traceback="Traceback: OSError\n", arrived=s.clock.now, classes=classes))
    return {"script": lambda n: [(0.1, register()), (0.5, action)]}


def test_an_exception_of_retry_on_relaunches_the_run_as_a_retry_apart_from_max_restarts(run):
    retry_on = ("builtins.OSError",)
    policy, cluster, status = run([raises(0), killed(), ok()], max_restarts=1, retry_on=retry_on, max_retries=1)
    assert policy.history.count(S.RESTART) == 2 and policy.history[-1] is S.DONE
    retry, restart = policy.restarts
    assert (retry.kind, retry.attempt, retry.attempts) == ("retry", 2, 2)
    assert retry.what() == "retry 1 of 1 after rank 0: OSError: 503 Service Unavailable"
    assert (restart.kind, restart.attempt, restart.attempts) == ("restart", 2, 2)
    assert restart.what().startswith("restart 1 of 1 after rank 1's process was killed")


def test_a_subclass_of_a_retry_on_class_is_retried_and_another_exception_fails_at_once(run, capsys):
    timeout = ("builtins.TimeoutError", *OS_ERROR)
    policy, cluster, status = run([raises(1, timeout), ok()], retry_on=("builtins.OSError",), max_retries=2)
    assert policy.history[-1] is S.DONE and policy.restarts[0].what().startswith("retry 1 of 2 after rank 1: Timeout")
    assert f"[sparkhvd] run r1: {policy.restarts[0].what()}; training resumed" in capsys.readouterr().out
    policy, cluster, error = run([raises(0, ("builtins.ValueError", "builtins.Exception")), ok()],
                                 retry_on=("builtins.OSError",), max_retries=2)
    assert policy.history[-1] is S.FAILED and len(cluster.services) == 1 and error.retry_on is None


def test_when_retries_run_out_the_error_says_so_and_names_every_failure(run):
    policy, cluster, error = run([raises(0), raises(1)], max_restarts=5, retry_on=("builtins.OSError",),
                                 max_retries=1)
    assert str(error).splitlines()[:3] == [
        "HorovodRunner run r1 failed: its max_retries=1 retries of builtins.OSError were used up (retry_on); in order:",
        "  1. rank 0: OSError: 503 Service Unavailable",
        "  2. rank 1: OSError: 503 Service Unavailable"]
    assert error.retry_on == "builtins.OSError" and not error.retryable


def test_restarts_run_out_apart_from_retries(run):
    policy, cluster, error = run([raises(0), killed(), killed()], max_restarts=1, retry_on=("builtins.OSError",),
                                 max_retries=3)
    assert str(error).splitlines()[0] == ("HorovodRunner run r1 failed: its max_restarts=1 restarts after "
                                          "infrastructure failures were used up; in order:")
    assert [e.kind for e in policy.restarts] == ["retry", "restart"]


# gloo's words when the ranks' mesh did not connect while their process group was built (the testbed's flake)
MESH_TEXT = ("Gloo connectFullMesh failed with [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] "
             "Connection closed by peer [198.18.0.2]:37553. This is typically caused by a remote worker crashing. "
             "Check the logs of the remote worker before reporting an error. GLHF! 🏖️")


def mesh_not_connected():
    """An attempt whose rank 1 gets gloo's connectFullMesh error in hvd.init(); the others wait, say nothing, and
    are stopped by the driver."""
    return {"script": lambda n: [(0.1, register()), (0.5, fails(1, "RuntimeError", MESH_TEXT))]}


def test_a_mesh_that_did_not_connect_is_relaunched_apart_from_max_restarts(run, capsys):
    policy, cluster, status = run([mesh_not_connected(), ok()])  # max_restarts=0
    assert policy.history[-1] is S.DONE
    [event] = policy.restarts
    assert (event.kind, event.attempt, event.attempts) == ("mesh", 2, 3)
    assert event.what().startswith("relaunch 1 of 2 (not one of max_restarts) after gloo did not connect the ranks "
                                   "while they built their process group: rank 1: RuntimeError: Gloo connectFullMesh "
                                   "failed with"), event.what()
    assert policy.used["restart"] == 0


def test_a_mesh_that_never_connects_fails_after_two_relaunches_and_the_restarts(run):
    policy, cluster, error = run([mesh_not_connected()] * 4, max_restarts=1)
    assert [e.kind for e in policy.restarts] == ["mesh", "mesh", "restart"]
    assert str(error).splitlines()[0] == (
        "HorovodRunner run r1 failed: every one of its 4 attempts (max_restarts=1, and 2 relaunches after gloo did "
        "not connect the ranks) ended in a failure; in order:")


def test_a_mesh_error_after_a_killed_rank_is_the_kills_consequence_not_a_relaunch_of_its_own(run):
    killed_in_setup = {"script": lambda n: [(0.1, register()), (0.5, exits(0, -9)),
                                            (0.6, fails(1, "RuntimeError", MESH_TEXT))]}
    policy, cluster, error = run([killed_in_setup])
    assert policy.history[-1] is S.FAILED and policy.restarts == []
    assert "rank 0's process was killed by signal 9" in str(error)


def test_a_mesh_refused_or_timed_out_is_no_flake_and_fails_as_before(run):
    """gloo's connectFullMesh with "Connection refused" (a firewall, a wrong interface) fails the same way each time:
    not relaunched."""
    refused = MESH_TEXT.replace("Connection closed by peer", "Connection refused")
    attempt = {"script": lambda n: [(0.1, register()), (0.5, fails(1, "RuntimeError", refused))]}
    policy, cluster, error = run([attempt])
    assert policy.history[-1] is S.FAILED and policy.restarts == []
