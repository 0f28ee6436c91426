"""An attempt whose driver service runs in rank 0's Spark task: for a Spark Connect client that the executors cannot
reach (Databricks Connect from a laptop, a job runner off the cluster).

pyspark's TorchDistributor does the same under Connect: its rendezvous runs in the task of partition 0, whose
address the other tasks learn through ``BarrierTaskContext.allGather``. Here partition 0's task starts the
attempt's ``DriverService`` on its executor's address and watches the attempt with the ``Watch`` the driver uses
everywhere else (the start timeout, the grace periods, stalls, the root cause: ``HostedAttempt.host``). When the
attempt ends, what the client needs comes back in the stage's rows as one blob signed with the run's secret: how
it ended and its error, the ranks' registrations and return values, every rank's output, the commits rank 0 sent,
and when rank 0 resumed from a commit.

On the client, ``RemoteService`` stands where the driver service stands in the other modes. It verifies the
blob's signature before it unpickles anything, replays the output into the run's ``LogRouter`` (printed, and in
``rank-<r>.log``, when the attempt ends rather than live), puts the commits in the run's ``CommitStore`` (the next
attempt's task 0 gets them back in its closure), and hands the run's policy what the attempt's ``Watch`` decided:
``RunPolicy._hosted`` then restarts, fails or returns as after any other attempt.
"""

from __future__ import annotations

import io
import os
import pickle
import tempfile
import threading
import time
from dataclasses import dataclass, field, fields
from types import MappingProxyType, SimpleNamespace
from typing import Callable

import cloudpickle

from .._agent.spec import TaskSpec
from .._service.commit_store import Commit, remove_commit
from .._service.logs import LogRouter
from .._service.metrics import MetricsLog
from .._service.service import DriverService
from .._service.status import RunStatus
from .._shared.errors import HorovodRunError
from .._shared.signed import sign, verified
from .._shared.stall_settings import FORWARDED_SETTINGS
from .failure_report import _rebuilt, failure_error
from .stall_inspector import StallInspector
from .stragglers import Stragglers, straggler_settings
from .supervise import FAILED, POLL_S, STOP_WAIT_S, Ended, Watch

#: Output lines rank 0's task keeps for the client, in characters: past it, the rest is counted, not kept.
OUTPUT_KEPT_CHARS = 64 << 20


@dataclass(frozen=True)
class HostedAttempt:
    """What rank 0's task needs to host one attempt; travels in the Spark closure, with the secret inside ``task``."""

    task: TaskSpec  # the agents' spec, but for the address, which task 0 fills in
    payload: bytes = field(repr=False)  # the pickled function, which the service hands to each rank
    np: int = 1
    start_timeout: float = 120.0
    log_dir: str = ""  # the client's: error messages name it
    verbosity: str = "all"
    retry_on: tuple = ()
    description: str = ""  # the launcher's, for messages
    commits: tuple = field(default=(), repr=False)  # (meta, blob, attempt): the newest commit of each state so far
    #: the client's stall and heartbeat settings, (name, value), as the driver's stall inspector reads them
    driver_env: tuple = field(default_factory=lambda: tuple((s.name, s.raw()) for s in FORWARDED_SETTINGS
                                                            if s.raw() is not None))
    #: the client's straggler settings (stragglers.py): task 0 names stragglers as the driver would
    stragglers: dict = field(default_factory=straggler_settings)

    @property
    def run_id(self) -> str:
        return self.task.run_id

    @property
    def attempt(self) -> int:
        return self.task.attempt

    @property
    def use_gpu(self) -> bool:
        return self.task.use_gpu

    def host(self, bind_host: str, share_address: Callable[[tuple], None],
             run_agent: Callable[[tuple], dict]) -> bytes:
        """In rank 0's task: serve the attempt on ``bind_host``, tell the other tasks where (``share_address``:
        ``BarrierTaskContext.allGather``), run this task's own agent (``run_agent(address)``) beside the watch, and
        return the signed outcome for the stage's rows once the attempt has ended."""
        restored: list = []
        commits = _TaskCommits(self.commits)
        metrics = MetricsLog()
        with tempfile.TemporaryDirectory(prefix=f"sparkhvd-{self.run_id}-hosted-") as folder:
            logs = _TaskLogs(self.log_dir, self.verbosity, folder)
            notes = io.StringIO()  # what the stall inspector prints: shown on the client
            service = DriverService(np=self.np, secret=self.task.secret, payload=self.payload, bind_host=bind_host,
                                    on_log=logs, run_id=self.run_id, commits=commits, attempt=self.attempt,
                                    on_restore=lambda meta: restored.append((meta, time.monotonic())),
                                    on_metrics=metrics.record)
            try:
                share_address(service.address)
                agent = _Agent(run_agent, service.address)
                stage = _Stage(self.description, agent)
                stalls = StallInspector(np=self.np, run_id=self.run_id, log_dir=self.log_dir,
                                        driver_env=dict(self.driver_env), out=notes)
                watch = Watch(service, stage, logs, np=self.np, start_timeout=self.start_timeout,
                              run_id=self.run_id, stalls=stalls, retry_on=self.retry_on,
                              stragglers=Stragglers(run_id=self.run_id, out=notes, **self.stragglers))
                ended, status = watch_attempt(service, watch)
                agent.join(STOP_WAIT_S)
            finally:
                service.close()
                logs.close()
        outcome = {"ended": ended.how, "error": _portable(ended.error), "status": _status_fields(status),
                   "preempted": (watch.preempted, watch.preempted_at), "stamps": dict(watch.stamps),
                   "milestones": dict(service.milestones), "restored": restored[:1], "output": logs.calls,
                   "dropped": logs.dropped, "notes": notes.getvalue(),
                   "commits": list(commits.sent.values()), "metrics": metrics.points(), "now": time.monotonic()}
        return sign(self.task.secret, pickle.dumps(outcome, protocol=pickle.HIGHEST_PROTOCOL),
                    label=outcome_label(self))


