"""The tf.data adapter: a ``tf.data.Dataset`` of dicts of tensors over a sharded reader.

``import sparkhvd.data.tensorflow`` imports TensorFlow; ``import sparkhvd.data`` does not.
Elements are dicts ``{column: tensor}``, as in the torch adapter (Petastorm's
``make_petastorm_dataset`` yields namedtuples; ``dataset.map(lambda b: (b["features"],
b["label"]))`` gives Keras its ``(x, y)``). The ``output_signature`` has static shapes where
the schema fixes them: a scalar column is ``(None,)``, a ``fixed_size_list`` of L is
``(None, L)``, a ``list`` column is ``(None, None)`` unless ``list_lengths`` names its length
(the Spark converter measures it while writing, since Spark writes every array as a list).
The batch dimension is always None: the last batch of an epoch may be short.
"""

from __future__ import annotations

import threading
from typing import Any, Iterator, Mapping

import numpy as np
import pyarrow as pa

try:
    import tensorflow as tf
except ModuleNotFoundError as exc:
    if exc.name != "tensorflow":
        raise
    raise ModuleNotFoundError("TensorFlow isn't installed: pip install 'sparkhvd[tensorflow]'", name="tensorflow") from None

from ._arrow import table_to_batch
from ._passes import url_passes
from ._reader import Reader

__all__ = ["TFDatasetContext", "make_tf_dataset"]

_NUMERIC = {
    pa.int8(): tf.int8, pa.int16(): tf.int16, pa.int32(): tf.int32, pa.int64(): tf.int64,
    pa.uint8(): tf.uint8, pa.uint16(): tf.uint16, pa.uint32(): tf.uint32, pa.uint64(): tf.uint64,
    pa.float16(): tf.float16, pa.float32(): tf.float32, pa.float64(): tf.float64, pa.bool_(): tf.bool,
}


def _is_list(kind: pa.DataType) -> bool:
    return pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind)


def column_spec(name: str, kind: pa.DataType, length: int | None = None) -> tf.TensorSpec:
    """The TensorSpec of a batch of column ``name`` of Arrow type ``kind``; ``length``: its list length, if known."""
    dims: list[int | None] = []
    leaf = kind
    while _is_list(leaf):
        if pa.types.is_fixed_size_list(leaf):
            dims.append(leaf.list_size)
        else:
            dims.append(length if not dims else None)
        leaf = leaf.value_type
    if pa.types.is_dictionary(leaf):
        leaf = leaf.value_type
    if leaf in _NUMERIC:
        dtype = _NUMERIC[leaf]
    elif pa.types.is_string(leaf) or pa.types.is_large_string(leaf) or pa.types.is_binary(leaf) or pa.types.is_large_binary(leaf):
        dtype = tf.string
    else:
        raise TypeError(
            f"Column {name!r} has Arrow type {kind}, which tf.data cannot hold; cast it in Spark to a number or a "
            "string (e.g. a timestamp to long), or leave it out with schema_fields."
        )
    return tf.TensorSpec((None, *dims), dtype)


def output_signature(schema: pa.Schema, list_lengths: Mapping[str, int] | None = None) -> dict[str, tf.TensorSpec]:
    """The ``output_signature`` of a dataset over ``schema``: one TensorSpec per column, in order."""
    lengths = dict(list_lengths or {})
    for name, length in lengths.items():
        if name not in schema.names:
            continue  # a column left out with schema_fields
        kind = schema.field(name).type
        if not (pa.types.is_list(kind) or pa.types.is_large_list(kind)):
            raise ValueError(f"list_lengths names column {name!r}, but it is {kind}, not a list; name only list columns.")
        if isinstance(length, bool) or not isinstance(length, (int, np.integer)) or length < 0:
            raise ValueError(f"list_lengths[{name!r}] must be a non-negative int, got {length!r}.")
    return {field.name: column_spec(field.name, field.type, lengths.get(field.name)) for field in schema}


