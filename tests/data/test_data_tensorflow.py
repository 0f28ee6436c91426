"""The tf.data adapter: signatures, values, shards, re-iteration, data errors, and the converter's make_tf_dataset."""

from __future__ import annotations

import os
import threading

import pytest

# Before TensorFlow loads, keep its C++ start-up lines out of the log; then put the variable back: collection runs
# this in every test worker, and ranks and notebook kernels started later inherit the worker's environment (the
# tests of TensorFlow's start-up notices failed under it).
_LEVEL = os.environ.get("TF_CPP_MIN_LOG_LEVEL")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
try:
    tf = pytest.importorskip("tensorflow")
finally:
    if _LEVEL is None:
        os.environ.pop("TF_CPP_MIN_LOG_LEVEL", None)
    else:
        os.environ["TF_CPP_MIN_LOG_LEVEL"] = _LEVEL

import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402

from sparkhvd.data import make_batch_reader  # noqa: E402
from sparkhvd.data.tensorflow import TFDatasetContext, make_tf_dataset  # noqa: E402

LAYOUT = [[10, 25, 5], [30, 7, 23]]  # 100 rows, unequal row groups


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    """100 rows, ids 0..99: id, label (int32), vec (list of 3 float32), pair (fixed_size_list of 2 float64), name."""
    root = tmp_path_factory.mktemp("tf") / "ds"
    root.mkdir()
    schema = pa.schema([("id", pa.int64()), ("label", pa.int32()), ("vec", pa.list_(pa.float32())),
                        ("pair", pa.list_(pa.float64(), 2)), ("name", pa.string())])
    start = 0
    for f, sizes in enumerate(LAYOUT):
        with pq.ParquetWriter(root / f"part-{f}.parquet", schema) as writer:
            for size in sizes:
                ids = np.arange(start, start + size)
                writer.write_table(pa.table({
                    "id": ids, "label": (ids % 10).astype(np.int32), "vec": [[i, i + 0.5, i + 1] for i in ids],
                    "pair": [[i, -i] for i in ids], "name": [str(i) for i in ids],
                }, schema=schema))
                start += size
    return str(root)


def _read(dataset):
    return [{k: v.numpy() for k, v in batch.items()} for batch in dataset]


def _ids(batches):
    return [int(i) for b in batches for i in b["id"]]


@pytest.mark.unit
def test_signature_values_and_two_shards(url):
    shards = [_read(make_tf_dataset(url, batch_size=8, cur_shard=k, shard_count=2, num_epochs=1)) for k in range(2)]
    spec = make_tf_dataset(url, batch_size=8).element_spec
    assert spec == {
        "id": tf.TensorSpec((None,), tf.int64), "label": tf.TensorSpec((None,), tf.int32),
        "vec": tf.TensorSpec((None, None), tf.float32), "pair": tf.TensorSpec((None, 2), tf.float64),
        "name": tf.TensorSpec((None,), tf.string),
    }
    assert len(shards[0]) == len(shards[1]) == 7  # 50 rows each: 6 batches of 8 and one of 2
    assert sorted(_ids(shards[0]) + _ids(shards[1])) == list(range(100))  # every row exactly once
    batch = shards[1][0]
    assert batch["vec"].shape == (8, 3) and batch["vec"].dtype == np.float32 and batch["label"].dtype == np.int32
    np.testing.assert_array_equal(batch["vec"][:, 1], batch["id"] + 0.5)
    np.testing.assert_array_equal(batch["pair"], np.stack([batch["id"], -batch["id"]], axis=1))
    assert [s.decode() for s in batch["name"]] == [str(i) for i in batch["id"]]
    assert [int(i) for i in batch["label"]] == [int(i) % 10 for i in batch["id"]]


@pytest.mark.unit
def test_list_lengths_give_a_static_shape_and_are_checked(url):
    dataset = make_tf_dataset(url, batch_size=10, list_lengths={"vec": 3}, num_epochs=1)
    assert dataset.element_spec["vec"].shape.as_list() == [None, 3]
    assert sorted(_ids(_read(dataset))) == list(range(100))
    wrong = make_tf_dataset(url, batch_size=10, list_lengths={"vec": 4}, num_epochs=1)
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"Column 'vec' has lists of length 3 at depth 1 in a batch, but its static shape is \(None, 4\); fix list_lengths"):
        _read(wrong)
    with pytest.raises(ValueError, match=r"list_lengths names column 'id', but it is int64, not a list"):
        make_tf_dataset(url, list_lengths={"id": 3})
    with pytest.raises(ValueError, match=r"list_lengths\['vec'\] must be a non-negative int, got -1"):
        make_tf_dataset(url, list_lengths={"vec": -1})


