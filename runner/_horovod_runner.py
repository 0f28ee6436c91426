"""``HorovodRunner``: the user's entry point.

``run`` pickles the function, checks Spark's slots, and sets up what every attempt of the run
shares (the logs, the commits, a secret); ``_Cluster`` launches each attempt (a driver service and
a launcher); the run's policy (``_policy/policy.py``) decides what happens after each.
"""

from __future__ import annotations

import functools
import os
import secrets
import time
import warnings

import cloudpickle

from .._common import settings
from .._common.protocol import new_secret
from ._agent.agent import TaskSpec
from ._backends.api import Backend
from ._backends.registry import backend_for
from ._payload.frameworks import warm_imports
from ._payload.function import pickle_function, size
from ._payload.mlflow import metrics_to_mlflow, shared_run
from ._payload.script import as_payload
from ._policy.hosted import HostedAttempt, RemoteService
from ._policy.live import HEARTBEAT_S, live_view
from ._policy.policy import RunPolicy
from ._policy.result import RestartEvent, RunResult
from ._policy.stragglers import Stragglers, straggler_settings
from ._rank.log import log_to_driver  # noqa: F401 - its path before it moved to the rank's room
from ._runner_config import RunnerConfig
from ._service.commit_store import CommitStore
from ._service.logs import LogRouter, end_run_logs, run_log_dir
from ._service.metrics import MetricsLog
from ._service.run_storage import RunStorage
from ._service.service import DriverService
from ._service.status import RunStatus
from ._service.timeline import TimelineLog

__all__ = ["HorovodRunner", "RestartEvent", "RunResult", "RunnerConfig"]


