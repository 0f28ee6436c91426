"""Arrow tables to NumPy batches, and re-cutting a stream of tables into batches of given sizes."""

from __future__ import annotations

from collections import namedtuple
from typing import Iterable, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc


def batch_type(names: list[str]) -> type:
    """The namedtuple type of a batch (Petastorm's name); invalid identifiers become ``_0``, ``_1``, ..."""
    return namedtuple("inferred_schema_view", names, rename=True)


def _list_to_numpy(arr: pa.Array) -> np.ndarray:
    n = len(arr)
    if pa.types.is_fixed_size_list(arr.type):
        width = arr.type.list_size
        lengths = None if arr.null_count == 0 else pc.fill_null(pc.list_value_length(arr), 0).to_numpy()
    else:
        lengths = pc.fill_null(pc.list_value_length(arr), 0).to_numpy()
        width = int(lengths[0]) if n else 0
        if arr.null_count == 0 and (lengths == width).all():
            lengths = None
    values = array_to_numpy(arr.flatten())
    if lengths is None:  # every row has the same length: one (n, width, ...) array
        return values.reshape((n, width) + values.shape[1:])
    ends = np.cumsum(lengths)
    out = np.empty(n, dtype=object)
    valid = arr.is_valid().to_numpy(zero_copy_only=False)
    for i in range(n):
        out[i] = values[ends[i] - lengths[i] : ends[i]] if valid[i] else None
    return out


def array_to_numpy(arr: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """One column as NumPy: lists of equal length become an (n, width) array, ragged lists an object array of arrays.

    Numeric columns without nulls are zero-copy views of Arrow memory, hence read-only.
    Whether a ``list<...>`` column is 2-D is decided per batch, as in Petastorm: a batch whose
    rows all have the same length is 2-D. ``fixed_size_list`` columns are always 2-D (unless null).
    """
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.chunk(0) if arr.num_chunks == 1 else arr.combine_chunks()
    if pa.types.is_dictionary(arr.type):
        arr = arr.dictionary_decode()
    if isinstance(arr.type, pa.FixedShapeTensorType):  # a decode= column: one (rows, *shape) array
        return arr.to_numpy_ndarray()
    if pa.types.is_list(arr.type) or pa.types.is_large_list(arr.type) or pa.types.is_fixed_size_list(arr.type):
        return _list_to_numpy(arr)
    return arr.to_numpy(zero_copy_only=False)


def table_to_batch(table: pa.Table, kind: type) -> tuple:
    """A table as a ``kind`` namedtuple of NumPy arrays, one per column."""
    return kind(*(array_to_numpy(col) for col in table.columns))


def rebatch(tables: Iterable[pa.Table], sizes: Iterable[int]) -> Iterator[pa.Table]:
    """Re-cut ``tables`` into tables of exactly ``sizes`` rows; the sizes must add up to their rows.

    A batch inside one table is a zero-copy slice; a batch across tables is concatenated.
    Running out of rows is a bug in the plan or a file that changed, so it raises.
    """
    tables = iter(tables)
    head: pa.Table | None = None
    offset = 0
    for size in sizes:
        parts = []
        need = size
        while need:
            while head is None or offset == head.num_rows:
                head = next(tables, None)
                offset = 0
                if head is None:
                    raise RuntimeError(f"The shard's row groups ran out {need} rows short of a batch of {size}; this is a bug in sparkhvd.data's plan, please report it.")
            take = min(need, head.num_rows - offset)
            parts.append(head.slice(offset, take))
            offset += take
            need -= take
        yield parts[0] if len(parts) == 1 else pa.concat_tables(parts)
