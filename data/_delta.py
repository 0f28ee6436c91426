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
from typing import NamedTuple
from urllib.parse import unquote, urlparse

import pyarrow as pa
import pyarrow.fs as pafs

from ._partitions import Partitions

DELTA_LOG = "_delta_log"

# pyarrow.fs.S3FileSystem's argument for each of delta-rs's (object_store's) S3 options, under the names object_store
# takes for it; delta-rs takes the keys in any case
_S3_OPTIONS = {
    "endpoint": ("aws_endpoint_url", "aws_endpoint", "endpoint_url", "endpoint"),
    "allow_http": ("aws_allow_http", "allow_http"),
    "region": ("aws_region", "region", "aws_default_region", "default_region"),
    "access_key": ("aws_access_key_id", "access_key_id"),
    "secret_key": ("aws_secret_access_key", "secret_access_key"),
    "session_token": ("aws_session_token", "aws_token", "session_token", "token"),
    "virtual_hosted": ("aws_virtual_hosted_style_request", "virtual_hosted_style_request"),
}


class Listing(NamedTuple):
    """A Delta table's version as the batch reader reads it."""

    files: list[str]  # its data files: paths on ``filesystem``, or local paths or URLs where that is None
    partitions: Partitions | None  # the files' partition values, keyed as ``files``; None for an unpartitioned table
    columns: list[str]  # the table's columns in its schema's order
    filesystem: pafs.FileSystem | None  # what the files are on (an S3 table's); None: resolved from each file's URL


def _s3_filesystem(storage_options: dict) -> pafs.S3FileSystem:
    """pyarrow's S3 filesystem with the endpoint, region and credentials of delta-rs's ``storage_options``: the
    endpoint's URL gives ``endpoint_override`` and ``scheme`` (``http`` where it has none and AWS_ALLOW_HTTP is
    true), AWS_VIRTUAL_HOSTED_STYLE_REQUEST gives ``force_virtual_addressing``, and the access key with the secret
    key (both or neither) the credentials. What they do not say pyarrow takes from the environment, as delta-rs does."""
    given = {str(k).lower(): v for k, v in storage_options.items()}
    found = {arg: next((str(given[n]) for n in names if given.get(n) not in (None, "")), None)
             for arg, names in _S3_OPTIONS.items()}

    def true(arg: str) -> bool:
        return (found[arg] or "").strip().lower() in ("true", "1", "yes", "on", "y")

    kwargs: dict = {}
    if found["endpoint"] is not None:
        endpoint = found["endpoint"]
        parsed = urlparse(endpoint if "://" in endpoint else f"//{endpoint}")
        scheme = parsed.scheme or ("http" if true("allow_http") else "https")
        kwargs.update(endpoint_override=parsed.netloc, scheme=scheme)
    if found["region"] is not None:
        kwargs["region"] = found["region"]
    if found["access_key"] is not None and found["secret_key"] is not None:
        kwargs.update(access_key=found["access_key"], secret_key=found["secret_key"])
        if found["session_token"] is not None:
            kwargs["session_token"] = found["session_token"]
    if true("virtual_hosted"):
        kwargs["force_virtual_addressing"] = True
    return pafs.S3FileSystem(**kwargs)


def refuse_delta_directory(fs: pafs.FileSystem, path: str, url) -> None:
    """ValueError where ``path`` is a Delta table's directory: its Parquet files are not the table."""
    if fs.get_file_info(f"{path.rstrip('/')}/{DELTA_LOG}").type == pafs.FileType.Directory:
        raise ValueError(
            f"{url} is a Delta table (it has a {DELTA_LOG}/ folder): its Parquet files include those that deletes, "
            "updates and overwrites have removed from the table, so reading them as a plain dataset would read removed "
            "rows. Read it with sparkhvd.data.make_delta_reader(url) (pip install 'sparkhvd[delta]'), which reads the "
            "files of the table's version."
        )


def table_listing(table_uri, *, version: int | None, timestamp, storage_options: dict | None) -> Listing:
    """The files, partition values and columns of a Delta table's version. An S3 table's (``s3://``, ``s3a://``) files
    are paths on one S3 filesystem: ``_s3_filesystem(storage_options)``, or without them pyarrow's for the bucket
    (configured by the environment, as delta-rs is); another remote table's are URLs, which pyarrow resolves."""
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
    # delta-rs escapes the table's URI (a space is %20), and the log each file's path (a partition folder's Hive
    # escape, s=a%20b, is s=a%2520b there): unescaped once, each is the file's name
    root = table.table_uri.rstrip("/")
    scheme = urlparse(root).scheme if "://" in root else ""
    filesystem = None
    if scheme in ("", "file"):
        root = unquote(root[len("file://"):] if scheme else root)
    elif scheme in ("s3", "s3a"):
        parsed = urlparse(root)
        filesystem = (_s3_filesystem(storage_options) if storage_options is not None
                      else pafs.FileSystem.from_uri(f"s3://{parsed.netloc}")[0])
        root = unquote(parsed.netloc + parsed.path)  # the bucket and key, as paths on pyarrow's S3 filesystem
    as_urls = scheme not in ("", "file") and filesystem is None  # pyarrow unescapes each URL as it resolves it
    files = [f"{root}/{p if as_urls else unquote(p)}" for p in actions.column("path").to_pylist()]
    columns = list(pa.schema(table.schema().to_arrow()).names)
    keys = [name[len("partition."):] for name in actions.column_names if name.startswith("partition.")]
    if not keys:
        return Listing(files, None, columns, filesystem)
    fields = tuple(pa.field(k, actions.schema.field(f"partition.{k}").type) for k in keys)
    # Keyed by the path the reader resolves each file to: the file itself on a filesystem; pyarrow's path of a remote
    # URL is the URL without its scheme, unescaped (gs://bucket/t/s=a%2520b/x.parquet: bucket/t/s=a%20b/x.parquet)
    per_file = tuple((unquote(path.split("://", 1)[1]) if as_urls else path,
                      tuple(actions.column(f"partition.{k}")[i].as_py() for k in keys)) for i, path in enumerate(files))
    return Listing(files, Partitions(fields, per_file), columns, filesystem)
