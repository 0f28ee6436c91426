"""make_spark_converter with a real local SparkSession: round trip, cache reuse, conf keys, row groups."""

from __future__ import annotations

import threading
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from sparkhvd.data._converter import DEFAULT_ROW_GROUP_BYTES, MIN_ROW_GROUP_BYTES, choose_row_group_bytes

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
    with pytest.raises(ValueError, match=r"make_spark_converter needs a cache directory: pass parent_cache_dir_url=.* or set the Spark conf sparkhvd.data.parentCacheDirUrl \(or Petastorm's petastorm.spark.converter.parentCacheDirUrl\)"):
        make_spark_converter(df)
    with pytest.raises(ValueError, match=r"parent_cache_dir_url='/tmp/x' is not a URL; use e.g. 'file:///tmp/x'"):
        make_spark_converter(df, parent_cache_dir_url="/tmp/x")
    with pytest.raises(ValueError, match=r"dtype must be 'float32', 'float64' or None, got 'int8'"):
        make_spark_converter(df, parent_cache_dir_url=tmp_path.as_uri(), dtype="int8")
    with pytest.raises(ValueError, match=r"parquet_row_group_size_bytes must be a positive int, got 0; the default is 33554432 \(32 MiB\)"):
        make_spark_converter(df, parent_cache_dir_url=tmp_path.as_uri(), parquet_row_group_size_bytes=0)


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


def _frame(spark, n=103, extra="0"):
    # Built afresh on each call, as a notebook cell would: equal plans, distinct DataFrame objects.
    return spark.range(0, n, numPartitions=2).selectExpr("id", f"cast(id as double) + {extra} as x")


def _dirs(path):
    return sorted(p.name for p in path.iterdir())


def _part_mtimes(url):
    return {p.name: p.stat().st_mtime_ns for p in Path(url.removeprefix("file://")).iterdir()}


def test_same_plan_reuses_the_directory_and_another_plan_does_not(spark, tmp_path):
    from sparkhvd.data import make_spark_converter

    parent = tmp_path.as_uri()
    first = make_spark_converter(_frame(spark), parent_cache_dir_url=parent)
    written = _part_mtimes(first.cache_dir_url)
    again = make_spark_converter(_frame(spark), parent_cache_dir_url=parent)
    assert again.cache_dir_url == first.cache_dir_url and len(again) == 103
    assert _part_mtimes(first.cache_dir_url) == written  # not written a second time
    assert len(_dirs(tmp_path)) == 1
    other_plan = make_spark_converter(_frame(spark, extra="1"), parent_cache_dir_url=parent)
    other_dtype = make_spark_converter(_frame(spark), parent_cache_dir_url=parent, dtype=None)
    assert len({first.cache_dir_url, other_plan.cache_dir_url, other_dtype.cache_dir_url}) == 3
    assert len(_dirs(tmp_path)) == 3
    for converter in (first, other_plan, other_dtype):
        converter.delete()


def test_an_incomplete_directory_is_not_reused(spark, tmp_path):
    from sparkhvd.data import make_spark_converter

    first = make_spark_converter(_frame(spark), parent_cache_dir_url=tmp_path.as_uri())
    root = tmp_path / first.cache_dir_url.rsplit("/", 1)[1]
    (root / "_sparkhvd.json").unlink()  # as if the write had stopped before the marker
    second = make_spark_converter(_frame(spark), parent_cache_dir_url=tmp_path.as_uri())
    assert second.cache_dir_url != first.cache_dir_url
    part = next((tmp_path / second.cache_dir_url.rsplit("/", 1)[1]).glob("part-*.parquet"))
    part.unlink()  # marker present, a data file gone
    third = make_spark_converter(_frame(spark), parent_cache_dir_url=tmp_path.as_uri())
    assert third.cache_dir_url not in (first.cache_dir_url, second.cache_dir_url) and len(third) == 103
    third.delete()


