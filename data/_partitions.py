"""Hive-style partition folders (``key=value/``, as Spark's ``df.write.partitionBy("key")`` writes them) as columns.

A file's partition values are the ``key=value`` folders between the dataset directory and the
file, the innermost run of them, as Spark's partition discovery reads them (a folder without
``=`` above that run ends it). Keys and values are unescaped as Spark escapes them (``%3A`` is
``:``), and ``__HIVE_DEFAULT_PARTITION__`` is null. Each key's type is inferred from all its
values as Spark infers it (``spark.sql.sources.partitionColumnTypeInference.enabled``): the first
of int32, int64, decimal(p, 0) (integers beyond int64), float64 and date that every value
parses as, else string (a decimal among floats is a string too, as Spark widens the two); a key
whose values are all null is a string, and an empty value (``key=``) is refused, as Spark refuses it. Timestamps stay strings
(Spark would read them in the session's time zone).
"""

from __future__ import annotations

import datetime
import decimal
import functools
import posixpath
import re
from dataclasses import dataclass
from typing import Sequence
from urllib.parse import unquote

import pyarrow as pa
import pyarrow.dataset as ds

HIVE_NULL = "__HIVE_DEFAULT_PARTITION__"

_INT = re.compile(r"[+-]?\d+")
_FLOAT = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?|[+-]?(NaN|Infinity)")
_DATE = re.compile(r"\d{4}-\d{2}-\d{2}")
_INT32, _INT64 = (-(2**31), 2**31 - 1), (-(2**63), 2**63 - 1)


@dataclass(frozen=True)
class Partitions:
    """The partition columns of a dataset: their fields, and each file's values (in the fields' order)."""

    fields: tuple[pa.Field, ...]
    values: tuple[tuple[str, tuple], ...]  # (file path, values); a tuple of pairs, so that the dataclass hashes

    @property
    def names(self) -> list[str]:
        """The partition columns' names, outer folder first."""
        return [f.name for f in self.fields]

    @functools.cached_property
    def _by_path(self) -> dict:
        return dict(self.values)

    def of(self, path: str) -> dict:
        """``{column: value}`` of one file."""
        return dict(zip(self.names, self._by_path[path]))

    def expression(self, path: str) -> ds.Expression | None:
        """What is true of every row of the file: ``key == value`` for each partition column (``is_null`` for null)."""
        terms = [ds.field(f.name).is_null() if v is None else ds.field(f.name) == pa.scalar(v, f.type)
                 for f, v in zip(self.fields, self._by_path[path])]
        out = None
        for term in terms:
            out = term if out is None else out & term
        return out

    def columns(self, path: str, names: Sequence[str], num_rows: int) -> list[pa.Array]:
        """The named partition columns of one file's ``num_rows`` rows: each one value repeated."""
        of, types = self.of(path), {f.name: f.type for f in self.fields}
        return [pa.nulls(num_rows, types[n]) if of[n] is None else pa.repeat(pa.scalar(of[n], types[n]), num_rows)
                for n in names]


def folder_pairs(relative_dir: str) -> list[tuple[str, str | None]]:
    """The ``(key, raw value)`` pairs of the innermost run of ``key=value`` folders in a path relative to the dataset."""
    pairs: list[tuple[str, str | None]] = []
    parts = [p for p in relative_dir.split("/") if p and p != "."]
    for part in reversed(parts):
        key, sep, value = part.partition("=")
        if not sep or not key:
            break
        value = unquote(value)
        if not value:
            raise ValueError(
                f"The folder {part!r} in {relative_dir!r} is a partition folder with an empty value, which Spark "
                "refuses too (EMPTY_PARTITION_COLUMN_VALUE); rename it to "
                f"'{key}={HIVE_NULL}' for a null, or give it a value.")
        pairs.append((unquote(key), None if value == HIVE_NULL else value))
    return pairs[::-1]


def discover(files: Sequence[tuple[str, str | None]], url) -> Partitions | None:
    """The partitions of ``(path, dataset directory or None)`` pairs, or None where no file is in a ``key=value`` folder.

    Raises ``ValueError`` where files sit under different keys: Spark refuses such a dataset too.
    """
    found = {path: folder_pairs(posixpath.dirname(posixpath.relpath(path, root))) if root is not None else []
             for path, root in files}
    keys = {path: [k for k, _ in pairs] for path, pairs in found.items()}
    first = files[0][0]
    for path, _ in files:
        if keys[path] != keys[first]:
            raise ValueError(
                f"The files of {url} sit in partition folders of different keys: {first!r} under {keys[first]} and "
                f"{path!r} under {keys[path]}; Spark refuses such a dataset too (conflicting partition column names). "
                "Read each layout with a reader of its own, or move the files so that every one has the same key=value "
                "folders.")
    names = keys[first]
    if not names:
        return None
    if len(set(names)) != len(names):
        raise ValueError(f"The folders of {first!r} name the partition key(s) {names} more than once; give each "
                         "partition key one folder level.")
    fields, columns = [], []
    for i, name in enumerate(names):
        raw = [found[path][i][1] for path, _ in files]
        type_, parse = _infer([v for v in raw if v is not None])
        fields.append(pa.field(name, type_))
        columns.append([None if v is None else parse(v) for v in raw])
    values = tuple((path, tuple(column[j] for column in columns)) for j, (path, _) in enumerate(files))
    return Partitions(tuple(fields), values)


def _date(value: str) -> datetime.date:
    if not _DATE.fullmatch(value):
        raise ValueError(value)
    return datetime.date.fromisoformat(value)


def _float(value: str) -> float:
    if not _FLOAT.fullmatch(value):
        raise ValueError(value)
    return float(value.replace("Infinity", "inf"))


def _int_in(bounds: tuple[int, int]):
    def parse(value: str) -> int:
        if not _INT.fullmatch(value) or not bounds[0] <= int(value) <= bounds[1]:
            raise ValueError(value)
        return int(value)
    return parse


def _infer(values: list[str]) -> tuple[pa.DataType, object]:
    """The type of a partition column from its non-null values, and the parser of a value into it."""
    if values and all(_INT.fullmatch(v) for v in values):
        for bounds, type_ in ((_INT32, pa.int32()), (_INT64, pa.int64())):
            if all(bounds[0] <= int(v) <= bounds[1] for v in values):
                return type_, _int_in(bounds)
        digits = max(len(v.lstrip("+-").lstrip("0") or "0") for v in values)
        if digits <= 38:
            return pa.decimal128(digits, 0), decimal.Decimal
    if any(_INT.fullmatch(v) and not _INT64[0] <= int(v) <= _INT64[1] and len(v.lstrip("+-").lstrip("0")) <= 38
           for v in values):
        return pa.string(), str  # a decimal among doubles: Spark widens the two to string
    for type_, parse in ((pa.float64(), _float), (pa.date32(), _date)):
        if values and all(_parses(parse, v) for v in values):
            return type_, parse
    return pa.string(), str


def _parses(parse, value: str) -> bool:
    try:
        parse(value)
    except ValueError:
        return False
    return True
