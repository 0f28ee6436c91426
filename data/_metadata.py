"""Finding a dataset's Parquet files and reading their footers into plan pieces.

The only I/O of planning: it lists files, reads each footer (in threads), checks the
requested columns, and when there are ``filters`` counts the matching rows of each row group
(reading only the filter's columns), so that the plan balances the rows that pass.
"""

from __future__ import annotations

import functools
import os
import posixpath
import re
import warnings
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Sequence
from urllib.parse import unquote, urlparse

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from ._delta import refuse_delta_directory
from ._errors import ArgumentTypeError, DatasetNotFoundError, ReadError, SchemaError
from ._partitions import Partitions, discover
from ._plan import Piece


@dataclass(frozen=True)
class Dataset:
    """A planned dataset: its files, the columns to read and the pieces of the plan."""

    url: str  # as the user gave it, for messages
    filesystem: pafs.FileSystem
    files: tuple[str, ...]
    schema: pa.Schema  # the columns to read, in the order they are yielded
    pieces: tuple[Piece, ...]
    filter: ds.Expression | None
    partitions: Partitions | None = None  # the key=value folders' columns, None where the files are in none
    full_schema: pa.Schema | None = None  # the files' columns, then the partition columns
    absent: tuple[tuple[str, tuple[str, ...]], ...] = ()  # (file, columns read that it lacks): null in its rows

    @functools.cached_property
    def _absent(self) -> dict:
        return dict(self.absent)

    def absent_in(self, path: str) -> tuple[str, ...]:
        """The columns read that the file lacks (``fill_missing``): null in its rows."""
        return self._absent.get(path, ())

    @property
    def file_columns(self) -> list[str]:
        """The columns to read that the files hold (the others come from partition folders)."""
        in_folders = set(self.partitions.names) if self.partitions is not None else set()
        return [c for c in self.schema.names if c not in in_folders]

    @property
    def num_rows(self) -> int:
        """Rows in the dataset after filters."""
        return sum(p.num_rows for p in self.pieces)


_SECRET_PARAM = re.compile(r"(?i)(key|secret|token|password|credential|signature)")


def redact(url) -> str:
    """A URL as messages show it: the values of its query parameters that hold credentials (pyarrow's
    ``access_key``, ``secret_key``, ``session_token``, ...) and a password in it as ``***``."""
    text = str(url)
    parsed = urlparse(text)
    if not parsed.scheme or (not parsed.query and "@" not in parsed.netloc):
        return text
    query = "&".join(f"{k}=***" if _SECRET_PARAM.search(k) else f"{k}={v}" if sep else k
                     for k, sep, v in (part.partition("=") for part in parsed.query.split("&") if part))
    netloc = parsed.netloc
    if "@" in netloc:
        user, _, host = netloc.rpartition("@")
        netloc = f"{user.split(':', 1)[0]}:***@{host}" if ":" in user else f"***@{host}"
    return parsed._replace(netloc=netloc, query=query).geturl()


def _secrets(url) -> list[str]:
    """The credential values a URL holds (its password, and the values of its credential query parameters)."""
    parsed = urlparse(str(url))
    found = [v for k, _, v in (part.partition("=") for part in parsed.query.split("&")) if v and _SECRET_PARAM.search(k)]
    if parsed.password:
        found.append(parsed.password)
    return found


def scrub(message: str, url) -> str:
    """``message`` (a library's error text, which may quote the URL) with ``url``'s credentials as ``***``."""
    for secret in _secrets(url):
        for form in {secret, unquote(secret)}:  # as written in the URL, and as a library may quote it decoded
            message = message.replace(form, "***")
    return message


def _describe(url_or_urls) -> str:
    if isinstance(url_or_urls, (list, tuple)):
        shown = ", ".join(repr(redact(u)) for u in url_or_urls[:3])
        return f"[{shown}{', ...' if len(url_or_urls) > 3 else ''}]"
    return repr(redact(url_or_urls))


