"""The driver's active MLflow run, shared with the ranks.

Where the driver has an active run (``mlflow.start_run()``), every rank gets its tracking URI and
run id (``MLFLOW_TRACKING_URI``, ``MLFLOW_RUN_ID``, ``MLFLOW_EXPERIMENT_ID``) and the driver's other
``MLFLOW_*`` settings, so ``mlflow.log_metric`` on a rank logs into that run instead of starting one
per rank. mlflow is never imported here: a driver with an active run has imported it already.
"""

from __future__ import annotations

import contextlib
import os
import sys

from ..._common import settings


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
    return env


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
