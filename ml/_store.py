"""``Store``: where an estimator keeps its intermediate Parquet, its runs' checkpoints and its logs.

horovod.spark's names (``Store.create(prefix_path)``, ``LocalStore``, ``HDFSStore``,
``DBFSLocalStore``, ``FilesystemStore``, ``get_run_path``, ...), on any filesystem pyarrow or fsspec
knows: a local path, ``file://``, ``s3://``, ``gs://``, ``hdfs://``, ``abfs://``, ``memory://``. Under
the prefix::

    intermediate_train_data/        the DataFrames written as Parquet (the converter's cache directories)
    runs/<run_id>/run.json          which model the run trains, written by its first fit
    runs/<run_id>/checkpoints/      one directory per finished epoch (``_checkpoints.py``)
    runs/<run_id>/model-<digest>.*  each fit's model, its own file (named by its content), which transform loads
    runs/<run_id>/logs/

Every worker must reach the prefix: a local path works on one machine (and on ``/dbfs``).
"""

from __future__ import annotations

import os
import posixpath
import uuid

import pyarrow.fs as pafs

from ..data._metadata import resolve_url

__all__ = ["DBFSLocalStore", "FilesystemStore", "HDFSStore", "LocalStore", "Store"]


def _as_url(prefix_path: str) -> str:
    """A URL for ``prefix_path``: a local path becomes ``file://`` (what Spark's writers and pyarrow both read)."""
    if "://" in prefix_path:
        return prefix_path.rstrip("/")
    return "file://" + os.path.abspath(os.path.expanduser(prefix_path))