class HorovodRunner:
    """Runs a training function on ``np`` ranks, Horovod style.

    ``np > 0``: one Spark barrier-mode task per rank on the active SparkSession (where none
    is active, an embedded ``local[np]`` session); each task asks for one GPU where the cluster
    defines a ``gpu`` resource, and is pinned to it through ``CUDA_VISIBLE_DEVICES``.
    ``np < 0``: ``-np`` processes on the driver (``np=-1``: one, for debugging).

    Every rank's stdout and stderr are printed on the driver as ``[rank] line`` while it runs
    (``driver_log_verbosity="log_callback_only"``: only what ranks send with
    ``sparkhvd.log_to_driver``) and kept in ``<log_dir>/rank-<rank>.log``. A rank that raises
    fails the run with ``HorovodRunError`` naming the rank, its exception and traceback;
    the other ranks are stopped. Ranks that do not register within ``start_timeout`` seconds
    (default 120, or ``$SPARKHVD_START_TIMEOUT``) fail the run too. ``network_interface``
    (Horovod's ``--network-interface``) names the interface ranks talk to each other on; by
    default, the one that routes to the driver.

    ``max_restarts``: how many times an infrastructure failure (a rank process killed, an executor
    or host lost, a peer gone silent, a stall) relaunches every rank, which then resume from the
    last ``state.commit()`` of ``hvd.elastic.run`` (docs/elastic.md); a user's exception is never
    retried. Commits go to the driver, or to ``commit_dir`` (a path or pyarrow filesystem URL every
    host reaches) for large models. ``min_np``: where Spark has fewer than ``np`` task slots after a failure
    (an executor lost), a restart goes on at once with as many as there are, down to ``min_np``, as Horovod
    elastic goes on with its survivors, and the run grows back to ``np`` at a commit once Spark has the slots. ``max_np``:
    while Spark has free task slots, the run grows, up to ``max_np`` ranks (and a run a restart
    shrank, back to ``np``), at a commit: every rank leaves there and all are relaunched.

    ``retry_on``: exception classes (``(OSError, TimeoutError)``, say) of transient errors in the user's own
    code, an object store's 503 or a flaky read: a rank that raises one relaunches every rank from the last
    commit, as an infrastructure failure does, up to ``max_retries`` times (default 3), a budget apart from
    ``max_restarts``. Any other exception still fails the run at once.

    ``max_preemptions`` (default None: no limit): when Spark decommissions an executor that holds ranks
    (``spark.decommission.enabled``: SIGPWR to the executor or its worker, a Kubernetes pod's preStop), every
    rank of an ``hvd.elastic.run`` leaves at a commit soon after, and the run goes on from it on the executors
    Spark keeps: a relaunch counted against ``max_preemptions``, not ``max_restarts``.

    ``run_id`` and ``storage`` (a path every host reaches or a pyarrow filesystem URL; default
    ``$SPARKHVD_STORAGE``): the run keeps its commits in ``<storage>/<run_id>/``, so that it outlives its
    driver: a new driver that runs with the same ``run_id`` and storage resumes from the newest complete
    commit. A run that fails keeps them; one that succeeds removes them, or keeps the newest
    ``keep_commits`` of each state, and with ``keep_best=("val_loss", "min")`` the commit whose state field
    ``val_loss`` is lowest too (``RunResult.commits`` lists what is kept). Another driver running
    the same ``run_id`` at once is refused (``RunIdInUse``).
    """

    def __init__(self, np: int, *, driver_log_verbosity: str = "all", start_timeout: float | None = None,
                 log_dir: str | None = None, network_interface: str | None = None, max_restarts: int = 0,
                 min_np: int | None = None, max_np: int | None = None, commit_dir: str | None = None,
                 retry_on: tuple = (), max_retries: int | None = None, run_id: str | None = None,
                 storage: str | None = None, keep_commits: int = 0, keep_best: tuple | None = None,
                 max_preemptions: int | None = None):
        self.config = RunnerConfig(np=np, driver_log_verbosity=driver_log_verbosity,
                                   start_timeout=start_timeout, log_dir=log_dir,
                                   network_interface=network_interface, max_restarts=max_restarts,
                                   min_np=min_np, max_np=max_np, commit_dir=commit_dir, retry_on=retry_on,
                                   max_retries=max_retries, run_id=run_id, storage=storage,
                                   keep_commits=keep_commits, keep_best=keep_best, max_preemptions=max_preemptions)
        self.last_result: RunResult | None = None

    @classmethod
    def _from_config(cls, config: RunnerConfig) -> HorovodRunner:
        """A runner for ``config``, with the keyword-only fields the drop-ins and estimators set (checked when the
        config was made)."""
        runner = cls.__new__(cls)
        runner.config, runner.last_result = config, None
        return runner

    @property
    def np(self) -> int:
        return self.config.np

    def run(self, main, *args, **kwargs):
        """Run ``main(**kwargs)`` on every rank; return rank 0's value.

        Only rank 0's value travels to the driver: the other entries of
        ``self.last_result.values`` are None. ``run_all`` returns every rank's value.

        ``main`` may also be the path of a Python script followed by its command-line arguments:
        ``run("train.py", "--epochs", "3")`` runs it on every rank as ``python train.py --epochs 3``
        would (as ``__main__``, its folder first on ``sys.path``; the source is read on the driver and
        shipped) and returns None. ``sys.exit(0)`` is success; another exit status fails the run.
        Where the driver has an active MLflow run, the ranks log into it (docs/cli.md).
        """
        with shared_run() as env:
            return self._run(main, kwargs, every_value=False, args=args, env=env).value

    def run_all(self, main, *args, **kwargs) -> RunResult:
        """Run ``main(**kwargs)``, or a script as ``run`` does, on every rank; return a RunResult with every
        rank's value (None for each rank of a script)."""
        with shared_run() as env:
            return self._run(main, kwargs, every_value=True, args=args, env=env)

    def _run(self, main, kwargs: dict, *, every_value: bool, args: tuple = (), env: dict | None = None) -> RunResult:
        main, kwargs = as_payload(main, args, kwargs)  # a script path becomes _script.run_script and its source
        if not callable(main):
            raise TypeError(f"HorovodRunner.run needs a function to run, got {type(main).__name__}; pass a function, "
                            "or the path of a Python script (run('train.py', '--epochs', '3')).")
        cfg = self.config
        np = abs(cfg.np)
        started = time.monotonic()
        payload = pickle_function(main, kwargs)
        preload = warm_imports(main, kwargs)
        run_id = cfg.run_id or secrets.token_hex(4)
        backend = backend_for(cfg)
        bind_host = backend.prepare(np, run_id=run_id, verbose=cfg.driver_log_verbosity == "all", gpus=cfg.use_gpu)
        backend.check_sizes(min_np=cfg.min_np, max_np=cfg.max_np)
        storage = None
        if cfg.storage is not None:
            storage = RunStorage(cfg.storage, run_id)
            storage.claim()  # RunIdInUse where another driver runs it
        succeeded = False
        try:
            commits = CommitStore(commit_dir=cfg.commit_dir, run_id=run_id, storage=storage, keep=cfg.keep_commits,
                                  keep_best=cfg.keep_best)
        except BaseException:
            if storage is not None:
                storage.release()
            raise
        log_dir = run_log_dir(run_id, cfg.log_dir)  # cfg.log_dir, or a new folder under the log root (_service/logs.py)
        logs = LogRouter(log_dir, cfg.driver_log_verbosity)
        to_mlflow = live = policy = None
        timeline = TimelineLog()
        try:
            live = live_view(run_id, cfg.driver_log_verbosity, logs)  # a notebook's table, a terminal's status line
            to_mlflow = metrics_to_mlflow(env)  # a bad SPARKHVD_MLFLOW_METRICS_SECONDS ends here, the lease released
            metrics = MetricsLog(started, sink=to_mlflow)
            if commits.inherited and cfg.driver_log_verbosity == "all":
                print(_inherited_line(run_id, storage, commits.inherited), flush=True)
            cluster = _Cluster(backend, cfg, run_id=run_id, payload=payload, logs=logs, commits=commits,
                               every_value=every_value, env=env, bind_host=bind_host, preload=preload,
                               metrics=metrics, live=live is not None, timeline=timeline)
            policy = RunPolicy(cluster, logs, np=np, start_timeout=cfg.start_timeout, run_id=run_id,
                               max_restarts=cfg.max_restarts, min_np=cfg.min_np, max_np=cfg.max_np,
                               retry_on=cfg.retry_names(), max_retries=cfg.max_retries,
                               max_preemptions=cfg.max_preemptions,
                               stragglers=functools.partial(Stragglers, run_id=run_id, **straggler_settings()),
                               live=live)
            status = policy.run()
            result = _result(status, logs, run_id, payload, started, every_value, policy.restarts)
            succeeded = True
        finally:
            if live is not None:
                live.close(ok=succeeded)
            if to_mlflow is not None:
                to_mlflow.close()
            commits.close(succeeded=succeeded)
            logs.close()
            timeline_path = _write_timeline(timeline, run_id, log_dir, policy, verbose=cfg.driver_log_verbosity == "all")
            end_run_logs(log_dir, given=cfg.log_dir is not None, succeeded=succeeded)
        result.commits = commits.kept()
        result.metrics = metrics.series()
        result.timeline = timeline_path
        self.last_result = result
        return result


