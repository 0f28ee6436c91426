"""sparkhvd.ml's KerasEstimator on a real local Spark: fit on 2 ranks (with validation), transform on the executors,
save and load the model, resume a run from its checkpoint, and, with max_restarts, restart a fit whose rank was killed
mid-epoch from its last commit, ending with the weights and history of the resumed fit. TensorFlow's imports are slow:
the module fits once, the resume test fits once more, and the restart test once more (and relaunches once)."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys

import cloudpickle
import numpy as np
import pytest

pytest.importorskip("tensorflow")

from sparkhvd.ml import KerasEstimator, KerasModel, Store

RUN_ID = "keras_resume"
cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the ranks cannot import this file


def _frame(spark, rows=64):
    """One partition: transform then starts one Python worker, which imports TensorFlow once."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(rows, 3))
    y = x @ np.array([1.0, -2.0, 0.5]) + 0.3
    rows = [(i, [float(v) for v in x[i]], float(y[i])) for i in range(rows)]
    return spark.createDataFrame(rows, ["id", "x", "y"]).coalesce(1)


def _model(compiled=True):
    import keras

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, activation="tanh"), keras.layers.Dense(1)])
    if compiled:
        model.compile(optimizer="adam", loss="mse", metrics=["mae"])
    return model


def _estimator(store, model, epochs, **kwargs):
    import keras

    # the model's own loss and metrics stay; the given optimizer replaces its Adam
    args = dict(num_proc=2, store=store, model=model, optimizer=keras.optimizers.SGD(0.05), feature_cols=["x"],
                label_cols=["y"], validation=0.25, epochs=epochs, batch_size=8, run_id=RUN_ID, random_seed=1, verbose=0)
    return KerasEstimator(**{**args, **kwargs})


@pytest.fixture(scope="module")
def fitted(spark, tmp_path_factory):
    df = _frame(spark)
    store = Store.create(str(tmp_path_factory.mktemp("keras_store")))
    model = _model()
    return df, store, model, _estimator(store, model, epochs=2).fit(df)


def _predictions(df) -> list[float]:
    return [row["y__output"] for row in sorted(df.select("id", "y__output").collect())]


@pytest.fixture(scope="module")
def predicted(fitted) -> list[float]:
    df, _, _, model = fitted
    return _predictions(model.transform(df))


def test_importing_sparkhvd_ml_does_not_import_tensorflow():
    code = ("import sys; from sparkhvd.ml import KerasEstimator, KerasModel; "
            "assert not {'tensorflow', 'keras'} & set(sys.modules), sorted(m for m in sys.modules if 'keras' in m)")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_an_uncompiled_model_without_a_loss_is_refused_before_anything_launches(spark, tmp_path):
    estimator = KerasEstimator(num_proc=2, store=Store.create(str(tmp_path)), model=_model(compiled=False),
                               feature_cols=["x"], label_cols=["y"])
    with pytest.raises(ValueError, match=r"the model is not compiled and optimizer and loss are not given; compile it"):
        estimator.fit(_frame(spark, rows=4))


def test_a_model_whose_output_does_not_match_the_label_is_refused_on_the_driver(spark, tmp_path):
    import keras

    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(optimizer="sgd", loss="mse")
    estimator = KerasEstimator(num_proc=2, store=Store.create(str(tmp_path)), model=model, feature_cols=["x"],
                               label_cols=["y"])
    with pytest.raises(ValueError, match=r"output for label 'y' has shape \(2,\) per row \(2 values\), but the label "
                                         r"has shape \(\) \(1 value\)"):
        estimator.fit(_frame(spark, rows=4))
    assert not (tmp_path / "runs").exists()  # refused before the run's directory


def test_fit_trains_every_epoch_with_validation_averaged_over_the_ranks(fitted):
    _, _, _, model = fitted
    history = model.getHistory()
    assert [entry["epoch"] for entry in history] == [0, 1]
    for entry in history:
        assert set(entry["train"]) == {"loss", "mae"} and set(entry["validation"]) == {"loss", "mae"}
        assert all(math.isfinite(v) for v in (*entry["train"].values(), *entry["validation"].values()))
    assert history[1]["train"]["loss"] < history[0]["train"]["loss"]


def test_transform_predicts_on_the_executors_as_the_model_does_on_the_driver(fitted, predicted):
    df, _, _, model = fitted
    assert len(predicted) == 64 and all(isinstance(v, float) and math.isfinite(v) for v in predicted)
    x = np.asarray([row["x"] for row in sorted(df.collect())], dtype=np.float32)
    np.testing.assert_allclose(predicted, np.asarray(model.getModel()(x)).reshape(-1), rtol=1e-5, atol=1e-6)