def test_delete_removes_the_directory_and_forgets_it(spark, tmp_path):
    from sparkhvd.data import make_spark_converter

    first = make_spark_converter(_frame(spark), parent_cache_dir_url=tmp_path.as_uri())
    first.delete()
    assert _dirs(tmp_path) == []
    second = make_spark_converter(_frame(spark), parent_cache_dir_url=tmp_path.as_uri())
    assert second.cache_dir_url != first.cache_dir_url and len(second) == 103
    with second.make_torch_dataloader(batch_size=None, num_epochs=1, cur_shard=0, shard_count=1) as loader:
        assert sorted(int(i) for b in loader for i in b["id"]) == list(range(103))
    second.delete()


def test_concurrent_calls_on_one_plan_write_once(spark, tmp_path):
    from sparkhvd.data import make_spark_converter

    urls, errors = [], []

    def convert():
        try:
            urls.append(make_spark_converter(_frame(spark), parent_cache_dir_url=tmp_path.as_uri()).cache_dir_url)
        except Exception as exc:  # noqa: BLE001 - surfaced by the assert below
            errors.append(exc)

    threads = [threading.Thread(target=convert) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(urls) == 2 and urls[0] == urls[1]
    assert len(_dirs(tmp_path)) == 1


@pytest.mark.parametrize("key", ["sparkhvd.data.parentCacheDirUrl", "petastorm.spark.converter.parentCacheDirUrl"])
def test_the_cache_dir_comes_from_the_spark_conf(spark, tmp_path, key):
    from sparkhvd.data import make_spark_converter

    spark.conf.set(key, tmp_path.as_uri())
    try:
        converter = make_spark_converter(_frame(spark, n=10))
    finally:
        spark.conf.unset(key)
    assert converter.cache_dir_url.startswith(tmp_path.as_uri() + "/sparkhvd-") and len(converter) == 10
    converter.delete()


@pytest.mark.unit
def test_row_group_rule():
    mib = 1024 * 1024
    assert choose_row_group_bytes(None, DEFAULT_ROW_GROUP_BYTES) == DEFAULT_ROW_GROUP_BYTES  # size unknown: the cap
    assert choose_row_group_bytes(64 * 1024 * mib, DEFAULT_ROW_GROUP_BYTES) == DEFAULT_ROW_GROUP_BYTES  # 64 GiB: the cap
    assert choose_row_group_bytes(640 * mib, DEFAULT_ROW_GROUP_BYTES) == 10 * mib  # 64 row groups
    assert choose_row_group_bytes(10 * mib, DEFAULT_ROW_GROUP_BYTES) == MIN_ROW_GROUP_BYTES  # floor
    assert choose_row_group_bytes(10 * mib, 4096) == 4096  # a cap below the floor wins


def _row_groups(converter):
    return [pq.ParquetFile(url.removeprefix("file://")).num_row_groups for url in converter.file_urls]


def test_converter_files_have_several_row_groups(spark, tmp_path):
    from sparkhvd.data import make_spark_converter

    df = spark.range(0, 4000, numPartitions=2).selectExpr("id", "array(cast(id as double), cast(id as double)) as vec")
    small = make_spark_converter(df, parent_cache_dir_url=tmp_path.as_uri(), parquet_row_group_size_bytes=16 * 1024)
    assert len(_row_groups(small)) == 2 and min(_row_groups(small)) > 1
    shards = []
    for k in range(3):
        with small.make_torch_dataloader(batch_size=None, num_epochs=1, cur_shard=k, shard_count=3) as loader:
            shards.append([int(i) for b in loader for i in b["id"]])
    assert [len(s) for s in shards] == [1334, 1333, 1333] and sorted(sum(shards, [])) == list(range(4000))
    small.delete()
    # The default cap (32 MiB) would make one row group per file; the rule aims at 64 of 1 MiB or more.
    big = make_spark_converter(spark.range(0, 400_000, numPartitions=1).selectExpr("id", "cast(id as double) as x"), parent_cache_dir_url=tmp_path.as_uri(), dtype=None)
    assert _row_groups(big)[0] > 1
    big.delete()


def test_converter_torch_dataloader_reads_afresh_on_each_iteration(spark, tmp_path):
    from sparkhvd.data import make_spark_converter

    converter = make_spark_converter(_frame(spark), parent_cache_dir_url=tmp_path.as_uri())
    with converter.make_torch_dataloader(batch_size=10, num_epochs=1, cur_shard=0, shard_count=1) as loader:
        passes = [[int(i) for b in loader for i in b["id"]] for _ in range(2)]  # for epoch in range(2): for batch in loader
    assert sorted(passes[0]) == sorted(passes[1]) == list(range(103))
    converter.delete()


def test_delete_waits_for_the_slot_lock(spark, tmp_path):
    from sparkhvd.data import _cache, make_spark_converter

    df = _frame(spark)
    converter = make_spark_converter(df, parent_cache_dir_url=tmp_path.as_uri())
    (slot,) = [slot for slot in _cache._slots if slot.url == converter.cache_dir_url]
    root = tmp_path / converter.cache_dir_url.rsplit("/", 1)[1]
    with slot.lock:  # as make_spark_converter holds it while it checks and hands out the directory
        deleter = threading.Thread(target=converter.delete)
        deleter.start()
        deleter.join(0.5)
        assert deleter.is_alive() and root.is_dir()  # delete() waits for the lock
    deleter.join(30)
    assert not deleter.is_alive() and not root.exists()
    assert all(slot.url != converter.cache_dir_url for slot in _cache._slots)  # forgotten


def test_a_failed_write_leaves_no_directory(spark, tmp_path):
    from sparkhvd.data import _cache, make_spark_converter

    # Rows 60.. fail inside the write's tasks (one partition writes, the other fails), as a bad UDF would.
    failing = spark.range(0, 103, numPartitions=2).selectExpr("id", "if(id >= 60, raise_error('bad row'), cast(id as double)) as x")
    with pytest.raises(Exception, match=r"bad row"):
        make_spark_converter(failing, parent_cache_dir_url=tmp_path.as_uri())
    assert _dirs(tmp_path) == []
    assert not any(slot.df is failing for slot in _cache._slots)  # nor a cache entry holding the DataFrame
    good = make_spark_converter(_frame(spark), parent_cache_dir_url=tmp_path.as_uri())  # the parent is still usable
    assert len(good) == 103 and len(_dirs(tmp_path)) == 1
    good.delete()


def test_slots_of_a_live_session_are_kept(spark, tmp_path):
    from sparkhvd.data import _cache, make_spark_converter

    assert not _cache.session_stopped(spark)
    converter = make_spark_converter(_frame(spark), parent_cache_dir_url=tmp_path.as_uri())
    again = make_spark_converter(_frame(spark), parent_cache_dir_url=tmp_path.as_uri())  # scans, and prunes
    assert again.cache_dir_url == converter.cache_dir_url and len(_cache.slots_with_url(converter.cache_dir_url)) == 1
    converter.delete()


_STOPPED_SESSION_SCRIPT = r"""
import sys, weakref
from pyspark.sql import SparkSession
from sparkhvd.data import _cache, make_spark_converter

parent = sys.argv[1]

def session():
    return (SparkSession.builder.master("local[1]").config("spark.ui.enabled", "false")
            .config("spark.ui.showConsoleProgress", "false").getOrCreate())

old = session()
old.sparkContext.setLogLevel("ERROR")
first = make_spark_converter(old.range(10), parent_cache_dir_url=parent)
assert len(_cache._slots) == 1
old.stop()
new = session()
assert new is not old
second = make_spark_converter(new.range(10), parent_cache_dir_url=parent)
assert second.cache_dir_url != first.cache_dir_url  # no reuse across sessions
assert len(_cache._slots) == 1, _cache._slots  # the stopped session's slot was dropped
assert all(slot.df.sparkSession is new for slot in _cache._slots)
old_ref = weakref.ref(old)
del old
import gc; gc.collect()
assert old_ref() is None, "the stopped session is still referenced"
new.stop()
print("ok")
"""


@pytest.mark.timeout(240)
def test_slots_of_a_stopped_session_are_dropped(tmp_path):
    # The shared session cannot be stopped, and one process holds one SparkContext at a time:
    # a separate process starts a session, stops it, and starts another, as a notebook user might.
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-c", _STOPPED_SESSION_SCRIPT, tmp_path.as_uri()],
                            capture_output=True, text=True, timeout=220)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]


