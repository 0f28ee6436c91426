"""make_delta_reader on real Delta tables written by delta-rs (``deltalake.write_deltalake``), against delta-rs's own
read of the same version (the peer, its SQL engine); skipped where deltalake does not install. The local tables' tests
are the fast tier (unit); an ``s3://`` table's are not: they start moto's S3 server as a process (tests/_s3.py)."""

from __future__ import annotations

import datetime
import logging
import os
import warnings
from collections import Counter

import _s3
import numpy as np
import pyarrow as pa
import pytest

from sparkhvd.data import DatasetNotFoundError, make_batch_reader, make_delta_reader
from sparkhvd.data.torch import make_torch_loader

deltalake = pytest.importorskip("deltalake", reason="deltalake (the delta extra) is not installed")

SECRET = "NOT-TO-BE-SHOWN-d3lta"  # the S3 tests' secret key: no message, log or warning may show it


def _rows(reader) -> list[dict]:
    with reader:
        return sorted((dict(zip(b._fields, values)) for b in reader for values in zip(*(c.tolist() for c in b))),
                      key=lambda row: row["id"])


def _write_table(uri: str, storage_options: dict | None = None) -> str:
    """A table partitioned by ``part``: version 0 writes ids 0..39, version 1 appends 100..109, version 2 deletes
    ids below 5 (delta-rs rewrites those files: the old ones stay in the folder, removed in the log)."""
    ids = pa.array(range(40), pa.int64())
    deltalake.write_deltalake(uri, pa.table({"id": ids, "part": pa.array([i % 3 for i in range(40)], pa.int32()),
                                             "x": pa.array([i * 0.5 for i in range(40)])}), partition_by=["part"],
                              storage_options=storage_options)
    deltalake.write_deltalake(uri, pa.table({"id": pa.array(range(100, 110), pa.int64()),
                                             "part": pa.array([7] * 10, pa.int32()), "x": pa.array([1.0] * 10)}),
                              mode="append", partition_by=["part"], storage_options=storage_options)
    deltalake.DeltaTable(uri, storage_options=storage_options).delete("id < 5")
    return uri


@pytest.fixture
def table(tmp_path):
    """``_write_table``'s table in a local folder."""
    return _write_table(str(tmp_path / "table"))


def _delta_rs(path, **table_args) -> list[dict]:
    """The peer: delta-rs's own read of the version (``table_args``: DeltaTable's ``version``, ``storage_options``),
    by its SQL engine (DataFusion). Not ``to_pyarrow_table()``: a process that ran it aborted at exit in 15 of 30 runs
    here ("terminate called without an active exception", deltalake 1.6.6), which would take the test worker down."""
    table = pa.table(deltalake.QueryBuilder().register("t", deltalake.DeltaTable(path, **table_args))
                     .execute("select * from t").read_all())
    return sorted(table.to_pylist(), key=lambda row: row["id"])


@pytest.mark.unit
def test_the_newest_version_is_what_delta_rs_reads_with_the_tables_types_and_order(table):
    rows = _rows(make_delta_reader(table))
    assert rows == _delta_rs(table)
    assert [r["id"] for r in rows] == list(range(5, 40)) + list(range(100, 110))  # the deleted rows are not read
    with make_delta_reader(table) as reader:
        assert reader.schema == pa.schema(deltalake.DeltaTable(table).schema().to_arrow())  # partition column in place


@pytest.mark.unit
def test_shards_are_exact_and_balanced_and_filters_take_partition_columns(table):
    shards = [_rows(make_delta_reader(table, cur_shard=k, shard_count=4, seed=3)) for k in range(4)]
    assert sorted(r["id"] for s in shards for r in s) == list(range(5, 40)) + list(range(100, 110))
    assert sorted(len(s) for s in shards) == [11, 11, 11, 12]  # 45 rows
    picked = _rows(make_delta_reader(table, filters=[("part", "in", [1, 7])], schema_fields=["id", "part"]))
    assert [(r["id"], r["part"]) for r in picked] == [(i, 1) for i in range(7, 40, 3)] + [(i, 7) for i in range(100, 110)]
    with make_torch_loader(make_delta_reader(table, batch_size=9), batch_size=None) as loader:
        assert sum(len(batch["id"]) for batch in loader) == 45