def resolve_url(url: str | os.PathLike, storage_options: dict | None = None, filesystem=None) -> tuple[pafs.FileSystem, str]:
    """The filesystem and path of a local path, a ``file://`` URL, or any URL pyarrow.fs or fsspec knows.

    ``filesystem`` (Petastorm's argument): a pyarrow or fsspec filesystem that the URL's path is on; ``storage_options``:
    fsspec's options, with which the URL goes through fsspec.
    """
    try:
        text = os.fspath(url)
    except TypeError:
        text = None
    if not isinstance(text, str):
        raise ArgumentTypeError(f"Dataset URLs must be str or os.PathLike, got {type(url).__name__} {url!r}; pass a path such as '/data/train'.")
    parsed = urlparse(text)
    if filesystem is not None:  # the path on it: an object store's bucket and key (Petastorm's rule), else the path
        if len(parsed.scheme) <= 1:
            path = text
        elif parsed.scheme in ("s3", "s3a", "s3n", "gs", "gcs"):
            path = unquote(parsed.netloc + parsed.path)
        else:
            path = unquote(parsed.path)
        return _as_pyarrow(filesystem), path
    if parsed.scheme in ("s3a", "s3n"):  # Hadoop's names for S3, as Spark writes them: pyarrow's s3://
        text, parsed = "s3" + text[len(parsed.scheme):], parsed._replace(scheme="s3")
    if storage_options is not None:
        return _fsspec(text, parsed.scheme or "file", storage_options)
    if parsed.scheme == "file":
        if parsed.netloc not in ("", "localhost"):
            raise ValueError(f"The file URL {text!r} names host {parsed.netloc!r}; file URLs must be local, e.g. 'file:///data/train'.")
        return pafs.LocalFileSystem(), os.path.abspath(unquote(parsed.path))
    if len(parsed.scheme) > 1:  # a one-letter scheme is a Windows drive
        try:
            return pafs.FileSystem.from_uri(text)
        except pa.ArrowInvalid as exc:
            if "Unrecognized filesystem type" not in str(exc):
                raise ValueError(f"pyarrow could not open the URL {redact(text)!r}: {scrub(str(exc), text)}; fix the "
                                 "URL (see pyarrow.fs.FileSystem.from_uri), or pass filesystem= with the filesystem "
                                 "and the path on it.") from None
        return _fsspec(text, parsed.scheme)
    return pafs.LocalFileSystem(), os.path.abspath(text)


def _as_pyarrow(filesystem) -> pafs.FileSystem:
    """A pyarrow filesystem as is, an fsspec one wrapped for pyarrow."""
    if isinstance(filesystem, pafs.FileSystem):
        return filesystem
    import fsspec

    if isinstance(filesystem, fsspec.AbstractFileSystem):
        return pafs.PyFileSystem(pafs.FSSpecHandler(filesystem))
    raise ArgumentTypeError(f"filesystem must be a pyarrow.fs.FileSystem or an fsspec filesystem, got "
                            f"{type(filesystem).__name__} {filesystem!r}; e.g. filesystem=pyarrow.fs.S3FileSystem(...), "
                            "or leave it out and pass a URL.")


def _fsspec(url: str, scheme: str, storage_options: dict | None = None) -> tuple[pafs.FileSystem, str]:
    """A URL pyarrow has no filesystem for (or one with fsspec options), through fsspec (which torch installs),
    wrapped for pyarrow."""
    import fsspec

    try:
        fs, path = fsspec.core.url_to_fs(url, **(storage_options or {}))
    except TypeError as exc:  # an option the scheme's filesystem does not take
        raise ValueError(f"fsspec could not open {redact(url)!r} with storage_options {sorted(storage_options or {})}: {exc}; "
                         f"pass only options that fsspec's {scheme}:// filesystem takes.") from exc
    except (ImportError, ValueError) as exc:
        raise ValueError(f"Neither pyarrow nor fsspec has a filesystem for {scheme}:// in {redact(url)!r} ({exc}); install "
                         "the fsspec package for that scheme (s3fs, gcsfs, adlfs, ...), or use a path every worker "
                         "can read.") from exc
    return pafs.PyFileSystem(pafs.FSSpecHandler(fs)), path


def _hidden(relative: str) -> bool:
    # pyarrow.dataset's rule: Spark's _SUCCESS, _temporary/ and .crc files are not data.
    return any(part.startswith(("_", ".")) for part in relative.split("/"))


def list_files(url_or_urls, **where) -> tuple[pafs.FileSystem, list[str]]:
    """The filesystem and sorted Parquet files of a path, a URL, or a list of them (files or directories);
    ``where``: resolve_url's ``storage_options`` and ``filesystem``."""
    filesystem, found = find_files(url_or_urls, **where)
    return filesystem, [path for path, _ in found]