# ---- Petastorm's converter behaviour ---------------------------------------------------------------------------


def test_petastorms_conf_name_and_dtype_float64_widen_float32_columns(spark, tmp_path):
    from sparkhvd.data import SparkDatasetConverter, make_spark_converter

    assert SparkDatasetConverter.PARENT_CACHE_DIR_URL_CONF == "petastorm.spark.converter.parentCacheDirUrl"
    df = spark.range(6).selectExpr("id", "cast(id as float) as f", "array(cast(id as float)) as fs", "cast(id as double) as d")
    wide = make_spark_converter(df, parent_cache_dir_url=tmp_path.as_uri(), dtype="float64")
    kept = make_spark_converter(df, parent_cache_dir_url=tmp_path.as_uri(), dtype=None)
    try:
        types = {f.name: str(f.type) for f in pq.read_schema(wide.file_urls[0][len("file://"):])}
        assert types == {"id": "int64", "f": "double", "fs": "list<element: double>", "d": "double"}
        types = {f.name: str(f.type) for f in pq.read_schema(kept.file_urls[0][len("file://"):])}
        assert types == {"id": "int64", "f": "float", "fs": "list<element: float not null>", "d": "double"}
    finally:
        wide.delete()
        kept.delete()


@pytest.mark.parametrize("form", ["file:{}", "{}", "file://{}"])
def test_a_saved_parquet_path_is_read_in_place_and_never_deleted(spark, tmp_path, form):
    from sparkhvd.data import make_spark_converter

    saved = tmp_path / "saved"
    spark.range(0, 41, numPartitions=2).selectExpr("id", "cast(id as double) as x").write.parquet(str(saved))
    before = sorted(p.name for p in saved.iterdir())
    converter = make_spark_converter(form.format(saved))
    assert len(converter) == 41 and converter.cache_dir_url == f"file://{saved}"
    with converter.make_torch_dataloader(batch_size=8, num_epochs=1) as loader:
        assert sorted(int(i) for batch in loader for i in batch["id"]) == list(range(41))
    converter.delete()
    assert sorted(p.name for p in saved.iterdir()) == before  # the user's files, untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["saved"]  # nothing written beside them


