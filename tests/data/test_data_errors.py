"""Every error sparkhvd.data raises, matched by its message."""

from __future__ import annotations

from collections import Counter

import pyarrow as pa
import pytest

from sparkhvd.data import DatasetNotFoundError, EmptyShardError, ReadError, SchemaError, make_batch_reader, make_reader
from sparkhvd.data._arrow import rebatch

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(cur_shard=0), ValueError, r"Pass both cur_shard and shard_count or neither \(got cur_shard=0, shard_count=None\)"),
        (dict(cur_shard=2, shard_count=2), ValueError, r"0 <= cur_shard < shard_count, got cur_shard=2, shard_count=2"),
        (dict(cur_shard=-1, shard_count=2), ValueError, r"got cur_shard=-1, shard_count=2"),
        (dict(cur_shard=0, shard_count=0), ValueError, r"shard_count must be at least 1, got 0"),
        (dict(cur_shard=0.0, shard_count=2), TypeError, r"cur_shard must be an int, got float 0.0"),
        (dict(cur_shard=True, shard_count=2), TypeError, r"cur_shard must be an int, got the bool True"),
        (dict(num_epochs=0), ValueError, r"num_epochs must be at least 1, got 0; pass None to read forever"),
        (dict(batch_size=0), ValueError, r"batch_size must be at least 1, got 0"),
        (dict(workers_count=0), ValueError, r"workers_count must be at least 1, got 0"),
        (dict(seed=-1), ValueError, r"seed must be a non-negative int or None, got -1"),
        (dict(schema_fields="id"), TypeError, r"schema_fields must be a list of column names or patterns, got 'id'"),
        (dict(schema_fields=[]), ValueError, r"schema_fields is empty; name at least one of the columns \['id', 'label', 'vec'\]"),
        (dict(schema_fields=["id", "id"]), ValueError, r"schema_fields \['id', 'id'\] names a column more than once"),
        (dict(filters="label = 3"), TypeError, r"filters must be a pyarrow.dataset.Expression or a DNF list .* got str: 'label = 3'"),
        (dict(filters=[("label", "~~", 3)]), ValueError, r"is not a valid DNF filter list"),
        (dict(filters=[("nope", "=", 3)]), SchemaError, r"could not be applied to .*part-00000.parquet.*columns of the dataset, which are \['id', 'label', 'vec'\]"),
    ],
)
def test_bad_arguments(dataset, kwargs, error, match):
    with pytest.raises(error, match=match):
        make_batch_reader(dataset, **kwargs)


def test_missing_column_names_the_column_and_the_available_ones(dataset):
    with pytest.raises(SchemaError, match=r"Column\(s\) \['features'\] in schema_fields do not exist in .*ds.*; the available columns are \['id', 'label', 'vec'\]\. Fix the names"):
        make_batch_reader(dataset, schema_fields=["id", "features"])


def test_column_missing_from_one_file_names_that_file(dataset):
    pa.parquet.write_table(pa.table({"id": [1000]}), dataset / "part-00009.parquet")
    with pytest.raises(SchemaError, match=r"Column\(s\) \['label'\] in schema_fields do not exist in file '.*part-00009.parquet'"):
        make_batch_reader(dataset, schema_fields=["id", "label"])


def test_more_shards_than_rows(dataset):
    with pytest.raises(EmptyShardError, match=r"has 100 rows across 3 file\(s\), fewer than shard_count=101, so shards 100 to 100 \(this reader is shard 7\) would be empty; use at most 100 shards"):
        make_batch_reader(dataset, cur_shard=7, shard_count=101)


def test_filter_that_matches_nothing(dataset):
    with pytest.raises(EmptyShardError, match=r"has 0 rows after filters .*label.* so shards 0 to 0 .* would be empty; point the reader at a dataset with rows or looser filters"):
        make_batch_reader(dataset, filters=[("label", ">", 100)])


def test_missing_path(tmp_path):
    with pytest.raises(DatasetNotFoundError, match=r"The dataset path '.*nowhere' does not exist .*; check the path"):
        make_batch_reader(tmp_path / "nowhere")


def test_directory_without_parquet_files(tmp_path):
    (tmp_path / "_SUCCESS").write_text("")
    with pytest.raises(DatasetNotFoundError, match=r"No Parquet files found under '.*'.*names start with '_' or '.' are skipped"):
        make_batch_reader(tmp_path)


def test_unreadable_file(dataset):
    (dataset / "notes.txt").write_text("not parquet")
    with pytest.raises(ReadError, match=r"Could not read the Parquet footer of '.*notes.txt': .*Remove the file from the dataset"):
        make_batch_reader(dataset)


def test_empty_list_and_duplicates_and_mixed_filesystems(dataset):
    with pytest.raises(ValueError, match=r"dataset_url_or_urls is an empty list"):
        make_batch_reader([])
    part = dataset / "part-00000.parquet"
    with pytest.warns(UserWarning, match=r"The file '.*part-00000.parquet' is listed more than once .*, so its rows are "
                                         r"read as many times each epoch; list each file once"):
        reader = make_batch_reader([dataset, part, part])
    with reader:  # read as often as listed, as in Petastorm: part-00000 holds ids 0 to 34
        ids = Counter(i for batch in reader for i in batch.id.tolist())
    assert ids == {**{i: 1 for i in range(100)}, **{i: 3 for i in range(35)}}
    with pytest.raises(ValueError, match=r"All dataset URLs must be on one filesystem, .* is on local and 'mock:///x' is on mock"):
        make_batch_reader([part, "mock:///x"])


def test_bad_urls(dataset):
    with pytest.raises(TypeError, match=r"Dataset URLs must be str or os.PathLike, got int 3"):
        make_batch_reader(3)
    with pytest.raises(ValueError, match=r"The file URL 'file://otherhost/data' names host 'otherhost'; file URLs must be local"):
        make_batch_reader("file://otherhost/data")


def test_rebatch_running_short_is_reported():
    with pytest.raises(RuntimeError, match=r"ran out 2 rows short of a batch of 5; this is a bug"):
        list(rebatch([pa.table({"a": [1, 2, 3]})], [5]))


@pytest.mark.parametrize(("call", "match"), [
    (lambda d: make_batch_reader(d, num_epochs="abc"), r"num_epochs must be an int, got str 'abc'"),
    (lambda d: make_batch_reader(d, cur_shard="0", shard_count=2), r"cur_shard must be an int, got str '0'"),
    (lambda d: make_reader(None), r"Dataset URLs must be str or os.PathLike, got NoneType None"),
])
def test_a_wrong_type_is_a_value_error_as_in_petastorm_and_a_type_error(dataset, call, match):
    with pytest.raises(ValueError, match=match) as info:
        call(dataset)
    assert isinstance(info.value, TypeError)
