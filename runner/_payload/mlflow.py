"""The driver's active MLflow run, shared with the ranks, and the ranks' metrics logged into it.

Where the driver has an active run (``mlflow.start_run()``), every rank gets its tracking URI and
run id (``MLFLOW_TRACKING_URI``, ``MLFLOW_RUN_ID``, ``MLFLOW_EXPERIMENT_ID``) and the driver's other
``MLFLOW_*`` settings, so ``mlflow.log_metric`` on a rank logs into that run instead of starting one
per rank. ``MetricsToMlflow`` logs every rank's metrics there too (docs/observability.md). mlflow is never imported
here but by that writer's thread: a driver with an active run has imported it already.
"""

from __future__ import annotations

import contextlib
import math
import os
import queue
import sys
import threading
import time
import warnings

from ..._common import settings

_QUEUE_ROWS = 4096  # rows waiting for a slow tracking server; past it, rows are dropped
#: the row's numbers that go into MLflow, each as ``<name>/rank_<r>`` (runner/_service/metrics.py's rows)
_MLFLOW_NAMES = ("steps", "steps_per_s", "negotiation_s_per_s", "transfer_s_per_s", "data_wait_s_per_s", "cpu_s_per_s",
                 "rss_bytes")


def _active_run():
    mlflow = sys.modules.get("mlflow")
    if mlflow is None:
        return None, None
    try:
        return mlflow, mlflow.active_run()
    except Exception:  # noqa: BLE001 - a broken or partial mlflow: the ranks just don't share a run
        return None, None


def tracking_env() -> dict:
    """The environment variables that point a rank at the driver's active MLflow run; {} without one."""
    mlflow, run = _active_run()
    if run is None:
        return {}
    env = {k: v for k, v in os.environ.items() if k.startswith("MLFLOW_")}  # credentials, store options
    env.update({settings.MLFLOW_TRACKING_URI.name: _absolute(mlflow.get_tracking_uri()),
                settings.MLFLOW_RUN_ID.name: run.info.run_id,
                settings.MLFLOW_EXPERIMENT_ID.name: str(run.info.experiment_id)})
    if _logs_system_metrics(run.info.run_id):
        env[settings.MLFLOW_SYSTEM_METRICS.name] = "1"  # each rank sends its host's, logged per rank
    return env


def _logs_system_metrics(run_id: str) -> bool:
    """Whether the driver's active MLflow run logs system metrics (``mlflow.start_run(log_system_metrics=True)``,
    or ``mlflow.enable_system_metrics_logging()`` before it): MLflow keeps a monitor per such run."""
    try:
        from mlflow.tracking import fluent

        return run_id in getattr(fluent, "run_id_to_system_metrics_monitor", {})
    except Exception:  # noqa: BLE001 - an MLflow that keeps them elsewhere: no system metrics from the ranks
        return False


@contextlib.contextmanager
def shared_run():
    """Yield ``tracking_env()``; afterwards, keep the driver's run RUNNING.

    A rank that logged into the run ends it when its process exits (mlflow's atexit ``end_run``),
    which would mark the driver's still-active run FINISHED: set it back.
    """
    env = tracking_env()
    try:
        yield env
    finally:
        if env:
            _reopen(env[settings.MLFLOW_RUN_ID.name])


def _reopen(run_id: str) -> None:
    mlflow, run = _active_run()
    if run is None or run.info.run_id != run_id:
        return
    try:
        client = mlflow.MlflowClient()
        if client.get_run(run_id).info.status != "RUNNING":
            client.update_run(run_id, status="RUNNING")
    except Exception:  # noqa: BLE001 - the tracking server is unreachable now: the run's status is cosmetic
        pass


def _absolute(uri: str) -> str:
    """A plain local path as a ``file://`` URI, so ranks with another working directory find the same store."""
    if ":" in uri or uri == "databricks":  # a URI (file:, sqlite:, http:, databricks://profile) or Databricks
        return uri
    return "file://" + os.path.abspath(uri)