def test_written_directories_are_deleted_when_the_process_exits(spark, tmp_path):
    import subprocess
    import sys

    from sparkhvd.data import _converter, make_spark_converter

    converter = make_spark_converter(_frame(spark, n=5), parent_cache_dir_url=tmp_path.as_uri())
    assert converter.cache_dir_url in _converter._written  # what the exit hook deletes
    converter.delete()
    assert converter.cache_dir_url not in _converter._written
    # The hook itself, at a real interpreter exit (no Spark needed to register a directory with it):
    left = tmp_path / "left"
    left.mkdir()
    (left / "part-0.parquet").write_bytes(b"x")
    code = f"import sparkhvd.data._converter as c; c._written.add({left.as_uri()!r})"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    assert not left.exists()


@pytest.mark.parametrize("parent", ["s3://sparkhvd-test/cache", "s3a://sparkhvd-test/cache"])
def test_a_cache_spark_cannot_write_is_refused_with_what_to_install(spark, parent):
    from sparkhvd.data import make_spark_converter

    scheme = parent.split(":")[0]
    with pytest.raises(ValueError, match=rf"Spark cannot write the converter's cache under parent_cache_dir_url="
                                         rf"'{parent}': its Hadoop [\d.]+ has no filesystem for {scheme}:// \(.*"
                                         rf"{scheme}.*\)\. To write there, the pip release of pyspark lacks Hadoop's "
                                         r"S3 connector: start Spark with spark.jars.packages=org.apache.hadoop:"
                                         r"hadoop-aws:[\d.]+ and use an s3a:// URL; or use a directory every worker"):
        make_spark_converter(spark.range(3), parent_cache_dir_url=parent)


@pytest.mark.unit
def test_at_exit_a_cache_directory_already_gone_is_no_complaint(tmp_path, capsys):
    from sparkhvd.data import _converter

    left, gone = tmp_path / "left", tmp_path / "gone"  # gone: its parent was deleted first (a temp folder)
    left.mkdir()
    (left / "part-0.parquet").write_bytes(b"x")
    _converter._written.update({left.as_uri(), gone.as_uri()})
    _converter._delete_written()
    assert not left.exists() and capsys.readouterr().err == ""
    assert not {left.as_uri(), gone.as_uri()} & _converter._written
