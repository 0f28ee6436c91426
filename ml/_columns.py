"""The columns an estimator reads: their kinds, per-row shapes and types, checked before anything launches.

A column is a number (any Spark numeric type or boolean: shape ``()``), an array of numbers
(``(d,)``; arrays of arrays are tensors, ``(d1, d2, ...)``, flattened in Spark and reshaped on the
ranks) or an ML vector (``(d,)``). Shapes come from the first sampled row; a row of another
length fails while reading, with the column's name.
"""

from __future__ import annotations

from dataclasses import dataclass

_INTEGER = ("ByteType", "ShortType", "IntegerType", "LongType", "BooleanType")
_FLOAT = ("FloatType", "DoubleType")


@dataclass(frozen=True)
class Column:
    """One column an estimator or model reads."""

    name: str
    kind: str  # "scalar", "array" or "vector"
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


def columns_of(schema, role: str, names: list[str], who: str) -> list[Column]:
    """The Columns ``names`` of a Spark ``schema``, as ``role`` (``feature_cols``, ...); ValueError for a missing
    column or one whose type no model takes."""
    fields = {field.name: field for field in schema.fields}
    found = []
    for name in names:
        if name not in fields:
            raise ValueError(f"{who}: {role} names the column {name!r}, which the DataFrame does not have; its columns "
                             f"are {sorted(fields)}. Fix the name, or add the column before fitting.")
        described = _describe(fields[name].dataType)
        if described is None:
            raise ValueError(
                f"{who}: the {role} column {name!r} has type {fields[name].dataType.simpleString()}, which a model "
                "cannot take; use numbers, arrays of numbers or ML vectors (a StringIndexer, a VectorAssembler or a "
                "cast to double makes them), or leave the column out.")
        kind, integer, depth = described
        found.append(Column(name, kind, integer, depth, spark_type=fields[name].dataType.simpleString()))
    return found


def with_shapes(columns: list[Column], row, who: str) -> list[Column]:
    """``columns`` with each one's per-row shape, read from the sampled ``row`` (a pyspark Row)."""
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
