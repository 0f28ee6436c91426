"""LightningEstimator on a real local[2] Spark session: Lightning's own DDP on 2 ranks, fed by the sharded readers.

- fit (with validation), transform, save, load, transform again: identical predictions, and the history has each
  epoch's logged training and validation loss;
- a fit resumed by run_id (Lightning's own ckpt_path) trains only the epoch left (the weights of an interrupted
  fit are compared with an uninterrupted one's for TorchEstimator, in test_ml_torch.py);
- a module whose forward does not match the labels fails before the launch.
"""

from __future__ import annotations

import sys

import cloudpickle
import numpy as np
import pytest
import torch

from sparkhvd.ml import LightningEstimator, LightningModel, Store

pl = pytest.importorskip("lightning.pytorch")
cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the ranks and executors cannot import this file

ROWS = 64


class Regression(pl.LightningModule):
    def __init__(self, outputs: int = 1):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Linear(3, outputs)

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, index):
        loss = torch.nn.functional.mse_loss(self(batch["features"]).reshape(-1), batch["y"])
        self.log("train_loss", loss, on_step=False, on_epoch=True, sync_dist=True)
        return loss

    def validation_step(self, batch, index):
        loss = torch.nn.functional.mse_loss(self(batch["features"]).reshape(-1), batch["y"])
        self.log("val_loss", loss, on_epoch=True, sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.fixture(scope="module")
def df(spark):
    from pyspark.ml.linalg import Vectors

    rng = np.random.default_rng(1)
    x = rng.normal(size=(ROWS, 3))
    y = x @ np.array([1.0, -2.0, 0.5])
    return spark.createDataFrame([(Vectors.dense(x[i]), float(y[i])) for i in range(ROWS)], ["features", "y"]).cache()


def _estimator(root, **kw):
    args = dict(num_proc=2, store=Store.create(str(root / "store")), model=Regression(), feature_cols=["features"],
                label_cols=["y"], batch_size=8, epochs=2, random_seed=3, verbose=0)
    args.update(kw)
    return LightningEstimator(**args)


def test_fit_transform_save_load_and_resume(df, tmp_path):
    model = _estimator(tmp_path, validation=0.25, run_id="a").fit(df)
    history = model.getHistory()
    assert [e["epoch"] for e in history] == [0, 1]
    assert all("train_loss" in e["train"] and "val_loss" in e["validation"] for e in history)
    out = [r.y__output for r in model.transform(df).select("y__output").collect()]
    assert len(out) == ROWS and all(np.isfinite(out))
    model.write().overwrite().save(str(tmp_path / "saved"))
    loaded = LightningModel.load(str(tmp_path / "saved"))
    assert [r.y__output for r in loaded.transform(df).select("y__output").collect()] == out
    assert loaded.getHistory() == history

    resumed = _estimator(tmp_path, validation=0.25, epochs=3, run_id="a").fit(df)  # Lightning's own ckpt_path
    assert [e["epoch"] for e in resumed.getHistory()] == [0, 1, 2]
    assert resumed.getHistory()[:2] == history


def test_a_forward_that_does_not_match_the_labels_fails_before_the_launch(df, tmp_path, rank_processes):
    with pytest.raises(ValueError, match=r"LightningEstimator.fit: the model's output for label 'y' has shape \(2,\) per "
                                         r"row \(2 values\), but the label has shape \(\) \(1 value\)"):
        _estimator(tmp_path, model=Regression(outputs=2)).fit(df)
    with pytest.raises(ValueError, match=r"a LightningModule brings its own optimizer \(configure_optimizers\) and "
                                         r"loss \(training_step\); drop optimizer= and loss="):
        _estimator(tmp_path, loss=torch.nn.functional.mse_loss).fit(df)
    assert rank_processes() == []
