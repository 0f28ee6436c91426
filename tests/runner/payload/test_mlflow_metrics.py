"""Every rank's metrics into the driver's active MLflow run (runner/_payload/mlflow.py: MetricsToMlflow), and MLflow's
own system metrics of each rank's host: real mlflow-skinny on a file store, real rank processes (np=-2), heartbeats
every 0.3 s, a row per rank every 0.5 s."""

from __future__ import annotations

import pytest

from sparkhvd import HorovodRunner

mlflow = pytest.importorskip("mlflow", reason="the mlflow extra: pip install 'sparkhvd[mlflow]'")

STEPS = 25


def _train(steps: int):
    import time

    import torch

    import sparkhvd.collective.torch as hvd

    hvd.init()
    model = torch.nn.Linear(4, 1)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                   named_parameters=model.named_parameters())
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        time.sleep(0.1)
    return hvd.rank()


@pytest.mark.timeout(120)
def test_each_ranks_metrics_go_into_the_drivers_run_keyed_by_rank_at_a_bounded_rate(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # mlflow 3 keeps the file store behind this switch
    monkeypatch.setenv("SPARKHVD_HEARTBEAT_SECONDS", "0.3")
    monkeypatch.setenv("SPARKHVD_MLFLOW_METRICS_SECONDS", "0.5")
    mlflow.set_tracking_uri(f"file://{tmp_path}/mlruns")
    try:
        with mlflow.start_run(log_system_metrics=True) as run:  # MLflow's system metrics: every rank's host's too
            result = HorovodRunner(np=-2, driver_log_verbosity="log_callback_only").run_all(_train, steps=STEPS)
        client = mlflow.MlflowClient()
        keys = set(client.get_run(run.info.run_id).data.metrics)
        for rank in (0, 1):
            steps = client.get_metric_history(run.info.run_id, f"steps/rank_{rank}")
            rows = result.metrics[rank]
            most = (rows[-1]["t"] - rows[0]["t"]) / 0.5 + 2  # a row each 0.5 s at most, and the last at the end
            assert 1 < len(steps) <= most and len(steps) < len(rows), (len(steps), len(rows))
            assert steps[-1].value == STEPS and steps[-1].step == STEPS  # the last row, at the end
            assert {f"steps_per_s/rank_{rank}", f"cpu_s_per_s/rank_{rank}", f"rss_bytes/rank_{rank}"} <= keys, keys
            # MLflow's own names, with the rank as the node id (MLflow's "system/<node_id>/<name>")
            assert {f"system/rank_{rank}/cpu_utilization_percentage", f"system/rank_{rank}/system_memory_usage_megabytes",
                    f"system/rank_{rank}/disk_usage_percentage", f"system/rank_{rank}/network_receive_megabytes"} <= keys
            memory = client.get_metric_history(run.info.run_id, f"system/rank_{rank}/system_memory_usage_megabytes")
            assert 1 < len(memory) <= most and all(m.value > 100 for m in memory)  # this machine's memory in use, MB
            assert rows[-1]["system"]["system_memory_usage_megabytes"] > 100  # RunResult.metrics has them too
        ours = {k for k in keys if not k.startswith("system/")}
        assert all(k.rsplit("/rank_", 1)[-1] in ("0", "1") for k in ours), keys
        assert all(k.split("/")[1] in ("rank_0", "rank_1") for k in keys - ours if k.count("/") == 2), keys
    finally:
        mlflow.set_tracking_uri(None)