def find_files(url_or_urls, **where) -> tuple[pafs.FileSystem, list[tuple[str, str | None]]]:
    """The filesystem and the Parquet files of a path, a URL, or a list of them, sorted, each with the directory it
    was found in (None for a file listed as such): partition folders are read from the path below it."""
    urls = list(url_or_urls) if isinstance(url_or_urls, (list, tuple)) else [url_or_urls]
    if not urls:
        raise ValueError("dataset_url_or_urls is an empty list; pass a directory, a file, or a non-empty list of them.")
    resolved = [resolve_url(u, **where) for u in urls]
    filesystem = resolved[0][0]
    files: list[tuple[str, str | None]] = []
    for url, (fs, path) in zip(urls, resolved):
        if fs.type_name != filesystem.type_name:
            raise ValueError(
                f"All dataset URLs must be on one filesystem, but {redact(urls[0])!r} is on {filesystem.type_name} "
                f"and {redact(url)!r} is on {fs.type_name}; read them with separate readers."
            )
        info = fs.get_file_info(path)
        if info.type == pafs.FileType.NotFound:
            raise DatasetNotFoundError(f"The dataset path {redact(url)!r} does not exist ({path}); check the path, and on a cluster make sure every worker can see it (a shared filesystem or a remote URL).")
        if info.type == pafs.FileType.File:
            files.append((path, None))
            continue
        refuse_delta_directory(fs, path, repr(redact(url)))
        found = [
            entry.path
            for entry in fs.get_file_info(pafs.FileSelector(path, recursive=True))
            if entry.type == pafs.FileType.File and not _hidden(posixpath.relpath(entry.path, path))
        ]
        if not found:
            raise DatasetNotFoundError(
                f"No Parquet files found under {redact(url)!r} ({path}); files whose names start with '_' or '.' are "
                "skipped. Point dataset_url_or_urls at the directory that holds the part files."
            )
        files.extend((found_path, path) for found_path in found)
    counts = Counter(path for path, _ in files)
    twice = sorted(path for path, n in counts.items() if n > 1)
    if twice:  # read as often as listed, as Petastorm (pyarrow's dataset) reads them
        warnings.warn(f"The file {twice[0]!r}{f' and {len(twice) - 1} more' if len(twice) > 1 else ''} is listed more "
                      f"than once in {_describe(url_or_urls)} (directly or inside a listed directory), so its rows are "
                      "read as many times each epoch; list each file once to read them once.", stacklevel=4)
    return filesystem, sorted(files, key=lambda found: found[0])


def _footer(fs: pafs.FileSystem, path: str) -> pq.FileMetaData:
    try:
        with fs.open_input_file(path) as f:
            return pq.ParquetFile(f).metadata
    except (OSError, pa.ArrowException) as exc:
        raise ReadError(f"Could not read the Parquet footer of {path!r}: {type(exc).__name__}: {exc}. Remove the file from the dataset or rewrite it; only Parquet files may sit in the dataset directory.") from exc


def to_expression(filters) -> ds.Expression | None:
    """``filters`` as a pyarrow Expression: an Expression as is, a DNF list through pyarrow.parquet."""
    if filters is None or isinstance(filters, ds.Expression):
        return filters
    if isinstance(filters, (list, tuple)):
        try:
            return pq.filters_to_expression(filters)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"filters={filters!r} is not a valid DNF filter list ({exc}); use e.g. [('label', '=', 3)] or pyarrow.dataset.field('label') == 3.") from exc
    raise ArgumentTypeError(f"filters must be a pyarrow.dataset.Expression or a DNF list such as [('label', '=', 3)], got {type(filters).__name__}: {filters!r}.")


def _count_matching(fs: pafs.FileSystem, path: str, num_row_groups: int, expr: ds.Expression, columns: list[str],
                    schema: pa.Schema | None = None, partition: ds.Expression | None = None) -> list[int]:
    """The rows of each row group of a file that pass ``expr``; ``schema`` and ``partition``: the dataset's schema
    with its partition columns, and what the file's folders say of them."""
    fmt = ds.ParquetFileFormat()
    try:
        if partition is None:
            return [fmt.make_fragment(path, filesystem=fs, row_groups=[i]).count_rows(filter=expr) for i in range(num_row_groups)]
        return [fmt.make_fragment(path, filesystem=fs, partition_expression=partition, row_groups=[i])
                .scanner(schema=schema, filter=expr).count_rows() for i in range(num_row_groups)]
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError) as exc:
        detail = " ".join(str(exc).split())
        raise SchemaError(f"filters {expr} could not be applied to {path!r}: {detail}. Filters may only name columns of the dataset, which are {columns}.") from exc


_REGEX_CHARS = frozenset(".^$*+?{}[]\\|()")