def _has_none(column: np.ndarray) -> bool:
    return any(value is None for value in column.flat)


def leaf_nulls(column: pa.Array | pa.ChunkedArray) -> int:
    """The nulls in an Arrow column at any depth: null rows, and null values inside its lists."""
    if isinstance(column, pa.ChunkedArray):
        return sum(leaf_nulls(chunk) for chunk in column.chunks)
    nulls = column.null_count
    if _is_list(column.type):
        nulls += leaf_nulls(column.flatten())
    return nulls


def to_tensor_input(name: str, column: np.ndarray, spec: tf.TensorSpec, has_nulls: bool = False) -> np.ndarray:
    """A reader's column checked against its TensorSpec, with errors that say what to change in the data.

    ``has_nulls``: whether the Arrow column had nulls (``leaf_nulls``). Pass it: NumPy turns a
    float column's nulls into NaN, which this function cannot tell from data.
    """
    rank = len(spec.shape)
    if rank > 1 and (column.ndim != rank or (column.dtype == object and spec.dtype != tf.string)):
        raise ValueError(
            f"Column {name!r} has lists of different lengths, or null lists, in a batch; a tf.data tensor needs one "
            "length per batch. Pad or cut the lists to one length in Spark, or leave the column out with schema_fields."
        )
    for axis, (want, got) in enumerate(zip(spec.shape[1:], column.shape[1:]), start=1):
        if want is not None and want != got:
            raise ValueError(
                f"Column {name!r} has lists of length {got} at depth {axis} in a batch, but its static shape is "
                f"{tuple(spec.shape)}; fix list_lengths, or the data."
            )
    nulls = _has_none(column) if column.dtype == object else spec.dtype != tf.string and column.dtype != spec.dtype.as_numpy_dtype
    if nulls or has_nulls:
        raise ValueError(
            f"Column {name!r} has null values in a batch; tf.data tensors cannot hold nulls. Fill them in Spark "
            "(df.fillna(...)), or leave the column out with schema_fields."
        )
    return column


class _Source:
    """The generator function behind the dataset: one reader per iteration, tracked so they can be stopped."""

    def __init__(self, first: Reader, again, signature: dict[str, tf.TensorSpec]):
        self._first, self._again, self._signature = first, again, signature
        self._iterations = 0
        self._live: set[Reader] = set()
        self._lock = threading.Lock()

    def _next_reader(self) -> Reader:
        with self._lock:
            k, self._iterations = self._iterations, self._iterations + 1
        if k == 0:
            return self._first
        if self._again is None:
            raise RuntimeError(
                "This tf.data.Dataset wraps a Reader, which can be read once, and is being iterated again (Keras does so "
                "each epoch); pass a dataset URL to make_tf_dataset so that each iteration reads afresh, or build the "
                "Reader with num_epochs=None and pass steps_per_epoch to fit()."
            )
        return self._again(k)

    def __call__(self) -> Iterator[dict[str, Any]]:
        reader = self._next_reader()
        with self._lock:
            self._live.add(reader)
        try:
            with reader:
                names = reader.schema.names
                for table in reader._arrow_batches():  # Arrow's null counts, before NumPy turns float nulls into NaN
                    batch = table_to_batch(table, reader.batch_type)
                    yield {name: to_tensor_input(name, column, self._signature[name], leaf_nulls(arrow) > 0)
                           for name, column, arrow in zip(names, batch, table.columns)}
        finally:
            with self._lock:
                self._live.discard(reader)

    def stop(self) -> None:
        """Stop every reader still running."""
        with self._lock:
            live, self._live = list(self._live), set()
        for reader in live:
            reader.stop()


