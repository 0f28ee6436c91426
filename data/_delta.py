"""make_delta_reader: a Delta table's current (or a past) version, read by the sharded batch reader.

The table's transaction log (through ``deltalake``, delta-rs: the ``delta`` extra) says which Parquet files make up
the version and each file's partition values, typed by the table's schema; the batch reader then plans and reads
those files as any dataset, so shards stay exact and balanced. Files the log has removed (by a delete, an update, an
overwrite) are never read, though they may still sit in the table's directory, which is why make_batch_reader
refuses a Delta table's directory (``refuse_delta_directory``).
"""

from __future__ import annotations

import datetime
import os
from urllib.parse import unquote

import pyarrow as pa
import pyarrow.fs as pafs

from ._partitions import Partitions

DELTA_LOG = "_delta_log"


def refuse_delta_directory(fs: pafs.FileSystem, path: str, url) -> None:
    """ValueError where ``path`` is a Delta table's directory: its Parquet files are not the table."""
    if fs.get_file_info(f"{path.rstrip('/')}/{DELTA_LOG}").type == pafs.FileType.Directory:
        raise ValueError(
            f"{url} is a Delta table (it has a {DELTA_LOG}/ folder): its Parquet files include those that deletes, "
            "updates and overwrites have removed from the table, so reading them as a plain dataset would read removed "
            "rows. Read it with sparkhvd.data.make_delta_reader(url) (pip install 'sparkhvd[delta]'), which reads the "
            "files of the table's version."
        )


def table_listing(table_uri, *, version: int | None, timestamp, storage_options: dict | None):
    """``(files, partitions, columns)`` of a Delta table's version: its data files' URIs, their partition values as
    ``Partitions`` (None for an unpartitioned table), and the table's columns in its schema's order."""
    try:
        from deltalake import DeltaTable
    except ImportError as exc:
        raise ImportError(f"make_delta_reader needs the deltalake package (delta-rs), which is not installed ({exc}); "
                          "pip install 'sparkhvd[delta]' or pip install deltalake.") from None
    if version is not None and timestamp is not None:
        raise ValueError(f"make_delta_reader got version={version!r} and timestamp={timestamp!r}; pass one of them "
                         "(or neither, for the newest version).")
    if timestamp is not None and not isinstance(timestamp, (str, datetime.datetime)):
        raise TypeError(f"timestamp must be a datetime or an ISO 8601 string, got {type(timestamp).__name__} "
                        f"{timestamp!r}; e.g. timestamp='2026-12-01T00:00:00Z'.")
    uri = os.fspath(table_uri)
    table = DeltaTable(uri, version=version, storage_options=storage_options)
    if timestamp is not None:
        table.load_as_version(timestamp)
    mapping = table.metadata().configuration.get("delta.columnMapping.mode", "none")
    if mapping != "none":
        raise ValueError(f"The Delta table {uri!r} uses column mapping (delta.columnMapping.mode={mapping!r}), whose "
                         "Parquet files name their columns by ids, not by the table's names; sparkhvd's reader does not "
                         "map them. Read it with Spark and make_spark_converter(df) instead.")
    if not hasattr(table, "deletion_vectors") and "deletionVectors" in (table.protocol().reader_features or []):
        raise ValueError(f"The Delta table {uri!r} may have deletion vectors, which this deltalake "
                         f"({getattr(__import__('deltalake'), '__version__', '?')}) cannot list; pip install -U "
                         "deltalake (1.6 or later lists them), so that sparkhvd can tell whether the version has any.")
    with_vectors = pa.table(table.deletion_vectors().read_all()) if hasattr(table, "deletion_vectors") else None
    if with_vectors is not None and with_vectors.num_rows:
        first = with_vectors.column("filepath")[0].as_py()
        raise ValueError(
            f"Version {table.version()} of the Delta table {uri!r} has deletion vectors on {with_vectors.num_rows} "
            f"file(s) ({first}, ...): rows deleted without rewriting their files, which sparkhvd's reader does not apply "
            "yet. Rewrite them (deltalake's DeltaTable.optimize.compact(), or Spark's REORG TABLE ... APPLY (PURGE)), "
            "or read the table with Spark and make_spark_converter(df).")
    actions = pa.table(table.get_add_actions(flatten=True))
    root = table.table_uri.rstrip("/")
    local = "://" not in root or root.startswith("file://")
    if root.startswith("file://"):
        root = unquote(root[len("file://"):])  # delta-rs escapes the table's URI (a space is %20)
    files = [(f"{root}/{unquote(p)}" if local else f"{root}/{p}") for p in actions.column("path").to_pylist()]
    columns = list(pa.schema(table.schema().to_arrow()).names)
    keys = [name[len("partition."):] for name in actions.column_names if name.startswith("partition.")]
    if not keys:
        return files, None, columns
    fields = tuple(pa.field(k, actions.schema.field(f"partition.{k}").type) for k in keys)
    # Keyed by the path the reader resolves each file to: pyarrow's and fsspec's path of a remote URL is the URL
    # without its scheme (s3://bucket/t/x.parquet: bucket/t/x.parquet)
    per_file = tuple((path.split("://", 1)[1] if "://" in path else path,
                      tuple(actions.column(f"partition.{k}")[i].as_py() for k in keys)) for i, path in enumerate(files))
    return files, Partitions(fields, per_file), columns