def outcome_label(attempt: HostedAttempt) -> bytes:
    """What the outcome's signature covers besides its body: which run and attempt it is, so that no other signed
    bytes of the run (another attempt's outcome, say) pass for it."""
    return f"sparkhvd hosted outcome {attempt.run_id} {attempt.attempt}".encode()


def watch_attempt(service, watch: Watch) -> tuple[Ended, RunStatus]:
    """Poll ``service`` through the WAIT and SUPERVISE rules until the attempt ends; how, and the last status."""
    status = service.status(POLL_S)
    while not status.placed:
        if (ended := watch.registering(status)) is not None:
            return ended, status
        status = service.status(POLL_S)
    while (ended := watch.running(status)) is None:
        status = service.status(POLL_S)
    return ended, status


# ---- in rank 0's task --------------------------------------------------------------------------------------------
_NOWHERE = SimpleNamespace(write=lambda text: None, flush=lambda: None)  # task 0 shows nothing: the client does


class _TaskLogs(LogRouter):
    """Task 0's log router: keeps each batch of output for the client (up to ``OUTPUT_KEPT_CHARS``), writes the
    files in a folder of the task's own, shows nothing, and names the client's ``log_dir`` in messages."""

    def __init__(self, log_dir: str, verbosity: str, folder: str):
        super().__init__(log_dir, verbosity, out=_NOWHERE)
        self.folder = folder
        self.calls: list = []  # (rank, stream, lines, progress)
        self.dropped = 0  # lines past OUTPUT_KEPT_CHARS
        self._kept = 0

    def __call__(self, rank: int, stream: str, lines: list, progress: str | None = None) -> None:
        size = sum(len(line) for line in lines) + len(progress or "")
        if self._kept + size <= OUTPUT_KEPT_CHARS:
            self._kept += size
            self.calls.append((rank, stream, list(lines), progress))
        else:
            self.dropped += len(lines)
        super().__call__(rank, stream, lines, progress)

    def _file_path(self, rank: int) -> str:
        return os.path.join(self.folder, f"rank-{rank}.log")