@pytest.mark.unit
def test_time_travel_by_version_and_by_timestamp(table):
    assert _rows(make_delta_reader(table, version=0)) == _delta_rs(table, version=0)
    assert len(_rows(make_delta_reader(table, version=0))) == 40
    # Delta's time travel by timestamp takes the version whose commit file was last written at or before it (delta-rs
    # reads the log files' modification times): version 1's file time, not its commitInfo "timestamp" (set before
    # the file is written, a few ms earlier, or more on a loaded machine, which then still names version 0)
    commit = os.path.join(table, "_delta_log", f"{1:020d}.json")
    at = datetime.datetime.fromtimestamp(os.path.getmtime(commit), tz=datetime.timezone.utc)
    assert [r["id"] for r in _rows(make_delta_reader(table, timestamp=at))] == list(range(40)) + list(range(100, 110))
    assert len(_rows(make_delta_reader(table, timestamp=at.isoformat()))) == 50
    with pytest.raises(ValueError, match=r"make_delta_reader got version=0 and timestamp='2026-01-01'; pass one of them"):
        make_delta_reader(table, version=0, timestamp="2026-01-01")


@pytest.mark.unit
def test_a_delta_tables_directory_is_refused_by_the_plain_reader(table):
    counted = Counter(r["id"] for r in _rows(make_delta_reader(table)))
    assert counted[0] == 0
    with pytest.raises(ValueError, match=r"is a Delta table \(it has a _delta_log/ folder\): its Parquet files include "
                                         r"those that deletes, updates and overwrites have removed .* Read it with "
                                         r"sparkhvd.data.make_delta_reader\(url\)"):
        make_batch_reader(table)


@pytest.mark.unit
def test_column_mapping_is_refused_in_a_sentence(tmp_path):
    path = str(tmp_path / "mapped")
    deltalake.write_deltalake(path, pa.table({"id": [1, 2]}), configuration={"delta.columnMapping.mode": "name"})
    with pytest.raises(ValueError, match=r"uses column mapping \(delta.columnMapping.mode='name'\), whose Parquet files "
                                         r"name their columns by ids"):
        make_delta_reader(path)


@pytest.mark.unit
def test_a_table_in_a_folder_whose_name_needs_escaping(tmp_path):
    path = str(tmp_path / "my tables %" / "t")  # delta-rs escapes its URI: a space is %20
    deltalake.write_deltalake(path, pa.table({"id": pa.array(range(6), pa.int64()), "k": pa.array([1, 2] * 3, pa.int32())}),
                              partition_by=["k"])
    assert [(r["id"], r["k"]) for r in _rows(make_delta_reader(path))] == [(i, 1 + i % 2) for i in range(6)]


@pytest.mark.unit
def test_a_column_added_later_is_null_in_the_files_written_before(tmp_path):
    path = str(tmp_path / "evolving")
    deltalake.write_deltalake(path, pa.table({"id": pa.array(range(4), pa.int64()), "k": pa.array([1, 2, 1, 2], pa.int32())}),
                              partition_by=["k"])
    deltalake.write_deltalake(path, pa.table({"id": pa.array(range(4, 7), pa.int64()), "k": pa.array([1, 1, 2], pa.int32()),
                                              "y": pa.array([0.5, 1.5, 2.5])}), mode="append", schema_mode="merge",
                              partition_by=["k"])
    rows, peer = _rows(make_delta_reader(path)), _delta_rs(path)
    assert [(r["id"], r["k"]) for r in rows] == [(r["id"], r["k"]) for r in peer]
    # NumPy shows a float column's nulls as NaN (the batch reader's rule); delta-rs's rows say None
    assert [r["y"] for r in peer] == [None] * 4 + [0.5, 1.5, 2.5]
    assert np.isnan([r["y"] for r in rows][:4]).all() and [r["y"] for r in rows][4:] == [0.5, 1.5, 2.5]
    assert [r["id"] for r in _rows(make_delta_reader(path, filters=[("y", ">", 1.0)]))] == [5, 6]
    assert [r["id"] for r in _rows(make_delta_reader(path, filters=[("k", "=", 1)], schema_fields=["id", "y"]))] == [0, 2, 4, 5]


# ---- a table on S3 (moto's server, a process of its own), read through storage_options ----------------------------

@pytest.fixture(scope="module")
def s3_process():
    """moto's S3 server as a process on 127.0.0.1, the secret key ``SECRET`` in the environment (tests/_s3.py)."""
    yield from _s3.s3_process_fixture(secret=SECRET)


@pytest.fixture(scope="module")
def s3_table(s3_process):
    """``_write_table``'s table at ``s3://<bucket>/delta/table``, written through storage_options."""
    return _write_table(f"s3://{s3_process.bucket}/delta/table", s3_process.storage_options())


