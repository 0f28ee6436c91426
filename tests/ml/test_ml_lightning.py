"""LightningEstimator on a real local[2] Spark session: Lightning's own DDP on 2 ranks, fed by the sharded readers.

- fit (with validation), transform, save, load, transform again: identical predictions, and the history has each
  epoch's logged training and validation loss;
- a fit resumed by run_id (Lightning's own ckpt_path) trains only the epoch left;
- with max_restarts, a rank killed mid-epoch restarts from the last commit (Lightning's checkpoint, mid-epoch, with
  the training loader's place in it) and ends with the weights of that fit of 2 epochs resumed for a third, bit for bit;
- a module whose forward does not match the labels fails before the launch.
"""

from __future__ import annotations

import os
import signal
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


class KilledOnce(Regression):
    """Regression, but the first rank to reach global step ``at`` (once, across restarts: the flag) is killed there.
    Every step is written to ``<flag>.steps`` as ``pid global_step``."""

    def __init__(self, flag: str, at: int):
        super().__init__()
        self.flag, self.at = flag, at

    def training_step(self, batch, index):
        with open(self.flag + ".steps", "a") as f:
            f.write(f"{os.getpid()} {self.trainer.global_step}\n")
        if self.trainer.global_step == self.at:
            from sparkhvd._common import commits

            commits.flush(60)  # rank 0's commit before this step has reached the driver: it is the one resumed
            self.trainer.strategy.barrier()  # (a loaded machine's rank 0 sent it after the other rank was killed)
            try:
                os.close(os.open(self.flag, os.O_CREAT | os.O_EXCL))
            except FileExistsError:
                pass
            else:
                os.kill(os.getpid(), signal.SIGKILL)
        return super().training_step(batch, index)


def _estimator(root, **kw):
    args = dict(num_proc=2, store=Store.create(str(root / "store")), model=Regression(), feature_cols=["features"],
                label_cols=["y"], batch_size=8, epochs=2, random_seed=3, verbose=0)
    args.update(kw)
    return LightningEstimator(**args)


def test_fit_transform_save_load_resume_and_restart(df, tmp_path, capsys):
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

    # 3 steps per epoch and rank (48 training rows, batches of 8), committed after step 2 of each epoch and after each
    # epoch: killed before global step 6 (step 3 of epoch 2), the relaunched ranks resume from step 2 of epoch 2
    flag = tmp_path / "killed"
    restarted = _estimator(tmp_path, validation=0.25, epochs=3, run_id="b", max_restarts=1, batches_per_commit=2,
                           model=KilledOnce(str(flag), at=5)).fit(df)
    assert flag.exists()
    assert "from the last commit (epoch=1 batch=2)" in capsys.readouterr().out  # the runner's line on the restart
    firsts = {}  # each rank process's first global step
    for line in open(f"{flag}.steps"):
        pid, step = line.split()
        firsts.setdefault(pid, int(step))
    assert sorted(set(firsts.values())) == [0, 5]  # relaunched at step 3 of epoch 2, not at its start (step 3)
    assert [e["epoch"] for e in restarted.getHistory()] == [0, 1, 2]
    assert all(torch.equal(a, b) for a, b in zip(restarted.getModel().state_dict().values(),
                                                 resumed.getModel().state_dict().values(), strict=True))


def test_a_forward_that_does_not_match_the_labels_fails_before_the_launch(df, tmp_path, rank_processes):
    with pytest.raises(ValueError, match=r"LightningEstimator.fit: the model's output for label 'y' has shape \(2,\) per "
                                         r"row \(2 values\), but the label has shape \(\) \(1 value\)"):
        _estimator(tmp_path, model=Regression(outputs=2)).fit(df)
    with pytest.raises(ValueError, match=r"a LightningModule brings its own optimizer \(configure_optimizers\) and "
                                         r"loss \(training_step\); drop optimizer= and loss="):
        _estimator(tmp_path, loss=torch.nn.functional.mse_loss).fit(df)
    assert rank_processes() == []