def select_columns(schema_fields, available: list[str]) -> list[str]:
    """The columns ``schema_fields`` names, in order: each entry a column's name, or else a regular expression that
    matches whole names (Petastorm's rule), which stands for every column it matches, in the dataset's order."""
    if schema_fields is None:
        return list(available)
    if isinstance(schema_fields, str) or not all(isinstance(f, str) for f in schema_fields):
        raise ArgumentTypeError(f"schema_fields must be a list of column names or patterns, got {schema_fields!r}; e.g. schema_fields=['features', 'label'] or ['id', 'float.*'].")
    wanted = list(schema_fields)
    if not wanted:
        raise ValueError(f"schema_fields is empty; name at least one of the columns {available}, or pass None to read them all.")
    if len(set(wanted)) != len(wanted):
        raise ValueError(f"schema_fields {wanted} names a column more than once; name each column once.")
    out: list[str] = []
    for entry in wanted:
        if entry in available or not _REGEX_CHARS.intersection(entry):  # a name (the caller reports missing ones)
            matched = [entry]
        else:
            try:
                pattern = re.compile(entry)
            except re.error as exc:
                raise SchemaError(f"schema_fields entry {entry!r} is neither a column nor a valid regular expression "
                                  f"({exc}); the available columns are {available}.") from None
            matched = [c for c in available if pattern.fullmatch(c)]
            if not matched:
                raise SchemaError(f"schema_fields pattern {entry!r} matches no column; a pattern must match a whole "
                                  f"column name, and the available columns are {available}.")
        out.extend(c for c in matched if c not in out)
    return out


def open_dataset(url_or_urls, *, schema_fields: Sequence[str] | None, filters, workers: int = 8,
                 storage_options: dict | None = None, filesystem=None, partitions: Partitions | None = None,
                 described_as: str | None = None, fill_missing: bool = False) -> Dataset:
    """List, check and measure a dataset: its files, the columns to read, and one piece per row group.

    ``partitions``: the files' partition values where something other than their folders says them (a Delta
    table's log); ``described_as``: what messages call the dataset (default: its URLs); ``fill_missing``: a column
    some files lack is null in their rows, as a Delta table reads files written before the column was added
    (otherwise every file must hold every column read)."""
    expr = to_expression(filters)
    fs, found = find_files(url_or_urls, storage_options=storage_options, filesystem=filesystem)
    files = [path for path, _ in found]
    name = described_as or _describe(url_or_urls)
    if partitions is None:
        partitions = discover(found, name)
    with ThreadPoolExecutor(max(1, min(workers, len(files))), thread_name_prefix="sparkhvd-data-footer") as pool:
        footers = list(pool.map(lambda p: _footer(fs, p), files))
    first = footers[0].schema.to_arrow_schema()
    if fill_missing:  # every column of any file, each as the first file that has it types it
        fields: dict[str, pa.Field] = {}
        for footer in footers:
            for field in footer.schema.to_arrow_schema():
                fields.setdefault(field.name, field)
        first = pa.schema(list(fields.values()))
    in_folders = partitions.names if partitions is not None else []
    clash = [c for c in in_folders if c in first.names]
    if clash:
        raise SchemaError(f"The column(s) {clash} of {name} are both in its Parquet files and partition "
                          f"folder names ({clash[0]}=...); rename the files' column(s) or the folders, so that each "
                          "column comes from one place.")
    available = first.names + in_folders
    wanted = select_columns(schema_fields, available)
    absent = []
    for path, footer in zip(files, footers):
        names = footer.schema.to_arrow_schema().names + in_folders
        missing = [c for c in wanted if c not in names]
        if missing and fill_missing:
            absent.append((path, tuple(missing)))
        elif missing:
            where = name if path == files[0] else f"file {path!r}"
            raise SchemaError(f"Column(s) {missing} in schema_fields do not exist in {where}; the available columns are {names}. Fix the names in schema_fields, or leave it None to read every column.")
    full = pa.schema(list(first) + list(partitions.fields if partitions is not None else ()))
    schema = pa.schema([full.field(c) for c in wanted])
    if expr is None:
        counts = [[footer.row_group(i).num_rows for i in range(footer.num_row_groups)] for footer in footers]
    else:
        def count(pf):
            partition = None if partitions is None else partitions.expression(pf[0])
            if partition is None and fill_missing:
                partition = ds.scalar(True)  # scanned with the whole schema: a column the file lacks is null
            return _count_matching(fs, pf[0], pf[1].num_row_groups, expr, available, full, partition)

        with ThreadPoolExecutor(max(1, min(workers, len(files))), thread_name_prefix="sparkhvd-data-filter") as pool:
            counts = list(pool.map(count, zip(files, footers)))
    pieces = tuple(Piece(path, i, n) for path, per_file in zip(files, counts) for i, n in enumerate(per_file) if n > 0)
    return Dataset(name, fs, tuple(files), schema, pieces, expr, partitions, full, tuple(absent))
