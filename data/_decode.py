"""The ``decode=`` hook: a column's cells turned into NumPy arrays by the user's function, in the prefetch threads.

``decode={"image": fn}``: ``fn(cell)`` for each non-null cell of the column (``bytes`` for a binary column, the
cell's Python value otherwise) returns a NumPy array (or a number); a row group's decoded cells must share one shape
and dtype, and become an Arrow fixed-shape tensor column, which batches as one ``(rows, *shape)`` array. Running in
the reader's threads, it decodes ahead of the training loop, as Petastorm's codecs and TransformSpec do, while
pyarrow's reads release the GIL (a decoder that holds it, pure Python, runs no faster than in the loop).
"""

from __future__ import annotations

from typing import Callable, Mapping

import numpy as np
import pyarrow as pa

from ._errors import ArgumentTypeError


def check(decode, columns: list[str]) -> dict[str, Callable] | None:
    """``decode`` as ``{column: function}``, every column one the reader yields; None for no decoding."""
    if decode is None:
        return None
    if not isinstance(decode, Mapping) or not all(isinstance(k, str) and callable(v) for k, v in decode.items()):
        raise ArgumentTypeError(f"decode must map column names to functions, got {decode!r}; e.g. "
                        "decode={'image': lambda data: np.asarray(PIL.Image.open(io.BytesIO(data)))}.")
    unknown = [c for c in decode if c not in columns]
    if unknown:
        raise ValueError(f"decode names column(s) {unknown} that the reader does not yield; its columns are {columns}.")
    return dict(decode)


def apply(table: pa.Table, decode: dict[str, Callable], where: str) -> pa.Table:
    """``table`` with each decoded column replaced by its fixed-shape tensor column (``where``: the row group, for
    messages)."""
    for name, fn in decode.items():
        cells = table.column(name).to_pylist()
        if any(cell is None for cell in cells):
            raise ValueError(f"Column {name!r} has a null in {where}, which decode cannot turn into an array; filter "
                             f"the nulls out (filters=[({name!r}, 'is_valid')] is not DNF: use "
                             f"pyarrow.dataset.field({name!r}).is_valid()) or fill them.")
        try:
            arrays = [np.asarray(fn(cell)) for cell in cells]
        except Exception as exc:
            if hasattr(exc, "add_note"):
                exc.add_note(f"sparkhvd.data: raised by decode[{name!r}] on a cell of {where}.")
            raise
        shapes = {(a.shape, a.dtype.str) for a in arrays}
        if len(shapes) > 1:
            (s1, d1), (s2, d2) = sorted(shapes)[:2]
            raise ValueError(f"decode[{name!r}] returned arrays of different shapes or dtypes in {where}: {s1} {d1} "
                             f"and {s2} {d2}; return one shape and dtype for every cell (resize or cast in decode), "
                             "so that a batch is one array.")
        if not arrays:
            continue
        stacked = np.stack(arrays)
        column = (pa.array(stacked) if stacked.ndim == 1
                  else pa.FixedShapeTensorArray.from_numpy_ndarray(np.ascontiguousarray(stacked)))
        table = table.set_column(table.column_names.index(name), name, column)
    return table
