"""``TorchDistributor._train_on_dataframe(fn, df)``, which ``pyspark.ml.connect``'s estimators call: a barrier task
per partition, each process reading its own partition's rows through pyspark's own
``_get_spark_partition_data_loader``, on a real local Spark session."""

from __future__ import annotations

import re

import pytest

from sparkhvd import TorchDistributor

ROWS = 40


def _rows_seen(num_samples: int):
    """Every process's partition ids and x values, as pyspark's loader gives them, gathered to rank 0."""
    import torch.distributed as dist
    from pyspark.ml.torch.distributor import _get_spark_partition_data_loader

    dist.init_process_group("gloo")
    seen = {"p": set(), "x": []}
    for x, p in _get_spark_partition_data_loader(num_samples, batch_size=5, num_workers=0):
        seen["p"].update(int(v) for v in p)
        seen["x"] += [float(v) for v in x]
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, {"rank": dist.get_rank(), **seen})
    dist.destroy_process_group()
    return everyone


@pytest.fixture
def frame(spark):
    from pyspark.sql import functions as F

    df = spark.range(ROWS).repartition(2)
    return df.select(F.col("id").cast("double").alias("x"), F.spark_partition_id().cast("int").alias("p"))


@pytest.mark.timeout(180)
def test_each_process_reads_its_own_partition_as_pysparks_loader_gives_it(frame):
    everyone = TorchDistributor(num_processes=2, local_mode=False, use_gpu=False)._train_on_dataframe(
        _rows_seen, frame, num_samples=ROWS // 2)
    assert [e["rank"] for e in everyone] == [0, 1]
    assert [e["p"] for e in everyone] == [{0}, {1}]  # task i, and so rank i here, on partition i
    assert sorted(x for e in everyone for x in e["x"]) == [float(i) for i in range(ROWS)]  # every row once


def test_local_mode_and_a_partition_count_other_than_the_tasks_are_refused(frame):
    with pytest.raises(ValueError, match=r"^TorchDistributor\.train_on_dataframe requires setting "
                                         r"TorchDistributor\.local_mode to False\.$"):
        TorchDistributor(num_processes=2, local_mode=True, use_gpu=False)._train_on_dataframe(_rows_seen, frame)
    with pytest.raises(ValueError, match=re.escape(
            "The DataFrame has 2 partitions, but TorchDistributor(num_processes=3) runs 3 Spark tasks, each training "
            "on one partition; pass spark_dataframe.repartition(3).")):
        TorchDistributor(num_processes=3, local_mode=False, use_gpu=False)._train_on_dataframe(_rows_seen, frame)


@pytest.mark.timeout(240)
def test_pyspark_ml_connects_logistic_regression_fits_on_the_drop_in(spark, monkeypatch):
    """pyspark.ml.connect's LogisticRegression trains through TorchDistributor._train_on_dataframe; with sparkhvd's
    drop-in in its place it fits a separable set."""
    classification = pytest.importorskip("pyspark.ml.connect.classification")
    from pyspark.sql import functions as F

    monkeypatch.setattr(classification, "TorchDistributor", TorchDistributor)
    df = spark.range(64).select(F.array((F.col("id") % 2 * 4 - 2).cast("float"), F.lit(1.0).cast("float"))
                                .alias("features"), (F.col("id") % 2).cast("int").alias("label"))
    model = classification.LogisticRegression(numTrainWorkers=2, batchSize=8, maxIter=20, learningRate=0.5).fit(df)
    predicted = model.transform(df).select("label", "prediction").collect()
    assert all(int(r["prediction"]) == r["label"] for r in predicted)


@pytest.mark.timeout(180)
def test_an_empty_partition_fails_with_pysparks_sentence_the_partition_and_the_fix(spark):
    from sparkhvd import HorovodRunError

    one_row = spark.range(1).repartition(2).selectExpr("CAST(id AS DOUBLE) AS x", "CAST(id AS INT) AS p")
    with pytest.raises(HorovodRunError, match=r"Empty Spark partition is not allowed in "
                                              r"TorchDistributor\.train_on_dataframe: partition [01] has no rows; "
                                              r"repartition the DataFrame so that every one of its partitions has "
                                              r"rows"):
        TorchDistributor(num_processes=2, local_mode=False, use_gpu=False)._train_on_dataframe(
            _rows_seen, one_row, num_samples=1)
