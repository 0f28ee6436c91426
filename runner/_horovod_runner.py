"""``HorovodRunner``: the user's entry point.

``run`` pickles the function, checks Spark's slots, and sets up what every attempt of the run
shares (the logs, the commits, a secret); ``_Cluster`` launches each attempt (a driver service and
a launcher); the run's policy (``_policy/policy.py``) decides what happens after each.
"""

from __future__ import annotations

import secrets
import socket
import time
import warnings

import cloudpickle

from .._common import settings
from .._common.protocol import new_secret
from ._agent.agent import TaskSpec
from ._backends import connect as _spark_connect
from ._backends import spark as _spark
from ._backends.launcher import LocalLauncher
from ._payload.function import pickle_function, size
from ._payload.mlflow import shared_run
from ._payload.script import as_payload
from ._policy.policy import RunPolicy
from ._policy.result import RestartEvent, RunResult
from ._runner_config import RunnerConfig
from ._service.commit_store import CommitStore
from ._service.logs import LogRouter, end_run_logs, run_log_dir
from ._service.service import DriverService
from ._service.status import RunStatus

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
    host reaches) for large models. ``min_np``: where Spark cannot give all ``np`` slots back within
    ``start_timeout``, a restart goes on with as many as there are, down to ``min_np``. ``max_np``:
    while Spark has free task slots, the run grows, up to ``max_np`` ranks (and a run a restart
    shrank, back to ``np``), at a commit: every rank leaves there and all are relaunched.
    """

    def __init__(self, np: int, *, driver_log_verbosity: str = "all", start_timeout: float | None = None,
                 log_dir: str | None = None, network_interface: str | None = None, max_restarts: int = 0,
                 min_np: int | None = None, max_np: int | None = None, commit_dir: str | None = None):
        self.config = RunnerConfig(np=np, driver_log_verbosity=driver_log_verbosity,
                                   start_timeout=start_timeout, log_dir=log_dir,
                                   network_interface=network_interface, max_restarts=max_restarts,
                                   min_np=min_np, max_np=max_np, commit_dir=commit_dir)
        self.last_result: RunResult | None = None

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
        sc = remote = None
        bind_host = "127.0.0.1"
        if cfg.np > 0:
            remote = _spark_connect.remote_session()  # the user's Spark Connect session: never an embedded one then
            if remote is not None:
                bind_host = _spark_connect.check(remote, np)  # what the server's conf says, and where executors reach us
            else:
                sc = _spark.spark_context(np)
                _spark.preflight(sc, np, verbose=cfg.driver_log_verbosity == "all", gpus=cfg._use_gpu)  # slots, GPUs, executors' Python
                bind_host = _driver_bind_host(sc)
        run_id = secrets.token_hex(4)
        if sc is not None and cfg._warn_unencrypted:
            _spark.warn_unencrypted(sc, run_id)
        log_dir = run_log_dir(run_id, cfg.log_dir)  # cfg.log_dir, or a new folder under the log root (_service/logs.py)
        logs = LogRouter(log_dir, cfg.driver_log_verbosity)
        commits = CommitStore(commit_dir=cfg.commit_dir, run_id=run_id)
        cluster = _Cluster(sc, cfg, run_id=run_id, payload=payload, logs=logs, commits=commits,
                           every_value=every_value, env=env, remote=remote, bind_host=bind_host)
        policy = RunPolicy(cluster, logs, np=np, start_timeout=cfg.start_timeout, run_id=run_id,
                           max_restarts=cfg.max_restarts, min_np=cfg.min_np, max_np=cfg.max_np)
        try:
            status = policy.run()
            self.last_result = _result(status, logs, run_id, payload, started, every_value, policy.restarts)
            return self.last_result
        finally:
            commits.close()
            logs.close()
            end_run_logs(log_dir, given=cfg.log_dir is not None,  # last_result is set only when this run succeeded
                         succeeded=self.last_result is not None and self.last_result.run_id == run_id)


class _Cluster:
    """Where this run's ranks run (the policy's ``Cluster``): a Spark barrier stage per attempt on ``sc``, or on
    ``remote`` (a Spark Connect session: no task slot count, no executor replacement), or processes on the driver
    where both are None. ``bind_host``: where the driver service listens, an address the ranks reach."""

    def __init__(self, sc, cfg: RunnerConfig, *, run_id: str, payload: bytes, logs: LogRouter, commits: CommitStore,
                 every_value: bool, env: dict | None, remote=None, bind_host: str = "127.0.0.1"):
        self.sc, self.remote, self.cfg, self.run_id, self.payload = sc, remote, cfg, run_id, payload
        self.logs, self.commits, self.every_value = logs, commits, every_value
        hidden = {} if cfg._use_gpu else {settings.CUDA_VISIBLE_DEVICES.name: ""}  # as TorchDistributor(use_gpu=False)
        self.env = tuple({**_forwarded_settings(), **hidden, **(env or {})}.items())
        self.verbose = cfg.driver_log_verbosity == "all"
        self.secret = new_secret()  # one per run: every attempt's service and ranks share it
        self.bind_host = bind_host
        self.replaced: set[str] = set()  # executors this run asked Spark to replace: never a later attempt's cause

    def start(self, n: int, attempt: int, on_restore):
        """A driver service for ``n`` ranks, and a launcher that has started them."""
        cfg = self.cfg
        if self.remote is not None:
            launcher = _spark_connect.ConnectLauncher(self.remote, n)
        elif self.sc is not None:
            launcher = _spark.SparkLauncher(self.sc, n, replaced=self.replaced, gpus=cfg._use_gpu)
        else:
            launcher = LocalLauncher(n)
        if not attempt and self.verbose:
            print(f"[sparkhvd] run {self.run_id}: np={cfg.np} on {launcher.description}; function pickled to "
                  f"{size(len(self.payload))}; logs in {self.logs.log_dir}", flush=True)
        service = DriverService(np=n, secret=self.secret, payload=self.payload, bind_host=self.bind_host,
                                on_log=self.logs, run_id=self.run_id, commits=self.commits, attempt=attempt,
                                on_restore=on_restore)
        try:
            launcher.start(TaskSpec(address=service.address, secret=self.secret, run_id=self.run_id,
                                    stall_tasks=cfg._stall_tasks, network_interface=cfg.network_interface,
                                    every_value=self.every_value, attempt=attempt, commit_dir=cfg.commit_dir,
                                    layout=cfg._layout, max_restarts=cfg.max_restarts, use_gpu=cfg._use_gpu,
                                    env=self.env))
        except BaseException:
            launcher.stop()  # whatever it started before the exception (Ctrl-C in the middle of the launch)
            service.close()
            raise
        return service, launcher

    def free_slots(self) -> int:
        return 0 if self.sc is None else _free_slots(self.sc)

    def slots_for_restart(self, want: int, least: int | None, timeout: float) -> int:
        if self.sc is None:
            return want
        return _spark.slots_for_restart(self.sc, want, least, timeout, verbose=self.verbose)

    def replace_executors(self, hosts: frozenset) -> None:
        if self.sc is not None:
            self.replaced.update(_replace_executors(self.sc, set(hosts), self.run_id))


def _free_slots(sc) -> int:
    """Task slots no running task of this application holds (Spark's slot count includes busy ones)."""
    tracker = sc.statusTracker()
    running = 0
    for stage in tracker.getActiveStageIds():
        info = tracker.getStageInfo(stage)
        running += info.numActiveTasks if info is not None else 0
    return _spark.task_slots(sc) - running


def _replace_executors(sc, hosts: set, run_id: str) -> list:
    """Ask Spark to replace the executors on ``hosts``; returns their ids (none where Spark cannot be asked)."""
    try:
        ids = _spark.replace_executors(sc, hosts)
    except Exception as exc:  # noqa: BLE001 - a Spark without this API: Spark notices the lost host itself, later
        warnings.warn(f"sparkhvd run {run_id}: could not ask Spark to replace the executors on {sorted(hosts)}, whose "
                      f"ranks went silent ({type(exc).__name__}: {exc}); the restart waits until Spark gives up on "
                      "them (spark.network.timeout).", RuntimeWarning, stacklevel=3)
        return []
    if ids:
        print(f"[sparkhvd] run {run_id}: asked Spark to replace executor{'s' if len(ids) > 1 else ''} "
              f"{', '.join(ids)} on {', '.join(sorted(hosts))}, whose ranks went silent.", flush=True)
    return ids


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


def _forwarded_settings() -> dict:
    """The driver's settings that the ranks must share wherever they run (executors do not inherit the driver's
    environment): ``SPARKHVD_HOROVOD_ALIASES`` (runner/_rank/aliases.py)."""
    raw = settings.HOROVOD_ALIASES.raw()
    return {} if raw is None else {settings.HOROVOD_ALIASES.name: raw}


def _driver_bind_host(sc) -> str:
    """Loopback for local masters; otherwise the address executors use to reach the driver."""
    if sc.master.startswith("local"):
        return "127.0.0.1"
    return sc.getConf().get("spark.driver.host") or socket.gethostbyname(socket.gethostname())
