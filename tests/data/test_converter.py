"""make_spark_converter with a real local SparkSession."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow


# `spark`: the shared local[2] session from tests/conftest.py.


def test_converter_round_trip_with_two_shards(spark, tmp_path):
    import torch

    from sparkhvd.data import make_spark_converter

    df = spark.range(0, 103, numPartitions=3).selectExpr("id", "array(cast(id as double), cast(id as double) + 0.5) as vec", "cast(id as double) as x")
    converter = make_spark_converter(df, parent_cache_dir_url=tmp_path.as_uri())
    assert len(converter) == 103 and converter.file_urls and all(u.startswith("file:///") for u in converter.file_urls)
    shards = []
    for k in range(2):
        with converter.make_torch_dataloader(batch_size=10, num_epochs=1, cur_shard=k, shard_count=2) as loader:
            shards.append(list(loader))
    assert len(shards[0]) == len(shards[1]) == 6  # 52 and 51 rows: m = 51 -> 6 batches each
    batch = shards[0][0]
    assert batch["vec"].dtype == torch.float32 and batch["vec"].shape == (10, 2) and batch["x"].dtype == torch.float32
    assert torch.equal(batch["vec"][:, 1], batch["id"].float() + 0.5)
    assert sorted(int(i) for s in shards for b in s for i in b["id"]) == list(range(103))
    converter.delete()
    assert not list(tmp_path.iterdir())


def test_converter_needs_a_cache_dir_url(spark, tmp_path):
    from sparkhvd.data import make_spark_converter

    df = spark.range(3)
    with pytest.raises(ValueError, match=r"make_spark_converter needs a cache directory: pass parent_cache_dir_url=.* or set the Spark conf sparkhvd.data.parentCacheDirUrl"):
        make_spark_converter(df)
    with pytest.raises(ValueError, match=r"parent_cache_dir_url='/tmp/x' is not a URL; use e.g. 'file:///tmp/x'"):
        make_spark_converter(df, parent_cache_dir_url="/tmp/x")
    with pytest.raises(ValueError, match=r"dtype must be 'float32', 'float64' or None, got 'int8'"):
        make_spark_converter(df, parent_cache_dir_url=tmp_path.as_uri(), dtype="int8")


@pytest.mark.timeout(180)
def test_each_rank_reads_its_shard_under_horovod_runner(spark, tmp_path):
    from sparkhvd import HorovodRunner
    from sparkhvd.data import make_spark_converter

    df = spark.range(0, 103, numPartitions=3).selectExpr("id", "cast(id as double) * 2 as x")
    converter = make_spark_converter(df, parent_cache_dir_url=tmp_path.as_uri())

    def train():
        import sparkhvd.collective.torch as hvd

        hvd.init()  # cur_shard/shard_count default to rank/size
        ids, steps = [], 0
        with converter.make_torch_dataloader(batch_size=10, num_epochs=1) as loader:
            for batch in loader:
                ids += batch["id"].tolist()
                steps += 1
        return {"ids": ids, "steps": steps}

    values = HorovodRunner(np=2).run_all(train).values
    all_ids = values[0]["ids"] + values[1]["ids"]
    assert sorted(all_ids) == list(range(103))  # every row exactly once
    assert values[0]["steps"] == values[1]["steps"] == 6  # 52 and 51 rows -> 6 batches each
    converter.delete()