def test_a_saved_model_loads_and_predicts_the_same(fitted, predicted, tmp_path):
    df, _, _, model = fitted
    path = str(tmp_path / "keras_model")
    model.write().overwrite().save(path)
    loaded = KerasModel.load(path)
    assert loaded.getHistory() == model.getHistory() and loaded.getRunId() == RUN_ID
    assert _predictions(loaded.transform(df)) == predicted


@pytest.fixture(scope="module")
def resumed(fitted):
    """The run fitted again with epochs=3: it trains the third epoch only."""
    df, store, user_model, _ = fitted
    return _estimator(store, user_model, epochs=3).fit(df)


def test_a_second_fit_with_the_run_id_trains_only_the_epochs_not_done(fitted, resumed):
    _, store, _, first = fitted
    second = resumed
    history = second.getHistory()
    assert [entry["epoch"] for entry in history] == [0, 1, 2]
    assert history[:2] == first.getHistory()  # read from the checkpoint of epoch 2, not trained again
    assert store.list_dir(store.get_checkpoint_path(RUN_ID)) == ["epoch-00001", "epoch-00002", "epoch-00003"]
    assert not np.array_equal(second.getModel().get_weights()[0], first.getModel().get_weights()[0])


def _killer(flag: str, epoch: int, step: int):
    """A callback: rank 0, once it has finished ``step`` (1-based) of ``epoch`` and its commits have reached the
    driver, is killed there (once, across restarts: the flag). A commit still on its way at a kill leaves the one
    before it in force (docs/elastic.md), so without the wait, a loaded machine restarted from an earlier commit.
    Every step a rank sees is written to ``<flag>.steps`` as ``pid epoch batch steps``."""
    import keras

    class KillOnce(keras.callbacks.Callback):
        def on_epoch_begin(self, index, logs=None):
            self.epoch = index

        def on_train_batch_end(self, batch, logs=None):
            with open(flag + ".steps", "a") as f:
                f.write(f"{os.getpid()} {self.epoch} {batch} {self.params['steps']}\n")
            import sparkhvd.collective.keras as hvd
            from sparkhvd._common import commits

            if self.epoch != epoch or batch + 1 != step or hvd.rank() != 0:
                return
            commits.flush(60)
            try:
                os.close(os.open(flag, os.O_CREAT | os.O_EXCL))
            except FileExistsError:
                return
            os.kill(os.getpid(), signal.SIGKILL)

    return KillOnce()


def test_a_rank_killed_mid_epoch_restarts_from_the_last_commit_and_ends_as_the_resumed_fit(fitted, resumed, tmp_path,
                                                                                          capsys):
    df, store, _, _ = fitted
    # 3 steps per epoch and rank (48 training rows, batches of 8), committed after step 2 and after each epoch: killed
    # after step 3 of epoch 3, the relaunched ranks train step 3 of epoch 3 again, from the commit of step 2
    flag = str(tmp_path / "killed")
    restarted = _estimator(store, _model(), epochs=3, run_id="keras_restarted", max_restarts=1, batches_per_commit=2,
                           callbacks=[_killer(flag, epoch=2, step=3)]).fit(df)
    assert os.path.exists(flag)
    assert "from the last commit (epoch=2 batch=2)" in capsys.readouterr().out  # the runner's line on the restart
    firsts = {}  # each rank process's first step (epoch, batch, steps per epoch), as the user's callback saw it
    for line in open(flag + ".steps"):
        pid, *step = line.split()
        firsts.setdefault(pid, tuple(map(int, step)))
    assert sorted(set(firsts.values())) == [(0, 0, 3), (2, 2, 3)]  # relaunched at step 3 of epoch 3, not at its start
    assert restarted.getHistory() == resumed.getHistory()  # the metrics of epoch 3 too: their sums were committed
    for a, b in zip(restarted.getModel().get_weights(), resumed.getModel().get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)


def _stop_after(epochs: int):
    """A callback that ends training after ``epochs`` epochs, as EarlyStopping does (``model.stop_training``)."""
    import keras

    class Stop(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            if epoch + 1 >= epochs:
                self.model.stop_training = True

    return Stop()


def test_a_callback_that_stops_training_ends_the_fit(fitted):
    df, store, _, _ = fitted
    stopped = _estimator(store, _model(), num_proc=-1, epochs=3, run_id=None,
                         callbacks=[_stop_after(1)]).fit(df)  # one process on the driver
    assert [entry["epoch"] for entry in stopped.getHistory()] == [0]
    # no run_id: only the last epoch's checkpoint is written, the one the callback's stop made the last
    assert store.list_dir(store.get_checkpoint_path(stopped.getRunId())) == ["epoch-00001"]