class Store:
    """Storage for an estimator's data, checkpoints and logs, under one prefix every worker reaches."""

    def __init__(self, prefix_path: str):
        if not isinstance(prefix_path, (str, os.PathLike)) or not os.fspath(prefix_path):
            raise ValueError(f"Store needs a path or URL every worker can reach, got {prefix_path!r}; pass e.g. "
                             "'/dbfs/tmp/hvd', 'file:///shared/hvd' or 's3://bucket/hvd'.")
        self.prefix_path = os.fspath(prefix_path)
        # The URL's query (s3://bucket/hvd?endpoint_override=... for an S3-compatible store) configures the
        # filesystem; the store's URLs are the prefix's without it, so that paths join after the prefix.
        self.url, _, self._query = _as_url(self.prefix_path).partition("?")
        self._fs: pafs.FileSystem | None = None
        self._root: str | None = None

    @classmethod
    def create(cls, prefix_path: str, *args, **kwargs) -> Store:
        """The Store for ``prefix_path`` (horovod.spark's factory); one class serves every filesystem, and ``dbfs:/``
        paths are read through the ``/dbfs`` mount."""
        if cls is Store and os.fspath(prefix_path).startswith("dbfs:/"):
            return DBFSLocalStore(prefix_path)
        return cls(prefix_path, *args, **kwargs)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.prefix_path!r})"

    def __eq__(self, other) -> bool:
        return isinstance(other, Store) and other.url == self.url

    def __hash__(self) -> int:
        return hash(self.url)

    def __getstate__(self) -> dict:
        return {"prefix_path": self.prefix_path, "url": self.url}  # a filesystem object need not pickle

    def __setstate__(self, state: dict) -> None:
        self.prefix_path, self.url = state["prefix_path"], state["url"]
        self._query = _as_url(self.prefix_path).partition("?")[2]
        self._fs = self._root = None

    # ---- where things are (URLs, under the prefix) ----

    def get_data_path(self) -> str:
        """The parent of the intermediate Parquet directories (the converter's cache)."""
        return f"{self.url}/intermediate_train_data"

    def get_run_path(self, run_id: str) -> str:
        return f"{self.url}/runs/{run_id}"

    def get_checkpoint_path(self, run_id: str) -> str:
        return f"{self.get_run_path(run_id)}/checkpoints"

    def get_logs_path(self, run_id: str) -> str:
        return f"{self.get_run_path(run_id)}/logs"

    # ---- the filesystem ----

    @property
    def filesystem(self) -> pafs.FileSystem:
        if self._fs is None:
            self._fs, self._root = resolve_url(f"{self.url}?{self._query}" if self._query else self.url)
        return self._fs

    def path_of(self, url: str) -> str:
        """The filesystem path of ``url``, a URL under this store's prefix."""
        if not url.startswith(self.url):
            raise ValueError(f"{url!r} is not under the store's prefix {self.url!r}.")
        self.filesystem  # resolves _root
        return self._root + url[len(self.url):]

    def exists(self, url: str) -> bool:
        return self.filesystem.get_file_info(self.path_of(url)).type != pafs.FileType.NotFound

    def read(self, url: str) -> bytes:
        with self.filesystem.open_input_stream(self.path_of(url)) as f:
            return f.read()

    def write(self, url: str, data: bytes) -> None:
        """Write ``data`` to ``url`` (its directory created), replacing a file there."""
        path = self.path_of(url)
        self.filesystem.create_dir(posixpath.dirname(path), recursive=True)
        with self.filesystem.open_output_stream(path) as f:
            f.write(data)

    def write_text(self, url: str, text: str) -> None:
        self.write(url, text.encode())

    def open_input(self, url: str):
        return self.filesystem.open_input_stream(self.path_of(url))

    def open_output(self, url: str):
        path = self.path_of(url)
        self.filesystem.create_dir(posixpath.dirname(path), recursive=True)
        return self.filesystem.open_output_stream(path)

    def delete(self, url: str) -> None:
        """Delete the file or directory ``url``; nothing there is fine."""
        path = self.path_of(url)
        info = self.filesystem.get_file_info(path)
        if info.type == pafs.FileType.Directory:
            self.filesystem.delete_dir(path)
        elif info.type == pafs.FileType.File:
            self.filesystem.delete_file(path)

    def list_dir(self, url: str) -> list[str]:
        """The names directly under ``url`` (sorted); [] where it does not exist."""
        path = self.path_of(url)
        if self.filesystem.get_file_info(path).type != pafs.FileType.Directory:
            return []
        return sorted(posixpath.basename(info.path) for info in self.filesystem.get_file_info(pafs.FileSelector(path)))

    def check_writable(self) -> None:
        """Write and delete a small file under the prefix; raise ``OSError`` with the cause and fix when that fails."""
        probe = f"{self.url}/.sparkhvd-probe-{uuid.uuid4().hex}"
        try:
            self.write(probe, b"ok")
            self.delete(probe)
        except (OSError, ValueError) as exc:
            raise OSError(f"The store {self.prefix_path!r} cannot be written ({type(exc).__name__}: {exc}); pass a "
                          "Store on a path that the driver and every executor can write, such as "
                          "Store.create('/dbfs/tmp/hvd') or Store.create('s3://bucket/hvd').") from exc


# horovod.spark's classes, one per filesystem there; here one Store serves them all.
class LocalStore(Store):
    """A Store on a local (or locally mounted, shared) path: horovod.spark's ``LocalStore``."""


class FilesystemStore(Store):
    """A Store on any pyarrow or fsspec URL: horovod.spark's ``FilesystemStore``."""


class HDFSStore(Store):
    """A Store on ``hdfs://``: horovod.spark's ``HDFSStore``."""


class DBFSLocalStore(Store):
    """A Store on Databricks' ``/dbfs`` FUSE mount: horovod.spark's ``DBFSLocalStore``; ``dbfs:/x`` is read as ``/dbfs/x``."""

    def __init__(self, prefix_path: str):
        text = os.fspath(prefix_path)
        if text.startswith("dbfs:/"):
            text = "/dbfs/" + text[len("dbfs:/"):].lstrip("/")
        super().__init__(text)
