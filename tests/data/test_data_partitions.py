"""Hive-partitioned datasets (``key=value/`` folders) and Petastorm's ``schema_fields`` patterns, on real files.

The Spark test writes with ``df.write.partitionBy`` and checks that the partition columns come back with the values
and the types ``spark.read.parquet`` gives them; the others write the folders with pyarrow.
"""

from __future__ import annotations

import datetime
from collections import Counter

import numpy as np
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest

from sparkhvd.data import SchemaError, make_batch_reader, make_reader

# Spark's type names -> the Arrow type sparkhvd must give the column
SPARK_TO_ARROW = {"IntegerType()": pa.int32(), "LongType()": pa.int64(), "DoubleType()": pa.float64(),
                  "DateType()": pa.date32(), "StringType()": pa.string()}


def _write(root, folders: dict, rows: int = 4) -> None:
    """One file per ``{relative folder: first id}``, ``rows`` rows each, columns ``id`` and ``x``."""
    for folder, first in folders.items():
        (root / folder).mkdir(parents=True, exist_ok=True)
        ids = np.arange(first, first + rows, dtype=np.int64)
        pq.write_table(pa.table({"id": ids, "x": ids * 0.5}), root / folder / "part-0.parquet")


def _rows(reader) -> list[dict]:
    """Every row a reader yields, as dicts, sorted by id."""
    out = []
    with reader:
        for batch in reader:
            out.extend(dict(zip(batch._fields, values)) for values in zip(*(col.tolist() for col in batch)))
    return sorted(out, key=lambda row: row["id"])


def test_spark_partition_by_folders_come_back_as_the_columns_spark_reads(spark, tmp_path):
    from pyspark.sql import functions as F

    path = str(tmp_path / "by_key")
    frame = (spark.range(60).withColumn("small", (F.col("id") % 3).cast("int"))
             .withColumn("big", F.col("id") % 2 + 5_000_000_000).withColumn("ratio", (F.col("id") % 2) / 4)
             .withColumn("day", F.expr("date_add(date'2024-02-28', cast(id % 2 as int))"))
             .withColumn("name", F.when(F.col("id") % 4 == 0, None).otherwise(F.expr("concat('a b/c:', id % 2)"))))
    frame.write.partitionBy("small", "big", "ratio", "day", "name").parquet(path)
    back = spark.read.parquet(path)
    expected = sorted((row.asDict() for row in back.collect()), key=lambda row: row["id"])

    with make_batch_reader(path) as reader:
        types = {f.name: f.type for f in reader.schema}
    assert list(types) == back.columns  # the partition columns last, outer folder first, as Spark has them
    assert {f.name: SPARK_TO_ARROW[repr(f.dataType)] for f in back.schema.fields} == types
    got = _rows(make_batch_reader(path, shuffle_row_groups=False))
    for row in got:
        row["day"] = row["day"].astype(datetime.date) if isinstance(row["day"], np.datetime64) else row["day"]
    assert got == expected
    assert sum(1 for row in got if row["name"] is None) == 15  # __HIVE_DEFAULT_PARTITION__ is null


