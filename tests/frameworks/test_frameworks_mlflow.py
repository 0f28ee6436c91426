"""Hugging Face's MLflow callback and Lightning's ``MLFlowLogger`` log into the driver's active MLflow run: one run,
not one per rank (runner/_payload/mlflow.py gives every rank ``MLFLOW_RUN_ID`` and ``MLFLOW_TRACKING_URI``)."""

from __future__ import annotations

from _installed import needs

from sparkhvd import HorovodRunner

pytestmark = [needs("mlflow", reason="the mlflow extra: pip install 'sparkhvd[mlflow]'"), needs("transformers", "lightning")]


def _hugging_face_then_lightning(root: str):
    import os

    os.environ["HF_HUB_OFFLINE"] = "1"
    import lightning as L
    import torch
    from lightning.pytorch.loggers import MLFlowLogger
    from transformers import Trainer, TrainingArguments

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)

        def forward(self, x, labels=None):
            out = self.layer(x)
            return {"loss": torch.nn.functional.mse_loss(out, labels), "logits": out}

    class Rows(torch.utils.data.Dataset):
        def __len__(self):
            return 16

        def __getitem__(self, i):
            x = torch.full((4,), float(i) / 16)
            return {"x": x, "labels": x.sum(0, keepdim=True)}

    run_id = os.environ.get("MLFLOW_RUN_ID")  # read first: mlflow takes it out of the environment when it resumes
    args = TrainingArguments(output_dir=os.path.join(root, "hf"), per_device_train_batch_size=4, max_steps=2,
                             logging_steps=1, report_to=["mlflow"], use_cpu=True, save_strategy="no",
                             disable_tqdm=True)
    Trainer(model=Tiny(), args=args, train_dataset=Rows()).train()

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)

        def training_step(self, batch, _):
            loss = torch.nn.functional.mse_loss(self.layer(batch["x"]), batch["labels"])
            self.log("lightning_loss", loss)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    logger = MLFlowLogger(run_id=run_id, tracking_uri=os.environ["MLFLOW_TRACKING_URI"])  # the driver's run
    trainer = L.Trainer(accelerator="cpu", strategy="ddp", devices=2, num_nodes=1, max_steps=2, logger=logger,
                        log_every_n_steps=1, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(Module(), torch.utils.data.DataLoader(Rows(), batch_size=4))
    return run_id


def test_hugging_face_and_lightning_log_into_the_drivers_run(tmp_path, monkeypatch):
    import mlflow

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # mlflow 3 keeps the file store behind this switch
    mlflow.set_tracking_uri(f"file://{tmp_path}/mlruns")
    try:
        with mlflow.start_run() as run:
            values = HorovodRunner(np=-2, driver_log_verbosity="log_callback_only").run_all(
                _hugging_face_then_lightning, root=str(tmp_path)).values
            client = mlflow.MlflowClient()
            seen = client.get_run(run.info.run_id)
            assert seen.info.status == "RUNNING"  # Lightning's logger ended it on rank 0: the driver's is reopened
        assert values == [run.info.run_id] * 2
        assert {"loss", "lightning_loss"} <= set(seen.data.metrics), seen.data.metrics  # HF's, then Lightning's
        assert [r.info.run_id for r in client.search_runs([run.info.experiment_id])] == [run.info.run_id]
        assert len(client.search_experiments()) == 1  # Lightning's logger made no experiment of its own
    finally:
        mlflow.set_tracking_uri(None)