@pytest.mark.unit
def test_each_iteration_of_a_url_dataset_reads_afresh_in_a_new_order(url):
    dataset = make_tf_dataset(url, batch_size=10, num_epochs=1, cur_shard=0, shard_count=1)
    first, second = _ids(_read(dataset)), _ids(_read(dataset))  # as Keras iterates once per epoch
    assert sorted(first) == sorted(second) == list(range(100)) and first != second


@pytest.mark.parametrize("kwargs, count", [
    (dict(batch_size=8, cur_shard=1, shard_count=2, num_epochs=3), 21),  # 50 rows a shard: 7 batches an epoch
    (dict(batch_size=None, cur_shard=0, shard_count=2, num_epochs=1), None),  # plan sizes: counted all the same
    (dict(batch_size=8, num_epochs=None), tf.data.INFINITE_CARDINALITY),
    (dict(batch_size=8, num_epochs=2, equal_steps=False), tf.data.UNKNOWN_CARDINALITY),
    (dict(batch_size=8, num_epochs=2, resume_from=(0, 3)), tf.data.UNKNOWN_CARDINALITY),
])
@pytest.mark.unit
def test_the_batch_count_is_the_datasets_cardinality_where_the_plan_fixes_it(url, kwargs, count):
    dataset = make_tf_dataset(url, **kwargs)
    if count == tf.data.INFINITE_CARDINALITY:  # read forever: nothing to count, tf.data says unknown
        assert int(dataset.cardinality()) == tf.data.UNKNOWN_CARDINALITY
        return
    if count == tf.data.UNKNOWN_CARDINALITY:
        assert int(dataset.cardinality()) == count
        return
    batches = len(_read(dataset))
    assert int(dataset.cardinality()) == batches == (count or batches)
    assert len(_read(dataset)) == batches  # the second iteration (another seed) has as many: Keras' next epoch


@pytest.mark.unit
def test_a_reader_dataset_is_read_once(url):
    dataset = make_tf_dataset(make_batch_reader(url, batch_size=10), batch_size=None)
    assert sorted(_ids(_read(dataset))) == list(range(100))
    with pytest.raises(tf.errors.UnknownError, match=r"RuntimeError: This tf.data.Dataset wraps a Reader, which can be read once"):
        _read(dataset)


@pytest.mark.unit
def test_reader_options_with_an_existing_reader_are_refused(url):
    reader = make_batch_reader(url, batch_size=10)
    with pytest.raises(ValueError, match=r"make_tf_dataset\(batch_size=32\) was given a Reader built with batch_size=10"):
        make_tf_dataset(reader, batch_size=32)
    with pytest.raises(TypeError, match=r"make_tf_dataset got reader options \['num_epochs'\] with an existing Reader"):
        make_tf_dataset(reader, num_epochs=2)
    reader.stop()


@pytest.mark.unit
def test_leaving_the_context_stops_the_readers_still_running(url, no_leaked_threads):
    with TFDatasetContext(url, batch_size=10, num_epochs=None) as dataset:
        iterator = iter(dataset)  # an endless iteration, left unfinished and still referenced
        next(iterator)
        assert any(t.name.startswith("sparkhvd-data") for t in threading.enumerate())
    assert not any(t.name.startswith("sparkhvd-data") for t in threading.enumerate())
    del iterator


@pytest.mark.parametrize(
    ("column", "match"),
    [
        (pa.array([[1.0, 2.0], [3.0]], pa.list_(pa.float32())), r"Column 'c' has lists of different lengths, or null lists, in a batch"),
        (pa.array([[1.0, 2.0], None], pa.list_(pa.float32())), r"Column 'c' has lists of different lengths, or null lists"),
        (pa.array([1, None], pa.int64()), r"Column 'c' has null values in a batch; tf.data tensors cannot hold nulls"),
        (pa.array(["a", None], pa.string()), r"Column 'c' has null values in a batch"),
        (pa.array([1.5, None], pa.float64()), r"Column 'c' has null values in a batch"),  # NumPy would make it NaN
        (pa.array([2.5, None], pa.float32()), r"Column 'c' has null values in a batch"),
        (pa.array([[1.0, None], [2.0, 3.0]], pa.list_(pa.float32())), r"Column 'c' has null values in a batch"),
    ],
)
@pytest.mark.unit
def test_data_that_tf_cannot_hold_is_an_error_that_names_the_column(tmp_path, column, match):
    pq.write_table(pa.table({"c": column}), tmp_path / "part.parquet")
    with pytest.raises(tf.errors.InvalidArgumentError, match=match):
        _read(make_tf_dataset(str(tmp_path), batch_size=2))