def test_partition_columns_filter_and_shard_by_rows(tmp_path):
    _write(tmp_path, {"key=1": 0, "key=2": 100, "key=3": 200, "key=10": 300}, rows=5)
    everything = _rows(make_batch_reader(tmp_path))
    assert Counter(row["key"] for row in everything) == {1: 5, 2: 5, 3: 5, 10: 5}
    assert all(row["key"] == row["id"] // 100 + (7 if row["id"] >= 300 else 1) for row in everything)

    for filters in ([("key", ">=", 3)], ds.field("key") >= 3, [("key", "in", [3, 10]), ("x", ">=", 0)]):
        shards = [_rows(make_batch_reader(tmp_path, filters=filters, cur_shard=k, shard_count=3)) for k in range(3)]
        assert sorted(len(s) for s in shards) == [3, 3, 4]  # 10 rows pass, balanced by rows across the files
        assert sorted(row["id"] for s in shards for row in s) == list(range(200, 205)) + list(range(300, 305))
        assert {row["key"] for s in shards for row in s} == {3, 10}

    mixed = _rows(make_batch_reader(tmp_path, filters=[("key", "=", 2), ("id", ">", 102)]))
    assert [row["id"] for row in mixed] == [103, 104]
    with make_reader(tmp_path, schema_fields=["key"], shuffle_row_groups=False) as rows:  # no column of the files
        assert [row.key for row in rows] == [1] * 5 + [10] * 5 + [2] * 5 + [3] * 5  # in file order: key=1, 10, 2, 3


def test_the_innermost_run_of_key_value_folders_is_read_and_escapes_are_undone(tmp_path):
    _write(tmp_path, {"raw/region=eu%2Fwest/when=2024-01-02 10%3A00%3A00": 0, "raw/region=us/when=x": 10})
    rows = _rows(make_batch_reader(tmp_path))
    assert {(row["region"], row["when"]) for row in rows} == {("eu/west", "2024-01-02 10:00:00"), ("us", "x")}
    with make_batch_reader(tmp_path) as reader:
        assert reader.schema.names == ["id", "x", "region", "when"]  # "raw" has no "=": it is not a partition
        assert reader.schema.field("when").type == pa.string()  # timestamps stay strings


@pytest.mark.parametrize("values, arrow_type", [
    (["1", "-2", "+3"], pa.int32()), (["1", "3000000000"], pa.int64()), (["1", "2.5", "1e3"], pa.float64()),
    (["2024-01-31", "1999-12-01"], pa.date32()), (["1", "2024-01-31"], pa.string()), (["007", "abc"], pa.string()),
    (["12345678901234567890123"], pa.decimal128(23, 0)), (["12345678901234567890123", "2.5"], pa.string()),
])
def test_partition_types_are_inferred_as_spark_infers_them(tmp_path, values, arrow_type):
    _write(tmp_path, {f"v={value}": 10 * i for i, value in enumerate(values)}, rows=1)
    with make_batch_reader(tmp_path) as reader:
        assert reader.schema.field("v").type == arrow_type
        assert len(list(reader)) >= 1


def test_files_under_different_keys_or_a_key_that_is_a_column_are_refused(tmp_path):
    _write(tmp_path / "a", {"key=1": 0, "other=2": 10})
    with pytest.raises(ValueError, match=r"sit in partition folders of different keys: .*\['key'\].*\['other'\]"):
        make_batch_reader(tmp_path / "a")
    _write(tmp_path / "b", {"id=1": 0})
    with pytest.raises(SchemaError, match=r"\['id'\] .* are both in its Parquet files and partition folder names"):
        make_batch_reader(tmp_path / "b")


def test_an_empty_partition_value_is_refused_as_spark_refuses_it(tmp_path):
    _write(tmp_path, {"key=a": 0, "key=": 10})
    with pytest.raises(ValueError, match=r"The folder 'key=' in 'key=' is a partition folder with an empty value, "
                                         r"which Spark refuses too \(EMPTY_PARTITION_COLUMN_VALUE\); rename it to "
                                         r"'key=__HIVE_DEFAULT_PARTITION__' for a null, or give it a value"):
        make_batch_reader(tmp_path)


def test_a_file_listed_by_itself_has_no_partition_columns(tmp_path):
    _write(tmp_path, {"key=1": 0})
    with make_batch_reader(str(tmp_path / "key=1" / "part-0.parquet")) as reader:
        assert reader.schema.names == ["id", "x"]


def test_schema_fields_take_petastorms_whole_name_patterns(tmp_path):
    root = tmp_path / "wide"
    root.mkdir()
    pq.write_table(pa.table({"id": [1, 2], "float32": [1.0, 2.0], "float64": [3.0, 4.0], "floaty_name": [5, 6],
                             "label": [0, 1]}), root / "part-0.parquet")
    with make_batch_reader(root, schema_fields=["id", "float.*$"]) as reader:  # Petastorm's docs' example
        assert reader.schema.names == ["id", "float32", "float64", "floaty_name"]
    with make_batch_reader(root, schema_fields=["label", "float\\d+", "float32"]) as reader:
        assert reader.schema.names == ["label", "float32", "float64"]  # a column matched twice comes once
    with pytest.raises(SchemaError, match=r"pattern 'loat\.\*' matches no column; a pattern must match a whole column"):
        make_batch_reader(root, schema_fields=["loat.*"])
    with pytest.raises(SchemaError, match=r"'float\[' is neither a column nor a valid regular expression"):
        make_batch_reader(root, schema_fields=["float["])
    with pytest.raises(RuntimeError, match=r"Column\(s\) \['float'\] in schema_fields do not exist"):  # Petastorm's type
        make_batch_reader(root, schema_fields=["float"])


# ---- Petastorm's reader behaviour: shared across threads, and read after stop() -------------------------------


@pytest.mark.parametrize("make", [make_reader, make_batch_reader])
def test_ten_threads_share_one_reader_and_read_every_row_once(dataset, make):
    import threading

    seen, errors = [], []

    def drain(reader):
        try:
            for item in reader:
                seen.extend(np.atleast_1d(item.id).tolist())
        except Exception as exc:  # noqa: BLE001 - what Petastorm users saw: "generator already executing"
            errors.append(exc)

    with make(dataset, num_epochs=2, equal_steps=False, workers_count=2) as reader:
        threads = [threading.Thread(target=drain, args=(reader,)) for _ in range(10)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
    assert errors == []
    assert Counter(seen) == {i: 2 for i in range(100)}


@pytest.mark.parametrize("make", [make_reader, make_batch_reader])
def test_next_after_stop_or_the_with_block_raises_petastorms_runtime_error(dataset, make):
    with make(dataset, equal_steps=False) as reader:
        next(reader)
    with pytest.raises(RuntimeError, match=r"^This reader was stopped \(stop\(\) was called, or its 'with' block was "
                                           r"left\) and is read again; a stopped reader yields nothing more"):
        next(reader)
    stopped = make(dataset)
    stopped.stop()
    with pytest.raises(RuntimeError, match="This reader was stopped"):
        next(stopped)
    with make(dataset, num_epochs=1) as finished:
        assert len(list(finished)) >= 1
        with pytest.raises(StopIteration):  # read to its end: an iterator that is done, not an error
            next(finished)
    with pytest.raises(StopIteration):
        next(finished)