class _TaskCommits:
    """Task 0's commits: the newest of each state from earlier attempts (from the client), and the newest that rank
    0 sends now, kept for the client (``sent``). A commit file this attempt made and a newer one replaced is removed
    here (the client never hears of it); the rest are the client's ``CommitStore``'s to keep or remove."""

    def __init__(self, seeded):
        self._lock = threading.Lock()
        self._commits = {str(meta["key"]): Commit(meta=dict(meta, attempt=attempt), blob=blob)
                         for meta, blob, attempt in seeded}
        self.sent: dict = {}  # key -> (meta, blob, attempt)

    def put(self, meta: dict, blob: bytes, *, attempt: int = 0) -> bool:
        key, seq = str(meta["key"]), int(meta.get("seq", 0))
        with self._lock:
            old = self._commits.get(key)
            if old is not None and old.meta.get("attempt") == attempt and old.meta.get("seq", 0) >= seq:
                return False
            self._commits[key] = Commit(meta=dict(meta, attempt=attempt, at=time.monotonic()), blob=blob)
            replaced = self.sent.get(key)
            self.sent[key] = (dict(meta), blob, attempt)
        if replaced is not None and replaced[0].get("path") and replaced[0].get("path") != meta.get("path"):
            remove_commit(replaced[0])  # this attempt's own older commit in commit_dir: no one else knows of it
        return True

    def get(self, key: str) -> Commit | None:
        with self._lock:
            return self._commits.get(key)

    def attempt_of(self, key: str) -> int | None:
        with self._lock:
            commit = self._commits.get(key)
            return None if commit is None else commit.meta.get("attempt", 0)


class _Agent:
    """Task 0's own agent, on a thread beside the watch."""

    def __init__(self, run_agent: Callable[[tuple], dict], address: tuple):
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(run_agent, address), daemon=True,
                                        name="sparkhvd-hosted-agent")
        self._thread.start()

    def _run(self, run_agent, address) -> None:
        try:
            run_agent(address)
        except BaseException as exc:  # noqa: BLE001 - the watch reports it as the launch's failure
            self.error = exc

    def join(self, timeout: float) -> bool:
        self._thread.join(timeout)
        return not self._thread.is_alive()


class _Stage:
    """The barrier stage as task 0's watch sees it (the ``Launcher`` the ``Watch`` asks): only its own agent. The
    other tasks end with their agents, which leave when the service aborts the attempt or closes."""

    fatal = False

    def __init__(self, description: str, agent: _Agent):
        self.description, self.agent = description, agent

    def failure(self) -> str | None:
        error = self.agent.error
        return None if error is None else (f"rank 0's task agent failed: {type(error).__name__}: {error}; its "
                                           "traceback is in the Spark executor log of the stage's partition 0")

    def lost(self, unfinished: list) -> str | None:
        return None

    def lost_ranks(self, unfinished: list) -> set:
        return set()

    def preempted(self, unfinished: list) -> str | None:
        return None

    def waiting_for(self) -> str:
        return ""

    def join(self, timeout: float) -> bool:
        return self.agent.join(timeout)

    def stop(self) -> None:
        pass  # no task kills another: the ranks left at the abort, and the client cancels a stage that outlives it


def _portable(error: HorovodRunError | None):
    """The error, and its cause pickled apart (its class may not exist on the client), for the outcome."""
    if error is None:
        return None
    try:
        cause = cloudpickle.dumps(error.__cause__) if error.__cause__ is not None else b""
    except Exception:  # noqa: BLE001 - an exception that does not pickle: the traceback text says it
        cause = b""
    return error, cause


def _status_fields(status: RunStatus) -> dict:
    """``status`` as plain values (its mappings are read-only proxies); heartbeats are not sent."""
    values = {f.name: getattr(status, f.name) for f in fields(status)}
    for name, value in values.items():
        if isinstance(value, MappingProxyType):
            values[name] = dict(value)
    values["progress"] = {}
    return values


# ---- on the client --------------------------------------------------------------------------------------------