@pytest.mark.unit
def test_nan_in_a_float_column_is_data_not_a_null(tmp_path):
    pq.write_table(pa.table({"c": pa.array([1.5, float("nan")], pa.float64())}), tmp_path / "part.parquet")
    (batch,) = _read(make_tf_dataset(str(tmp_path), batch_size=2))
    assert batch["c"][0] == 1.5 and np.isnan(batch["c"][1])


@pytest.mark.unit
def test_a_type_tf_cannot_hold_is_refused_when_the_dataset_is_made(tmp_path):
    pq.write_table(pa.table({"t": pa.array([1, 2], pa.timestamp("us"))}), tmp_path / "part.parquet")
    with pytest.raises(TypeError, match=r"Column 't' has Arrow type timestamp\[us\], which tf.data cannot hold; cast it in Spark"):
        make_tf_dataset(str(tmp_path))


@pytest.mark.slow
def test_converter_make_tf_dataset_has_static_shapes_and_feeds_keras(spark, tmp_path, no_leaked_threads):
    from sparkhvd.data import make_spark_converter

    df = spark.range(0, 103, numPartitions=3).selectExpr("id", "array(cast(id as double), cast(id as double) + 0.5) as vec", "cast(id as double) * 2 as y")
    converter = make_spark_converter(df, parent_cache_dir_url=tmp_path.as_uri())
    assert converter.list_lengths == {"vec": 2}
    shards = []
    for k in range(2):
        with converter.make_tf_dataset(batch_size=10, num_epochs=1, cur_shard=k, shard_count=2) as dataset:
            assert dataset.element_spec["vec"] == tf.TensorSpec((None, 2), tf.float32)
            assert dataset.element_spec["y"] == tf.TensorSpec((None,), tf.float32)
            shards.append(_read(dataset))
    assert len(shards[0]) == len(shards[1]) == 6  # 52 and 51 rows: m = 51 -> 6 batches each
    assert sorted(_ids(shards[0]) + _ids(shards[1])) == list(range(103))
    with converter.make_tf_dataset(batch_size=16, num_epochs=None, cur_shard=0, shard_count=1) as dataset:
        model = tf.keras.Sequential([tf.keras.Input((2,)), tf.keras.layers.Dense(1)])  # Dense needs the static last dim
        model.compile(optimizer="sgd", loss="mse")
        history = model.fit(dataset.map(lambda b: (b["vec"], b["y"])), steps_per_epoch=3, epochs=2, shuffle=False, verbose=0)
    assert len(history.history["loss"]) == 2
    converter.delete()


@pytest.mark.unit
def test_resume_from_continues_the_uninterrupted_dataset_and_its_later_iterations(url):
    kwargs = dict(batch_size=8, cur_shard=1, shard_count=2, seed=2, shuffle_rows=True, num_epochs=1)
    uninterrupted = make_tf_dataset(url, **kwargs)
    passes = [[b["id"].tolist() for b in _read(uninterrupted)] for _ in range(3)]
    resumed = make_tf_dataset(url, resume_from=(1, 2), **kwargs)  # loader epoch 1 is iteration 1 (num_epochs=1)
    assert [[b["id"].tolist() for b in _read(resumed)] for _ in range(2)] == [passes[1][2:], passes[2]]


def test_decode_is_refused_with_where_to_decode_instead(dataset):
    with pytest.raises(ValueError, match=r"make_tf_dataset does not take decode=, whose arrays' shapes its output "
                                         r"signature cannot know before reading; decode in the tf.data pipeline"):
        make_tf_dataset(dataset, batch_size=4, decode={"id": int})
    with pytest.raises(ValueError, match=r"make_tf_dataset does not take decode="):
        make_tf_dataset(make_batch_reader(dataset, decode={"id": int}))