class _Cluster:
    """Where this run's ranks run (the policy's ``Cluster``): each attempt is a driver service and a launcher of
    ``backend`` (runner/_backends/). ``bind_host``: where the driver service listens, an address the ranks reach."""

    def __init__(self, backend: Backend, cfg: RunnerConfig, *, run_id: str, payload: bytes, logs: LogRouter,
                 commits: CommitStore, every_value: bool, env: dict | None, bind_host: str = "127.0.0.1",
                 preload: tuple = (), metrics: MetricsLog | None = None, live: bool = False,
                 timeline: TimelineLog | None = None):
        self.backend, self.cfg, self.run_id, self.payload = backend, cfg, run_id, payload
        self.logs, self.commits, self.every_value = logs, commits, every_value
        hidden = {} if cfg.use_gpu else {settings.CUDA_VISIBLE_DEVICES.name: ""}  # as TorchDistributor(use_gpu=False)
        # a live view redraws every second: the ranks' heartbeats bring its figures that often, unless set otherwise
        beat = {settings.HEARTBEAT.name: f"{HEARTBEAT_S:g}"} if live and settings.HEARTBEAT.raw() is None else {}
        self.env = tuple({**_forwarded_settings(), **hidden, **beat, **_timeline_env(), **(env or {})}.items())
        self.timeline = timeline if timeline is not None else TimelineLog()
        self.verbose = cfg.driver_log_verbosity == "all"
        self.secret = new_secret()  # one per run: every attempt's service and ranks share it
        self.bind_host = bind_host
        self.preload = preload  # what the ranks' warm process imports besides torch
        self.metrics = metrics if metrics is not None else MetricsLog()  # every rank's heartbeats' metrics

    def start(self, n: int, attempt: int, on_restore):
        """A driver service for ``n`` ranks, and a launcher that has started them."""
        cfg = self.cfg
        launcher = self.backend.launcher(n, gpus=cfg.use_gpu)
        if not attempt and self.verbose:
            print(f"[sparkhvd] run {self.run_id}: np={cfg.np} on {launcher.description}; function pickled to "
                  f"{size(len(self.payload))}; logs in {self.logs.log_dir}", flush=True)
        if self.backend.hosts_service:
            return self._start_hosted(launcher, n, attempt, on_restore)
        service = DriverService(np=n, secret=self.secret, payload=self.payload, bind_host=self.bind_host,
                                on_log=self.logs, run_id=self.run_id, commits=self.commits, attempt=attempt,
                                on_restore=on_restore, on_metrics=self.metrics.record,
                                on_timeline=self.timeline.record)
        try:
            launcher.start(self._spec(service.address, attempt))
        except BaseException:
            launcher.stop()  # whatever it started before the exception (Ctrl-C in the middle of the launch)
            service.close()
            raise
        return service, launcher

    def _start_hosted(self, launcher, n: int, attempt: int, on_restore):
        """An attempt whose driver service rank 0's task hosts (runner/_policy/hosted.py)."""
        cfg = self.cfg
        hosted = HostedAttempt(task=self._spec(("", 0), attempt), payload=self.payload, np=n,
                               start_timeout=cfg.start_timeout, log_dir=self.logs.log_dir,
                               verbosity=cfg.driver_log_verbosity, retry_on=cfg.retry_names(),
                               description=launcher.description, commits=tuple(self.commits.newest_each()))
        try:
            launcher.start(hosted)
        except BaseException:
            launcher.stop()
            raise
        return RemoteService(hosted, launcher, self.logs, self.commits, on_restore, self.metrics), launcher

    def _spec(self, address: tuple, attempt: int) -> TaskSpec:
        cfg = self.cfg
        return TaskSpec(address=address, secret=self.secret, run_id=self.run_id, stall_tasks=cfg.stall_tasks,
                        network_interface=cfg.network_interface, every_value=self.every_value, attempt=attempt,
                        commit_dir=self.commits.commit_dir, layout=cfg.layout, max_restarts=cfg.max_restarts,
                        use_gpu=cfg.use_gpu, env=self.env, warm_preload=self.preload)

    def free_slots(self) -> int:
        return self.backend.free_slots()

    def slots_for_restart(self, want: int, least: int | None, timeout: float) -> int:
        return self.backend.slots_for_restart(want, least, timeout)

    def replace_hosts(self, hosts: frozenset) -> None:
        self.backend.replace_hosts(hosts)


