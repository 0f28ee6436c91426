"""The columns an estimator reads: their kinds, per-row shapes and types, checked before anything launches.

A column is a number (any Spark numeric type or boolean: shape ``()``), an array of numbers
(``(d,)``; arrays of arrays are tensors, ``(d1, d2, ...)``, flattened in Spark and reshaped on the
ranks) or an ML vector (``(d,)``). A binary feature column (encoded images) is taken where the
estimator's ``decode={column: fn}`` names it: ``fn(cell bytes)`` gives the row's array, in the
readers' threads on the ranks (data/_decode.py) and in ``transform``'s UDF. Shapes come from the
first sampled row (decoded on the driver); a row of another length fails while reading, with the
column's name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import numpy as np

_INTEGER = ("ByteType", "ShortType", "IntegerType", "LongType", "BooleanType")
_FLOAT = ("FloatType", "DoubleType")


@dataclass(frozen=True)
class Column:
    """One column an estimator or model reads."""

    name: str
    kind: str  # "scalar", "array", "vector", or "decoded": binary, made an array per row by decode=
    integer: bool  # integer or boolean elements (labels stay integers: class indices)
    depth: int  # array nesting: 0 for scalars and vectors, 1 for arrays, 2+ for tensors
    shape: tuple[int, ...] = ()  # per row; filled in from a sampled row
    spark_type: str = ""

    def to_dict(self) -> dict:
        return {"name": self.name, "kind": self.kind, "integer": self.integer, "depth": self.depth,
                "shape": list(self.shape), "spark_type": self.spark_type}

    @classmethod
    def from_dict(cls, d: dict) -> Column:
        return cls(d["name"], d["kind"], d["integer"], d["depth"], tuple(d["shape"]), d["spark_type"])


def _describe(field_type) -> tuple[str, bool, int] | None:
    """``(kind, integer, depth)`` of a Spark type a model can take; None for any other."""
    name = type(field_type).__name__
    if name == "VectorUDT":
        return "vector", False, 0
    if name in _INTEGER or name in _FLOAT:
        return "scalar", name in _INTEGER, 0
    depth, inner = 0, field_type
    while type(inner).__name__ == "ArrayType":
        depth, inner = depth + 1, inner.elementType
    if depth and (type(inner).__name__ in _INTEGER or type(inner).__name__ in _FLOAT):
        return "array", type(inner).__name__ in _INTEGER, depth
    return None


_DECODE_EXAMPLE = "lambda data: np.asarray(PIL.Image.open(io.BytesIO(data)).convert('RGB'))"


def columns_of(schema, role: str, names: list[str], who: str, decoded=()) -> list[Column]:
    """The Columns ``names`` of a Spark ``schema``, as ``role`` (``feature_cols``, ...); ValueError for a missing
    column or one whose type no model takes. A binary column named in ``decoded`` (decode='s columns) is taken."""
    fields = {field.name: field for field in schema.fields}
    found = []
    for name in names:
        if name not in fields:
            raise ValueError(f"{who}: {role} names the column {name!r}, which the DataFrame does not have; its columns "
                             f"are {sorted(fields)}. Fix the name, or add the column before fitting.")
        binary = type(fields[name].dataType).__name__ == "BinaryType"
        if binary and name in decoded:
            found.append(Column(name, "decoded", False, 0, spark_type="binary"))
            continue
        if binary and role == "feature_cols":
            raise ValueError(
                f"{who}: the feature_cols column {name!r} holds bytes (binary), which a model cannot take as they "
                f"are; pass decode={{{name!r}: fn}}, a function from a cell's bytes to a NumPy array of numbers, e.g. "
                f"decode={{{name!r}: {_DECODE_EXAMPLE}}}, or leave the column out.")
        described = _describe(fields[name].dataType)
        if described is None:
            raise ValueError(
                f"{who}: the {role} column {name!r} has type {fields[name].dataType.simpleString()}, which a model "
                "cannot take; use numbers, arrays of numbers or ML vectors (a StringIndexer, a VectorAssembler or a "
                "cast to double makes them), or leave the column out.")
        kind, integer, depth = described
        found.append(Column(name, kind, integer, depth, spark_type=fields[name].dataType.simpleString()))
    return found


def check_decode(decode, schema, features: list[str], who: str) -> dict | None:
    """The estimator's ``decode`` as ``{feature column: function}`` (None for none); ValueError where it is not a
    dict of functions, or names a column that is not a binary feature column."""
    if not decode:
        return None
    if not isinstance(decode, Mapping) or not all(isinstance(k, str) and callable(v) for k, v in decode.items()):
        raise ValueError(f"{who}: decode must map feature column names to functions, got {decode!r}; e.g. "
                         f"decode={{'image': {_DECODE_EXAMPLE}}}.")
    fields = {field.name: field for field in schema.fields}
    for name in decode:
        if name not in features:
            raise ValueError(f"{who}: decode names the column {name!r}, which is not a feature column (feature_cols "
                             f"{list(features)}); decode turns a binary feature column into arrays, and labels stay "
                             f"numbers: add {name!r} to feature_cols, or drop it from decode.")
        if name in fields and type(fields[name].dataType).__name__ != "BinaryType":
            raise ValueError(f"{who}: decode names the feature column {name!r}, which has type "
                             f"{fields[name].dataType.simpleString()}, not binary; decode turns bytes (encoded images) "
                             f"into arrays, and the estimator takes this column as it is: drop {name!r} from decode.")
    return dict(decode)


def decoded_row(row, columns: list[Column], decode: dict | None, who: str) -> dict:
    """The sampled ``row`` (a pyspark Row) as a dict, each decoded column's bytes replaced by ``decode``'s array for
    them, as the ranks' readers will decode it; ValueError where the function fails or gives no numeric array."""
    values = row.asDict()
    for column in columns:
        cell = values[column.name]
        if column.kind != "decoded" or cell is None:  # a null: with_shapes says so
            continue
        cell = bytes(cell)  # a Row holds a bytearray; the readers and transform hand fn bytes
        try:
            returned = decode[column.name](cell)
        except Exception as exc:
            raise ValueError(f"{who}: decode[{column.name!r}] fails on the first row's cell ({len(cell)} bytes): "
                             f"{type(exc).__name__}: {exc}. Fix the function: it gets a cell's bytes and returns a "
                             "NumPy array of numbers.") from exc
        try:
            array = np.asarray(returned)
        except ValueError:  # a ragged list
            array = np.asarray(None)
        if array.dtype.kind not in "biuf":
            raise ValueError(f"{who}: decode[{column.name!r}] returned {type(returned).__name__} "
                             f"{_short(returned)} for the first row's cell, not an array of numbers; return a NumPy "
                             f"array of numbers, e.g. decode={{{column.name!r}: {_DECODE_EXAMPLE}}}.")
        values[column.name] = array
    return values


def _short(value) -> str:
    shown = repr(value)
    return shown if len(shown) <= 60 else shown[:57] + "..."


def with_shapes(columns: list[Column], row, who: str) -> list[Column]:
    """``columns`` with each one's per-row shape, read from the sampled ``row`` (a pyspark Row, or ``decoded_row``'s
    dict)."""
    shaped = []
    for column in columns:
        value = row[column.name]
        if value is None:
            raise ValueError(f"{who}: the column {column.name!r} is null in the first row; a model cannot take nulls: "
                             "fill them (DataFrame.fillna) or drop those rows (DataFrame.dropna) before fitting.")
        shaped.append(Column(column.name, column.kind, column.integer, column.depth, _shape(value, column),
                             column.spark_type))
    return shaped


def _shape(value, column: Column) -> tuple[int, ...]:
    if column.kind == "scalar":
        return ()
    if column.kind == "vector":
        return (int(value.size),)
    if column.kind == "decoded":
        return tuple(int(d) for d in np.shape(value))
    shape = []
    for _ in range(column.depth):
        shape.append(len(value))
        value = value[0] if len(value) else []
    return tuple(shape)


def numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def count_values(n: int) -> str:
    """``n`` values, in words: "1 value", "3 values"."""
    return f"{n} value" if n == 1 else f"{n} values"