class RemoteService:
    """The client's side of a hosted attempt, where the policy has the driver service in the other modes: nothing
    to serve or tell (the service runs in rank 0's task); ``outcome`` is what that task reported, once the stage's
    rows bring it. ``launcher``: the attempt's HostedLauncher (runner/_backends/connect_hosted.py)."""

    hosted = True

    def __init__(self, attempt: HostedAttempt, launcher, logs: LogRouter, commits, on_restore: Callable | None,
                 metrics: MetricsLog | None = None):
        self.np, self.attempt, self.launcher = attempt.np, attempt, launcher
        self.logs, self.commits, self.on_restore = logs, commits, on_restore
        self.metrics = metrics if metrics is not None else MetricsLog()
        self.milestones: dict = {}

    def outcome(self, wait: float):
        """What the attempt's task 0 decided (``.ended``, ``.status``, ``.watch``), after waiting up to ``wait``
        seconds for its rows; None while it runs. Where the stage failed before task 0 reported, the launch's
        failure, as the driver service's watch would report it."""
        blob = self.launcher.rows(wait)
        if blob is None:
            failure, ended = self.launcher.failure(), self.launcher.join(0)
            blob = self.launcher.rows(0)  # the rows may have come meanwhile: they win over the stage's end
        if blob is None:
            if failure is None and not ended:
                return None
            failure = failure or ("the stage ended, but rank 0's task sent back nothing; look in the Spark executor "
                                  "log of the stage's partition 0 for why it ended")
            error = failure_error(self, self.logs, [], {}, failure, None, self.attempt.run_id, self.launcher)
            return SimpleNamespace(ended=Ended(FAILED, error), status=self.status(),
                                   watch=SimpleNamespace(preempted=None, preempted_at=None, stamps={}))
        if not self.launcher.join(STOP_WAIT_S):  # a task outlived its ranks: cancel the stage before going on
            self.launcher.stop()
            self.launcher.join(STOP_WAIT_S)
        body = verified(self.attempt.task.secret, blob, label=outcome_label(self.attempt))
        return self._taken(pickle.loads(body), arrived=getattr(self.launcher, "arrived_at", None))  # verified

    def _taken(self, outcome: dict, arrived: float | None = None):
        shift = (arrived or time.monotonic()) - outcome["now"]  # task 0's clock to this one's, when its rows came

        def here(t):
            return None if t is None else t + shift

        for rank, stream, lines, progress in outcome["output"]:
            self.logs(rank, stream, lines, progress)
        if outcome["dropped"]:
            print(f"[sparkhvd] run {self.attempt.run_id}: {outcome['dropped']} lines of the ranks' output past "
                  f"{OUTPUT_KEPT_CHARS >> 20} MiB were not brought back from rank 0's task.", flush=True)
        if outcome["notes"]:
            print(outcome["notes"], end="", flush=True)
        for meta, blob, attempt in outcome["commits"]:
            self.commits.put(meta, blob, attempt=attempt)
        for rank, attempt, at, metrics in outcome["metrics"]:
            self.metrics.record(rank, attempt, metrics, at=here(at))
        if outcome["restored"] and self.on_restore is not None:
            meta, at = outcome["restored"][0]
            self.on_restore(meta, at=here(at))
        self.milestones = {k: here(v) for k, v in outcome["milestones"].items()}
        values = outcome["status"]
        values.update(at=here(values["at"]), placed_at=here(values["placed_at"]),
                      **{k: MappingProxyType(v) for k, v in values.items() if isinstance(v, dict)})
        error = None
        if outcome["error"] is not None:
            error, cause = outcome["error"]
            error.failed_at = here(getattr(error, "failed_at", None)) or time.monotonic()
            if cause:
                error.__cause__ = _rebuilt(cause)
        preempted, preempted_at = outcome["preempted"]
        watch = SimpleNamespace(preempted=preempted, preempted_at=here(preempted_at),
                                stamps={k: here(v) for k, v in outcome["stamps"].items()})
        return SimpleNamespace(ended=Ended(outcome["ended"], error), status=RunStatus(**values), watch=watch)

    def status(self, wait: float = 0.0) -> RunStatus:
        return RunStatus(np=self.np, at=time.monotonic())

    def announce_growth(self) -> None:
        pass  # a hosted run does not grow: no slot count under Connect

    def abort(self, reason: str) -> None:
        pass  # the ranks hear of it when the launcher cancels the stage

    def wait_for_exits(self, timeout: float, lost: Callable[[], set] | None = None) -> None:
        pass

    def close(self) -> None:
        pass
