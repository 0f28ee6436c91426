"""Behaviour of make_batch_reader / make_reader on real Parquet files."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest

from sparkhvd.data import make_batch_reader, make_reader

pytestmark = pytest.mark.unit


def ids(batches):
    return [i for b in batches for i in b.id.tolist()]


def test_reads_every_row_with_defaults_and_yields_namedtuples(dataset, drain):
    batches = drain(make_batch_reader(dataset))
    assert sorted(ids(batches)) == list(range(100))
    assert type(batches[0]).__name__ == "inferred_schema_view"
    assert batches[0]._fields == ("id", "label", "vec")
    assert all(isinstance(col, np.ndarray) for col in batches[0])


def test_same_seed_and_epoch_give_the_same_order_and_epochs_differ(dataset, drain):
    kw = dict(seed=5, shuffle_row_groups=True, shuffle_rows=True, num_epochs=2, batch_size=100)
    first, again = drain(make_batch_reader(dataset, **kw)), drain(make_batch_reader(dataset, **kw))
    assert ids(first) == ids(again)
    assert ids(first[:1]) != ids(first[1:])  # epoch 0 vs epoch 1
    assert sorted(ids(first[:1])) == sorted(ids(first[1:])) == list(range(100))
    other = drain(make_batch_reader(dataset, **{**kw, "seed": 6}))
    assert ids(other) != ids(first)


def test_without_shuffling_rows_come_in_file_order(dataset, drain):
    batches = drain(make_batch_reader(dataset, shuffle_row_groups=False, equal_steps=False))
    assert ids(batches) == list(range(100))
    assert [len(b.id) for b in batches] == [10, 25, 5, 30, 7, 23]  # one batch per row group


def test_seed_none_means_zero_so_every_rank_agrees(dataset, drain):
    assert ids(drain(make_batch_reader(dataset))) == ids(drain(make_batch_reader(dataset, seed=0)))


def test_two_epochs_yield_each_row_twice(dataset, drain):
    assert Counter(ids(drain(make_batch_reader(dataset, num_epochs=2)))) == Counter(list(range(100)) * 2)


def test_num_epochs_none_reads_forever(dataset):
    with make_batch_reader(dataset, num_epochs=None, batch_size=30, equal_steps=False) as reader:
        got = [next(reader) for _ in range(40)]  # 4 batches per epoch: 10 epochs
    assert Counter(ids(got)) == Counter(list(range(100)) * 10)


def test_batch_size_recuts_batches_across_row_groups(dataset, drain):
    batches = drain(make_batch_reader(dataset, batch_size=16, equal_steps=False, shuffle_row_groups=False))
    assert [len(b.id) for b in batches] == [16] * 6 + [4]
    assert ids(batches) == list(range(100))


def test_batch_size_with_equal_steps_drops_a_row_only_when_it_would_add_a_step(dataset, drain):
    # 100 rows on 3 shards: 34, 33, 33; m = 33. batch_size=11 divides 33, so shard 0 leaves out 1 row.
    shards = [drain(make_batch_reader(dataset, cur_shard=k, shard_count=3, batch_size=11)) for k in range(3)]
    assert [[len(b.id) for b in s] for s in shards] == [[11, 11, 11]] * 3
    # batch_size=10 does not divide 33: every shard takes 4 steps and every row is read.
    shards = [drain(make_batch_reader(dataset, cur_shard=k, shard_count=3, batch_size=10)) for k in range(3)]
    assert [[len(b.id) for b in s] for s in shards] == [[10, 10, 10, 4], [10, 10, 10, 3], [10, 10, 10, 3]]
    assert sorted(i for s in shards for i in ids(s)) == list(range(100))


def test_more_shards_than_row_groups(dataset, drain):
    shards = [ids(drain(make_batch_reader(dataset, cur_shard=k, shard_count=40))) for k in range(40)]
    assert sorted(i for s in shards for i in s) == list(range(100))
    assert {len(s) for s in shards} == {2, 3}


def test_equal_length_list_column_is_2d(dataset, drain):
    batch = drain(make_batch_reader(dataset, batch_size=100))[0]
    assert batch.vec.shape == (100, 3) and batch.vec.dtype == np.float32
    np.testing.assert_array_equal(batch.vec[:, 0], batch.id.astype(np.float32))
    np.testing.assert_array_equal(batch.vec[:, 2], batch.id + 1.0)


def test_fixed_size_list_is_2d_and_ragged_list_is_object(tmp_path, drain):
    values = pa.array(np.arange(12, dtype=np.float32))
    table = pa.table({
        "fixed": pa.FixedSizeListArray.from_arrays(values, 4),
        "ragged": pa.array([[1], [2, 3], None], pa.list_(pa.int32())),
        "name": ["a", "b", None],
    })
    pq.write_table(table, tmp_path / "t.parquet")
    batch = drain(make_batch_reader(tmp_path / "t.parquet"))[0]
    assert batch.fixed.shape == (3, 4) and batch.fixed[2, 3] == 11
    assert batch.ragged.dtype == object
    assert [None if r is None else r.tolist() for r in batch.ragged] == [[1], [2, 3], None]
    assert batch.name.tolist() == ["a", "b", None]


def test_schema_fields_selects_and_orders_columns(dataset, drain):
    batch = drain(make_batch_reader(dataset, schema_fields=["label", "id"]))[0]
    assert batch._fields == ("label", "id")
    np.testing.assert_array_equal(batch.label, batch.id % 10)


@pytest.mark.parametrize("filters", [[("label", "=", 3)], ds.field("label") == 3])
def test_filters_keep_matching_rows_and_balance_them(dataset, drain, filters):
    shards = [drain(make_batch_reader(dataset, cur_shard=k, shard_count=3, filters=filters, schema_fields=["id"])) for k in range(3)]
    assert sorted(i for s in shards for i in ids(s)) == list(range(3, 100, 10))
    assert sorted(len(ids(s)) for s in shards) == [3, 3, 4]
    assert len({len(s) for s in shards}) == 1  # equal steps


def test_single_file_file_url_and_list_of_paths(dataset, drain):
    files = sorted(dataset.glob("*.parquet"))
    assert sorted(ids(drain(make_batch_reader(files[0])))) == list(range(35))
    assert sorted(ids(drain(make_batch_reader(dataset.as_uri())))) == list(range(100))
    assert sorted(ids(drain(make_batch_reader([str(files[0]), files[2].as_uri()])))) == list(range(35)) + list(range(77, 100))


def test_spark_side_files_are_skipped(dataset, drain):
    (dataset / "_SUCCESS").write_text("")
    (dataset / ".part-00000.parquet.crc").write_text("crc")
    assert sorted(ids(drain(make_batch_reader(dataset)))) == list(range(100))


def test_row_reader_yields_rows_and_equal_counts(dataset):
    with make_reader(dataset, cur_shard=0, shard_count=3) as reader:
        rows = list(reader)
    assert len(rows) == 33  # m = 33: shard 0's 34th row is left out for equal steps
    assert rows[0]._fields == ("id", "label", "vec") and rows[0].vec.shape == (3,)
    with make_reader(dataset, equal_steps=False, cur_shard=0, shard_count=3) as reader:
        assert len(list(reader)) == 34


def test_empty_files_and_row_groups_are_skipped(dataset, drain):
    schema = pq.read_schema(dataset / "part-00000.parquet")
    pq.write_table(schema.empty_table(), dataset / "part-00007.parquet")
    with pq.ParquetWriter(dataset / "part-00008.parquet", schema) as writer:
        writer.write_table(schema.empty_table())
        writer.write_table(pa.table({"id": [100], "label": [0], "vec": [[1.0, 2.0, 3.0]]}, schema=schema))
    shards = [ids(drain(make_batch_reader([dataset], cur_shard=k, shard_count=2))) for k in range(2)]
    assert sorted(shards[0] + shards[1]) == list(range(101))