def _build(reader_or_url, batch_size: int | None, list_lengths: Mapping[str, int] | None, reader_kwargs: dict):
    if reader_kwargs.get("decode") or (isinstance(reader_or_url, Reader) and reader_or_url._shard.decode):
        raise ValueError("make_tf_dataset does not take decode=, whose arrays' shapes its output signature cannot know "
                         "before reading; decode in the tf.data pipeline instead (dataset.map with tf.io.decode_image), "
                         "or use make_batch_reader or make_torch_loader with decode=.")
    if isinstance(reader_or_url, Reader):
        if reader_kwargs:
            raise TypeError(f"make_tf_dataset got reader options {sorted(reader_kwargs)} with an existing Reader; pass them to make_batch_reader instead, or pass a URL here.")
        if batch_size is not None and batch_size != reader_or_url.batch_size:
            raise ValueError(f"make_tf_dataset(batch_size={batch_size}) was given a Reader built with batch_size={reader_or_url.batch_size}; build the reader with make_batch_reader(..., batch_size={batch_size}), or pass batch_size=None to keep the reader's batches.")
        first, again = reader_or_url, None
    else:
        first, again = url_passes(reader_or_url, batch_size, reader_kwargs)
    signature = output_signature(first.schema, list_lengths)
    source = _Source(first, again, signature)
    dataset = tf.data.Dataset.from_generator(source, output_signature=signature)
    count = _batches_per_iteration(first)
    if count is not None:  # Keras then knows an epoch's steps, instead of running out of data in the first one
        dataset = dataset.apply(tf.data.experimental.assert_cardinality(count))
    return dataset, source


def _batches_per_iteration(reader: Reader) -> int | None:
    """The batches every iteration yields, where the plan fixes it: finite epochs of equal steps (the same count on
    every shard and for every seed), not resumed mid-way (the first iteration would be shorter); else None."""
    if reader.num_epochs is None or not reader.equal_steps or reader.resume_from is not None:
        return None
    return sum(reader.plan(epoch).num_batches for epoch in range(reader.num_epochs))


def make_tf_dataset(reader_or_url, batch_size: int | None = None, *, list_lengths: Mapping[str, int] | None = None, **reader_kwargs) -> tf.data.Dataset:
    """A ``tf.data.Dataset`` of ``{column: tensor}`` batches of ``batch_size`` rows over one shard.

    ``reader_or_url``: a dataset URL, path or list (then ``reader_kwargs`` go to
    make_batch_reader: ``cur_shard``, ``shard_count``, ``num_epochs``, ``seed``, ...), and each
    iteration of the dataset builds a fresh reader, iteration k with ``seed + k``; or a Reader
    built with the same ``batch_size`` (or pass ``batch_size=None`` to keep the reader's),
    which can be iterated once. ``batch_size=None`` with a URL keeps make_batch_reader's
    batches. Every shard yields the same number of batches per epoch (``equal_steps``).
    ``resume_from=(epoch, batch)`` (a URL only) resumes mid-epoch as in make_torch_loader:
    ``epoch`` counts the dataset's epochs over its iterations (Keras iterates once per epoch).

    The dataset's cardinality is its batch count where the plan fixes it (finite ``num_epochs``,
    ``equal_steps``, no ``resume_from``), so Keras knows an epoch's steps; otherwise it is unknown.

    ``list_lengths``: ``{column: L}`` for list columns whose rows all have length L, giving
    them static shape ``(None, L)``. Errors in the data (ragged lists, nulls, float columns'
    included, a wrong length) are raised while iterating, inside TensorFlow's ``InvalidArgumentError``.
    """
    return _build(reader_or_url, batch_size, list_lengths, reader_kwargs)[0]


class TFDatasetContext:
    """``with`` yields the dataset; leaving it stops the readers still running (Petastorm's converter API)."""

    def __init__(self, reader_or_url, batch_size: int | None = None, *, list_lengths: Mapping[str, int] | None = None, **reader_kwargs):
        self.dataset, self._source = _build(reader_or_url, batch_size, list_lengths, reader_kwargs)

    def stop(self) -> None:
        """Stop the readers still running."""
        self._source.stop()

    def __enter__(self) -> tf.data.Dataset:
        return self.dataset

    def __exit__(self, *exc_info) -> None:
        self.stop()