def _result(status: RunStatus, logs: LogRouter, run_id: str, payload: bytes, started: float, every_value: bool,
            restarts: list) -> RunResult:
    np = status.np
    values = [cloudpickle.loads(status.results[r]) if every_value or r == 0 else None  # authenticated
              for r in range(np)]
    regs = [status.registrations[t] for t in range(np)]
    order = sorted(range(np), key=lambda t: status.placements[t].rank)
    return RunResult(values=values, run_id=run_id, log_dir=logs.log_dir, log_paths=logs.paths(),
                     placements=[status.placements[t] for t in order], hosts=[regs[t].host for t in order],
                     gpus=[regs[t].gpus for t in order], payload_bytes=len(payload),
                     seconds=time.monotonic() - started, restarts=list(restarts))


def _inherited_line(run_id: str, storage: RunStorage, inherited: dict) -> str:
    """What the driver says when it takes up a run an earlier driver left in the storage."""
    newest = max(inherited.values(), key=lambda m: int(m.get("seq", 0)))
    fields = " ".join(f"{k}={v}" for k, v in (newest.get("fields") or {}).items()) or "with no plain fields"
    return (f"[sparkhvd] run {run_id}: resuming the run an earlier driver left in {storage.url}/{run_id}, from its "
            f"newest complete commit ({fields}; commit {newest.get('seq')} of {len(inherited)} state"
            f"{'s' if len(inherited) > 1 else ''}).")


def _timeline_env() -> dict:
    """Under HOROVOD_TIMELINE on the driver, its ranks record their timelines from hvd.init() (SPARKHVD_TIMELINE)."""
    if not settings.TIMELINE_PATH.get():
        return {}
    return {settings.TIMELINE.name: "cycles" if settings.TIMELINE_MARK_CYCLES.get() else "1"}


def _write_timeline(timeline: TimelineLog, run_id: str, log_dir: str, policy, *, verbose: bool) -> str | None:
    """The run's merged timeline, where any rank sent a trace: at HOROVOD_TIMELINE, else timeline.json in the run's
    log folder; its path (printed), or None. A trace that cannot be written is a warning, never the run's failure."""
    if not timeline:
        return None
    path = settings.TIMELINE_PATH.get() or os.path.join(log_dir, "timeline.json")
    restarts = tuple(policy.restarts) if policy is not None else ()
    try:
        timeline.write(path, run_id, restarts)
    except OSError as exc:
        warnings.warn(f"sparkhvd run {run_id}: could not write the merged timeline to {path} ({exc}); set "
                      f"HOROVOD_TIMELINE to a path the driver can write.", RuntimeWarning, stacklevel=3)
        return None
    if verbose:
        print(f"[sparkhvd] run {run_id}: the timeline of every rank is in {path} (open it in ui.perfetto.dev or "
              "chrome://tracing)", flush=True)
    return path


def _forwarded_settings() -> dict:
    """The driver's settings that the ranks must share wherever they run (executors do not inherit the driver's
    environment): ``SPARKHVD_HOROVOD_ALIASES`` (runner/_rank/aliases.py)."""
    raw = settings.HOROVOD_ALIASES.raw()
    return {} if raw is None else {settings.HOROVOD_ALIASES.name: raw}
