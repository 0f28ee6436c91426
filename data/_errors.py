"""The errors that sparkhvd.data raises.

Each one subclasses the builtin that a caller would catch anyway (``ValueError``,
``FileNotFoundError``, ``RuntimeError``), so ``except ValueError`` keeps working.
"""

from __future__ import annotations


class EmptyShardError(ValueError):
    """A shard would receive no rows: more shards than rows, or a filter that matches nothing."""


class SchemaError(ValueError, RuntimeError):
    """A requested column or a filter does not match the dataset's columns (a RuntimeError too, as Petastorm's is)."""


class DatasetNotFoundError(FileNotFoundError):
    """The dataset path does not exist or holds no Parquet files."""


class ReadError(RuntimeError):
    """A file could not be read: a bad footer at planning time, or a row group at read time."""


class ArgumentTypeError(TypeError, ValueError):
    """An argument of the wrong type (``num_epochs='abc'``, ``make_reader(None)``): a TypeError, and a ValueError as
    Petastorm raises for it."""
