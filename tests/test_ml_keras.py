"""sparkhvd.ml's KerasEstimator on a real local Spark: fit on 2 ranks (with validation), transform on the executors,
save and load the model, and resume a run from its checkpoint. TensorFlow's imports are slow: the module fits once,
and the resume test fits once more."""

from __future__ import annotations

import math
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("tensorflow")

from sparkhvd.ml import KerasEstimator, KerasModel, Store

RUN_ID = "keras_resume"


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
    return KerasEstimator(num_proc=2, store=store, model=model, optimizer=keras.optimizers.SGD(0.05),
                          feature_cols=["x"], label_cols=["y"], validation=0.25, epochs=epochs, batch_size=8,
                          run_id=RUN_ID, random_seed=1, verbose=0, **kwargs)


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


def test_a_second_fit_with_the_run_id_trains_only_the_epochs_not_done(fitted):
    df, store, user_model, first = fitted
    second = _estimator(store, user_model, epochs=3).fit(df)
    history = second.getHistory()
    assert [entry["epoch"] for entry in history] == [0, 1, 2]
    assert history[:2] == first.getHistory()  # read from the checkpoint of epoch 2, not trained again
    assert store.list_dir(store.get_checkpoint_path(RUN_ID)) == ["epoch-00001", "epoch-00002", "epoch-00003"]
    assert not np.array_equal(second.getModel().get_weights()[0], first.getModel().get_weights()[0])
