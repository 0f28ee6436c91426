"""TorchEstimator and TorchModel on a real local[2] Spark session, real ranks (np=2) and real Parquet:

- fit a DataFrame, transform it on the executors, save, load, transform again: identical predictions; the history
  has every epoch's training and validation loss;
- a rank killed mid-fit ends with the weights of an uninterrupted fit, bit for bit, whether the run restarts from
  its last commit or the failed fit is fitted again with its run_id (which trains only the epochs left and writes
  no Parquet);
- several labels, a tensor column with input_shapes, an ML vector label, integer class labels;
- a fitted Model never changes: a later fit with its run_id (a resume, trained further) leaves its predictions as
  they were, on an executor that had loaded it and on one that had not;
- a Pipeline with the estimator fits, saves and loads;
- every bad input fails before the barrier stage launches, with one sentence.
"""

from __future__ import annotations

import os
import signal
import sys

import cloudpickle
import numpy as np
import pytest
import torch

from sparkhvd.ml import Store, TorchEstimator, TorchModel
from sparkhvd.ml._checkpoints import RunDir
from sparkhvd.ml._torch import fingerprint
from sparkhvd.runner import HorovodRunError

ROWS = 96
cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the ranks and executors cannot import this file


def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


@pytest.fixture(scope="module")
def df(spark):
    from pyspark.ml.linalg import Vectors

    rng = np.random.default_rng(0)
    x = rng.normal(size=(ROWS, 3))
    y = x @ np.array([0.5, -1.0, 2.0]) + 0.1
    rows = [(Vectors.dense(x[i]), float(y[i]), [float(v) for v in x[i]], int(i % 3), bool(i % 4 == 0))
            for i in range(ROWS)]
    frame = spark.createDataFrame(rows, ["features", "y", "xs", "k", "held_out"])
    return frame.cache()


def _estimator(tmp_path, net=None, **kw):
    net = net or _net()
    args = dict(num_proc=2, store=Store.create(str(tmp_path / "store")), model=net,
                optimizer=torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9),
                loss=torch.nn.functional.mse_loss, feature_cols=["features"], label_cols=["y"], batch_size=10,
                epochs=2, random_seed=1, verbose=0)
    args.update(kw)
    return TorchEstimator(**args)


def _weights(model) -> list:
    return [t.detach().clone() for t in model.getModel().state_dict().values()]