def metrics_to_mlflow(env: dict | None):
    """The writer of the ranks' metrics into the driver's active MLflow run (``env``: ``tracking_env()``'s); None
    without one, or with SPARKHVD_MLFLOW_METRICS_SECONDS=0."""
    env = env or {}
    run_id = env.get(settings.MLFLOW_RUN_ID.name)
    interval = settings.MLFLOW_METRICS_SECONDS.get()
    if not run_id or interval <= 0:
        return None
    return MetricsToMlflow(run_id, interval, env.get(settings.MLFLOW_TRACKING_URI.name))


class MetricsToMlflow:
    """Every rank's metrics into the driver's active MLflow run, one key per rank (``steps_per_s/rank_3``), at most
    every ``interval`` seconds a rank, plus each rank's last row at the end. Written by a thread of its own, so a
    slow tracking server never holds up the driver service; what it cannot write is dropped with one warning."""

    def __init__(self, run_id: str, interval: float, tracking_uri: str | None = None):
        self.run_id, self.interval, self.tracking_uri = run_id, interval, tracking_uri
        self._queue: queue.Queue = queue.Queue(maxsize=_QUEUE_ROWS)
        self._sent_at: dict = {}  # rank -> the ``t`` of its last row queued
        self._last: dict = {}  # rank -> its latest row, sent at close
        self._warned = False
        self._thread = threading.Thread(target=self._write, name="sparkhvd-mlflow-metrics", daemon=True)
        self._thread.start()

    def __call__(self, rank: int, row: dict) -> None:
        """The latest row of ``rank`` (runner/_service/metrics.py); queued where its interval has passed."""
        at = row.get("t", 0.0)  # the row's own time: a hosted attempt's rows come all at once, at its end
        self._last[rank] = row
        if at - self._sent_at.get(rank, -math.inf) < self.interval:
            return
        self._sent_at[rank] = at
        self._put((rank, row))

    def close(self, timeout: float = 10.0) -> None:
        """Queue each rank's last row, and wait (bounded) for the writer to finish."""
        for rank, row in sorted(self._last.items()):
            self._put((rank, row))
        self._put(None)
        self._thread.join(timeout)

    def _put(self, item) -> None:
        try:
            self._queue.put_nowait(item)
        except queue.Full:
            pass  # the server is slower than the rows: drop, the next row says as much

    def _write(self) -> None:
        import mlflow
        from mlflow.entities import Metric

        client = mlflow.MlflowClient(tracking_uri=self.tracking_uri)
        while (item := self._queue.get()) is not None:
            rank, row = item
            stamp = int(time.time() * 1000)
            step = int(row.get("steps") or 0)
            metrics = [Metric(f"{name}/rank_{rank}", float(value), stamp, step)
                       for name, value in mlflow_values(row).items()]
            # MLflow's own naming of a node's system metrics, the node being the rank: system/rank_3/cpu_...
            metrics += [Metric(f"system/rank_{rank}/{name}", float(value), stamp, step)
                        for name, value in system_values(row).items()]
            try:
                client.log_batch(self.run_id, metrics=metrics)
            except Exception as exc:  # noqa: BLE001 - the tracking server: never the run's failure
                if not self._warned:
                    self._warned = True
                    warnings.warn(f"sparkhvd: could not log the ranks' metrics into MLflow run {self.run_id}: "
                                  f"{type(exc).__name__}: {exc}; the run goes on, and RunResult.metrics has them.",
                                  RuntimeWarning, stacklevel=1)


def mlflow_values(row: dict) -> dict:
    """The row's numbers MLflow gets, by name."""
    values = {name: row.get(name) for name in _MLFLOW_NAMES}
    gpu = row.get("gpu") or {}
    values.update({f"gpu_{k}": v for k, v in gpu.items()})
    return {k: v for k, v in values.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def system_values(row: dict) -> dict:
    """The row's MLflow system metrics (the rank's host's, ``_common/metrics.py``), by MLflow's names."""
    system = row.get("system") or {}
    return {k: v for k, v in system.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