def _shown(caplog, capfd, seen) -> str:
    """Everything the reads logged, printed (stdout, stderr, fd-level: Rust's and C++'s too) and warned."""
    out, err = capfd.readouterr()
    return "\n".join([caplog.text, out, err, *(str(w.message) for w in seen)])


def test_an_s3_table_reads_through_storage_options_alone_in_shards_with_filters_and_at_an_older_version(
        s3_process, s3_table, caplog, capfd):
    options = s3_process.storage_options()  # the endpoint, region and credentials: none of them in the environment
    newest = list(range(5, 40)) + list(range(100, 110))
    caplog.set_level(logging.DEBUG)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        shards = [_rows(make_delta_reader(s3_table, storage_options=options, cur_shard=k, shard_count=2, seed=5))
                  for k in range(2)]
        peer = _delta_rs(s3_table, storage_options=options)
        assert sorted((r for s in shards for r in s), key=lambda row: row["id"]) == peer
        assert [r["id"] for r in peer] == newest  # the deleted rows are not read, by either
        assert sorted(len(s) for s in shards) == [22, 23]  # 45 rows, balanced to a row
        picked = _rows(make_delta_reader(s3_table, storage_options=options, filters=[("part", "in", [1, 7])]))
        assert picked == [r for r in peer if r["part"] in (1, 7)]
        assert [(r["id"], r["part"]) for r in picked] == ([(i, 1) for i in range(7, 40, 3)]
                                                          + [(i, 7) for i in range(100, 110)])
        assert _rows(make_delta_reader(s3_table, storage_options=options, version=0)) == _delta_rs(
            s3_table, version=0, storage_options=options)
        assert [r["id"] for r in _rows(make_delta_reader(s3_table, storage_options=options, version=1))] == (
            list(range(40)) + list(range(100, 110)))
    assert SECRET not in _shown(caplog, capfd, seen)


def test_an_s3_tables_errors_and_logs_never_show_the_secret_key(s3_process, caplog, capfd):
    options = s3_process.storage_options()
    caplog.set_level(logging.DEBUG)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with pytest.raises(deltalake.exceptions.TableNotFoundError) as missing:  # delta-rs's own error
            make_delta_reader(f"s3://{s3_process.bucket}/delta/nowhere", storage_options=options)
        gone = f"s3://{s3_process.bucket}/delta/gone"
        deltalake.write_deltalake(gone, pa.table({"id": pa.array(range(4), pa.int64())}), storage_options=options)
        data_file = deltalake.DeltaTable(gone, storage_options=options).file_uris()[0]
        s3_process.filesystem().delete_file(data_file[len("s3://"):])  # removed behind the log's back
        with pytest.raises(DatasetNotFoundError, match=rf"The dataset path '{s3_process.bucket}/delta/gone/part-[^']+"
                                                      r"\.parquet' does not exist") as read:
            make_delta_reader(gone, storage_options=options)
    for error in (missing.value, read.value):
        assert SECRET not in str(error) and SECRET not in repr(error)
    assert SECRET not in _shown(caplog, capfd, seen)


def test_an_s3_tables_escaped_names_read_through_storage_options_or_the_environment(s3_process, monkeypatch):
    # delta-rs escapes the folder's name in its URI, and each partition value's Hive escape again in the log
    # (s=a%20b is s=a%2520b there): each file is read under its own name, with its own partition values
    options = s3_process.storage_options()
    uri = f"s3://{s3_process.bucket}/delta/my tables %/escaped"
    values = ["a b", "x:y", "100%", "é/z"]
    deltalake.write_deltalake(uri, pa.table({"id": pa.array(range(4), pa.int64()), "s": values}), partition_by=["s"],
                              storage_options=options)
    expected = [{"id": i, "s": v} for i, v in enumerate(values)]
    assert _delta_rs(uri, storage_options=options) == expected
    assert _rows(make_delta_reader(uri, storage_options=options)) == expected
    assert _rows(make_delta_reader(uri, storage_options=options, filters=[("s", "=", "x:y")])) == [expected[1]]
    # Without storage_options delta-rs and pyarrow both take the endpoint from the environment
    for name in ("AWS_ENDPOINT_URL", "AWS_ALLOW_HTTP", "AWS_REGION"):
        monkeypatch.setenv(name, options[name])
    assert _rows(make_delta_reader(uri)) == expected