def _same(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.fixture(scope="module")
def fitted(df, tmp_path_factory):
    root = tmp_path_factory.mktemp("fit")
    model = _estimator(root, validation="held_out", run_id="first").fit(df)  # a fraction: test_ml_lightning.py
    return root, model


def test_fit_transform_save_load_transform_again(df, fitted):
    root, model = fitted
    history = model.getHistory()  # validation: the rows of the column held_out
    assert [entry["epoch"] for entry in history] == [0, 1]
    assert all(set(entry) == {"epoch", "train", "validation"} and np.isfinite(entry["train"]["loss"])
               and np.isfinite(entry["validation"]["loss"]) for entry in history)
    assert history[1]["train"]["loss"] < history[0]["train"]["loss"]
    out = model.transform(df).select("y", "y__output").collect()
    assert len(out) == ROWS and all(isinstance(r.y__output, float) for r in out)
    # what the executors predicted is what the model computes here
    local = model.getModel()(torch.tensor(np.array([r.features.toArray() for r in df.select("features").collect()]),
                                          dtype=torch.float32)).detach().numpy().reshape(-1)
    np.testing.assert_allclose([r.y__output for r in out], local, rtol=1e-6)
    path = str(root / "saved")
    model.write().overwrite().save(path)
    model.write().overwrite().save(path)  # overwrite replaces
    with pytest.raises(FileExistsError, match=r"already exists; save with TorchModel.write\(\).overwrite\(\).save"):
        model.write().save(path)
    loaded = TorchModel.load(path)
    assert loaded.getHistory() == history and loaded.getRunId() == "first"
    again = loaded.transform(df).select("y__output").collect()
    assert [r.y__output for r in again] == [r.y__output for r in out]


@pytest.fixture(scope="module")
def uninterrupted(df, tmp_path_factory):
    """Four epochs in one fit: the weights and history every interrupted fit below must end with."""
    return _estimator(tmp_path_factory.mktemp("whole"), epochs=4, run_id="whole").fit(df)


def test_a_fit_that_nothing_can_resume_writes_its_last_epochs_checkpoint_only(df, tmp_path):
    # no run_id to fit again, no max_restarts to relaunch; one process on the driver
    model = _estimator(tmp_path, epochs=3, num_proc=-1).fit(df)
    checkpoints = tmp_path / "store" / "runs" / model.getRunId() / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["epoch-00003"]
    assert [e["epoch"] for e in model.getHistory()] == [0, 1, 2]  # the fitted model is that checkpoint's


def _killing_loss(flag: str, at_call: int):
    """mse_loss, but the rank whose call count reaches ``at_call`` first (once, across restarts) is killed."""
    calls = [0]

    def loss(output, label):
        calls[0] += 1
        if calls[0] == at_call and not os.path.exists(flag):
            open(flag, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
        return torch.nn.functional.mse_loss(output, label)

    return loss


def test_a_rank_killed_mid_fit_restarts_from_the_last_commit_with_the_weights_of_an_uninterrupted_fit(
        df, tmp_path, uninterrupted):
    # 5 steps per epoch and rank (48 rows, batches of 10), committed every 3; the loss ran once in the driver's dry run,
    # so call 10 is step 4 of epoch 1: killed there, the ranks resume from the commit of step 3
    est = _estimator(tmp_path, epochs=4, run_id="restarted", max_restarts=1, batches_per_commit=3,
                     loss=_killing_loss(str(tmp_path / "killed"), at_call=10))
    model = est.fit(df)
    assert os.path.exists(tmp_path / "killed")
    assert _same(_weights(model), _weights(uninterrupted))
    assert model.getHistory() == uninterrupted.getHistory()  # epoch 2's too: every rank's running sums were committed


def test_a_fit_killed_mid_run_and_fitted_again_trains_only_the_epochs_left_and_writes_no_parquet(
        df, tmp_path, uninterrupted):
    est = _estimator(tmp_path, epochs=4, run_id="killed", loss=_killing_loss(str(tmp_path / "killed"), at_call=10))
    with pytest.raises(HorovodRunError, match=r"killed by signal 9"):
        est.fit(df)
    checkpoints = tmp_path / "store" / "runs" / "killed" / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["epoch-00001"]  # epoch 2 was cut short
    marker = checkpoints / "epoch-00001" / "_COMPLETE.json"
    written, data = marker.stat().st_mtime_ns, sorted((tmp_path / "store" / "intermediate_train_data").iterdir())
    model = est.fit(df)  # the same run_id
    assert [e["epoch"] for e in model.getHistory()] == [0, 1, 2, 3]
    assert marker.stat().st_mtime_ns == written  # resumed from epoch 1's checkpoint: that epoch was not trained again
    assert sorted((tmp_path / "store" / "intermediate_train_data").iterdir()) == data  # the same DataFrame's Parquet
    assert _same(_weights(model), _weights(uninterrupted))
    assert model.getHistory() == uninterrupted.getHistory()


def test_a_fitted_model_predicts_the_same_after_a_later_fit_of_its_run_trains_further(df, tmp_path):
    est = _estimator(tmp_path, epochs=1, num_proc=-2, run_id="r1")
    first = est.fit(df)
    before = [r.y__output for r in first.transform(df).select("y__output").collect()]
    weights = _weights(first)
    second = est.setEpochs(2).fit(df)  # resumes the run: one more epoch, other weights
    assert [e["epoch"] for e in second.getHistory()] == [0, 1] and not _same(_weights(second), weights)
    assert [r.y__output for r in first.transform(df).select("y__output").collect()] == before
    assert [r.y__output for r in second.transform(df).select("y__output").collect()] != before
    # an executor that had not loaded the first model yet loads it from its file: still the first fit's weights
    spec = first._predict_spec()
    features = [np.array([r.features.toArray() for r in df.select("features").collect()], dtype=np.float32)]
    loaded = spec.load(spec.source, spec.blob, "cpu")(features)[0].reshape(-1)
    np.testing.assert_allclose(loaded, before, rtol=1e-6)  # one batch of every row, not the executors' chunks
    assert not np.allclose(loaded, second.getModel()(torch.from_numpy(features[0])).detach().numpy().reshape(-1))
    assert spec.source != second._predict_spec().source  # each fit's own file


class _TwoHeads(torch.nn.Module):
    """A tensor feature (2x3 per row) in, a vector (3 values) and a class score (3 classes) out."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Linear(6, 6)

    def forward(self, x):
        h = self.body(x.reshape(len(x), 6))
        return h[:, :3], h[:, 3:]


def test_several_labels_a_tensor_column_a_vector_label_and_class_indices(spark, df, tmp_path):
    from pyspark.sql import functions as F

    frame = df.select(F.array(F.col("xs"), F.col("xs")).alias("tensor"), F.col("features").alias("target"), "k")
    net = _TwoHeads()
    est = _estimator(tmp_path, net=net, feature_cols=["tensor"], label_cols=["target", "k"],
                     input_shapes=[[-1, 2, 3]], loss=[torch.nn.functional.mse_loss, torch.nn.functional.cross_entropy],
                     loss_weights=[1.0, 0.5], metrics=[_mean_abs], epochs=1)
    model = est.fit(frame)
    assert set(model.getHistory()[0]["train"]) == {"loss", "_mean_abs_target", "_mean_abs_k"}
    out = model.transform(frame).select("target__output", "k__output").collect()
    assert type(out[0].target__output).__name__ == "DenseVector" and len(out[0].target__output) == 3
    assert isinstance(out[0].k__output, list) and len(out[0].k__output) == 3  # the 3 class scores


def _mean_abs(output, label):
    return (output.float() - label.float().reshape(len(label), -1)[:, :1]).abs().mean()


def test_a_pipeline_with_the_estimator_fits_saves_and_loads(spark, df, tmp_path):
    from pyspark.ml import Pipeline, PipelineModel
    from pyspark.ml.feature import VectorAssembler

    frame = df.select(*_abc(), "y")
    pipeline = Pipeline(stages=[VectorAssembler(inputCols=["a", "b", "c"], outputCol="assembled"),
                                _estimator(tmp_path, feature_cols=["assembled"], epochs=1)])
    fitted = pipeline.fit(frame)
    out = [r.y__output for r in fitted.transform(frame).select("y__output").collect()]
    fitted.write().overwrite().save(str(tmp_path / "pipeline"))
    loaded = PipelineModel.load(str(tmp_path / "pipeline"))
    assert [r.y__output for r in loaded.transform(frame).select("y__output").collect()] == out
    pipeline.write().overwrite().save(str(tmp_path / "unfitted"))
    assert type(Pipeline.load(str(tmp_path / "unfitted")).getStages()[1]).__name__ == "TorchEstimator"


def _abc():
    """Three number columns a, b, c from the array column xs."""
    from pyspark.sql import functions as F

    return [F.col("xs")[i].alias(name) for i, name in enumerate("abc")]


# ---- bad input fails before the barrier stage launches ----

def _fails(est, frame, match, error=ValueError):
    with pytest.raises(error, match=match):
        est.fit(frame)


def test_bad_input_fails_before_launch_with_one_sentence(spark, df, tmp_path, rank_processes):
    from pyspark.sql import functions as F

    _fails(_estimator(tmp_path, feature_cols=["nope"]), df,
           r"TorchEstimator.fit: feature_cols names the column 'nope', which the DataFrame does not have; its columns "
           r"are \['features', 'held_out', 'k', 'xs', 'y'\]")
    _fails(_estimator(tmp_path), df.withColumn("y", F.lit("text")),
           r"the label_cols column 'y' has type string, which a model cannot take")
    _fails(_estimator(tmp_path), df.limit(0), r"TorchEstimator.fit: the DataFrame is empty: there is nothing to train on")
    _fails(_estimator(tmp_path, net=torch.nn.Linear(3, 2)), df,
           r"the model's output for label 'y' has shape \(2,\) per row \(2 values\), but the label has shape \(\) \(1 "
           r"value\); make the model's last layer match the label")
    _fails(_estimator(tmp_path, net=torch.nn.Linear(4, 1)), df,
           r"the model fails on the first row of the DataFrame \(inputs of shapes \[\(1, 3\)\] from feature_cols "
           r"\['features'\]\): RuntimeError")
    _fails(_estimator(tmp_path, label_cols=["y", "k"]), df,
           r"the model returns 1 output\(s\), but label_cols has 2 column\(s\) \['y', 'k'\]")
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    _fails(_estimator(tmp_path, store=Store.create(str(blocker / "store"))), df,
           r"The store '.*a-file/store' cannot be written", OSError)
    RunDir(Store.create(str(tmp_path / "store")), "taken").claim(fingerprint(_net()))  # as a fit of _net() does
    _fails(_estimator(tmp_path, run_id="taken", net=torch.nn.Sequential(torch.nn.Linear(3, 1))), df,
           r"run_id='taken' in the store .* holds checkpoints of another model")
    _fails(_estimator(tmp_path, validation=1.5), df, r"validation=1.5 must be a fraction in \[0, 1\) or a column name")
    _fails(_estimator(tmp_path, batch_size=0), df, r"batch_size must be a positive int, got 0")
    _fails(_estimator(tmp_path, feature_cols=["y"]), df, r"\['y'\] are both feature and label columns")
    _fails(_estimator(tmp_path, optimizer=torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=1)), df,
           r"the optimizer holds none of the model's parameters")
    _fails(_estimator(tmp_path, store="/tmp/x"), df, r"store must be a sparkhvd.ml.Store, got '/tmp/x'")
    with pytest.raises(TypeError, match=r"TorchEstimator got unknown parameter\(s\) \['lr'\]; its parameters are: "):
        _estimator(tmp_path, lr=0.1)
    assert rank_processes() == []


def test_fit_on_parquet(spark, df, tmp_path):
    path = str(tmp_path / "parquet")
    df.select("xs", "y").write.parquet(path)
    model = _estimator(tmp_path, feature_cols=["xs"], epochs=1, num_proc=-1).fit_on_parquet(path)
    assert len(model.transform(df).select("y__output").collect()) == ROWS
    df.select("features", "y").write.parquet(str(tmp_path / "vectors"))
    with pytest.raises(ValueError, match=r"the column 'features' is vector, which the readers cannot take from Parquet"):
        _estimator(tmp_path, epochs=1).fit_on_parquet(str(tmp_path / "vectors"))


def test_inside_an_active_mlflow_run_the_fitted_model_is_logged(df, tmp_path, monkeypatch):
    mlflow = pytest.importorskip("mlflow")
    import mlflow.pytorch  # noqa: F811 - the submodule, on the module importorskip gave

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # mlflow 3 keeps the file store behind this switch
    mlflow.set_tracking_uri(f"file://{tmp_path}/mlruns")
    try:
        with mlflow.start_run() as run:
            model = _estimator(tmp_path, epochs=1, num_proc=-1).fit(df)
        logged = mlflow.pytorch.load_model(f"runs:/{run.info.run_id}/model")
    finally:
        mlflow.set_tracking_uri(None)
    assert _same([t.detach() for t in logged.state_dict().values()], _weights(model))


def test_a_dataframe_of_a_plan_sampled_before_is_sampled_again_without_a_spark_job(spark, df):
    from sparkhvd.ml import _estimator

    tracker = spark.sparkContext.statusTracker()

    def jobs_of(group: str, call):
        spark.sparkContext.setJobGroup(group, "a sample")
        try:
            return call(), tracker.getJobIdsForGroup(group)
        finally:
            spark.sparkContext.setJobGroup(None, None)

    # plans no fit of this module samples (a fit selects its feature and label columns, never held_out)
    first, first_jobs = jobs_of("sample-first", lambda: _estimator.first_row(df.select("held_out", "xs")))
    again, again_jobs = jobs_of("sample-again", lambda: _estimator.first_row(df.select("held_out", "xs")))  # a new
    other, other_jobs = jobs_of("sample-other", lambda: _estimator.first_row(df.select("k", "held_out")))  # DataFrame
    assert len(first_jobs) == 1 and again_jobs == [] and len(other_jobs) == 1
    assert again == first and set(other.asDict()) == {"k", "held_out"}
    assert _estimator.first_row(df.select("y").filter("y > 1e9")) is None  # no rows: nothing kept, a job each time
