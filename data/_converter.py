"""make_spark_converter: a Spark DataFrame materialized as Parquet, read back by sharded readers.

Petastorm's ``make_spark_converter`` API: ``converter.make_torch_dataloader(...)`` and
``converter.make_tf_dataset(...)`` are context managers over one shard. Imports pyspark (and
torch or TensorFlow, for the loaders) only when called. The cache rule is in ``_cache.py``.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import posixpath
import sys
import uuid
from typing import Any

import pyarrow.fs as pafs

from . import _cache
from ._metadata import list_files, open_dataset, resolve_url

PARENT_CACHE_DIR_CONF = "sparkhvd.data.parentCacheDirUrl"
PETASTORM_PARENT_CACHE_DIR_CONF = "petastorm.spark.converter.parentCacheDirUrl"
DEFAULT_ROW_GROUP_BYTES = 32 * 1024 * 1024
MIN_ROW_GROUPS = 64
MIN_ROW_GROUP_BYTES = 1024 * 1024


def choose_row_group_bytes(estimated_bytes: int | None, max_bytes: int) -> int:
    """The Parquet row-group size for a DataFrame of about ``estimated_bytes``: aim for ``MIN_ROW_GROUPS`` row groups.

    Shards balance by rows whatever the row groups (the reader splits row groups), so this
    buys the rest: a reader reads, shuffles and prefetches whole row groups, so row groups
    much smaller than a shard keep its prefetch threads busy, give ``shuffle_row_groups``
    something to shuffle, bound memory (a reader holds ``workers_count + 3`` of them) and
    limit the rows read and dropped where a row group straddles two shards. The rule:
    ``estimated_bytes / MIN_ROW_GROUPS``, at most ``max_bytes`` and at least
    ``MIN_ROW_GROUP_BYTES`` (1 MiB; smaller row groups cost footer and page overhead, and a
    small data set reads fast anyway), or ``max_bytes`` when it is smaller. Unknown size:
    ``max_bytes``.
    """
    if estimated_bytes is None:
        return max_bytes
    return max(min(max_bytes, MIN_ROW_GROUP_BYTES), min(max_bytes, estimated_bytes // MIN_ROW_GROUPS))


def _estimated_bytes(df) -> int | None:
    """Spark's size estimate of ``df`` (optimizer statistics, no job); None where it has none (Spark Connect)."""
    try:
        return int(df._jdf.queryExecution().optimizedPlan().stats().sizeInBytes())
    except Exception:  # noqa: BLE001 - no _jdf under Spark Connect, or a plan without statistics: fall back to the cap
        return None


def _check_dtype(dtype: str | None) -> None:
    if dtype not in (None, "float32", "float64"):
        raise ValueError(f"dtype must be 'float32', 'float64' or None, got {dtype!r}; pass dtype=None to keep the DataFrame's types.")


def _float_casts(df, dtype: str | None):
    """Cast float columns (and arrays of them, and ML vectors) to ``dtype``, as Petastorm does: double to float32, or
    float32 to double; None keeps them."""
    from pyspark.sql import functions as F
    from pyspark.sql import types as T

    _check_dtype(dtype)
    source, target = (T.DoubleType, T.FloatType) if dtype == "float32" else (T.FloatType, T.DoubleType)
    columns = []
    for field in df.schema.fields:
        col, kind = F.col(f"`{field.name}`"), field.dataType
        if type(kind).__name__ == "VectorUDT":
            from pyspark.ml.functions import vector_to_array

            col, kind = vector_to_array(col, "float32" if dtype == "float32" else "float64"), None
        elif dtype is not None and isinstance(kind, source):
            col = col.cast(target())
        elif dtype is not None and isinstance(kind, T.ArrayType) and isinstance(kind.elementType, source):
            col = col.cast(T.ArrayType(target()))
        columns.append(col.alias(field.name))
    return df.select(*columns)


def _observe_list_lengths(df):
    """``df`` observed for the min/max length and null count of each flat array column, and the Observation.

    The metrics are computed during the write itself (no extra job); a column whose rows
    all have one length L and no nulls gets the static shape ``(None, L)`` in tf.data.
    """
    from pyspark.sql import Observation
    from pyspark.sql import functions as F
    from pyspark.sql import types as T

    metrics = []
    for i, field in enumerate(df.schema.fields):
        kind = field.dataType
        if isinstance(kind, T.ArrayType) and not isinstance(kind.elementType, (T.ArrayType, T.MapType, T.StructType)):
            col = F.col(f"`{field.name}`")
            metrics += [F.min(F.size(col)).alias(f"min{i}"), F.max(F.size(col)).alias(f"max{i}"),
                        F.count(F.when(col.isNull(), 1)).alias(f"nulls{i}")]
    if not metrics:
        return df, None
    observation = Observation(f"sparkhvd-{uuid.uuid4().hex}")
    return df.observe(observation, *metrics), observation


def _list_lengths(df, observation) -> dict[str, int]:
    if observation is None:
        return {}
    values = observation.get
    lengths = {}
    for i, field in enumerate(df.schema.fields):
        low, high, nulls = values.get(f"min{i}"), values.get(f"max{i}"), values.get(f"nulls{i}")
        if low is not None and low == high and low >= 0 and nulls == 0:
            lengths[field.name] = int(low)
    return lengths


class SparkDatasetConverter:
    """A DataFrame written once as Parquet under a cache directory; makes sharded loaders over it.

    ``list_lengths``: the columns Spark wrote as (variable-length) lists whose rows all have
    one length, and that length; the tf.data adapter gives them static shapes.
    """

    #: Petastorm's name of the Spark conf that holds the parent cache directory
    PARENT_CACHE_DIR_URL_CONF = PETASTORM_PARENT_CACHE_DIR_CONF

    def __init__(self, cache_dir_url: str, dataset_size: int, list_lengths: dict[str, int] | None = None, *,
                 written: bool = True):
        self.cache_dir_url = cache_dir_url
        self.written = written  # False: a saved dataset the user gave, which delete() leaves alone
        self.dataset_size = dataset_size
        self.list_lengths = dict(list_lengths or {})
        scheme = cache_dir_url.split("://", 1)[0]
        self.file_urls = [f"{scheme}://{path}" for path in list_files(cache_dir_url)[1]]

    def __len__(self) -> int:
        return self.dataset_size

    def make_torch_dataloader(self, batch_size: int = 32, num_epochs: int | None = None, workers_count: int = 4, **reader_kwargs: Any):
        """A torch loader over one shard (``cur_shard``/``shard_count`` default to the communicator's).

        As in Petastorm, ``num_epochs=None`` (the default) reads forever. Other keyword
        arguments go to make_batch_reader. Each iteration of the loader reads afresh
        (``num_epochs`` epochs, in a new order), as make_torch_loader over a URL does, and
        ``resume_from=(epoch, batch)`` resumes mid-epoch as it does there. Use it in ``with``:
        leaving it stops the reader.
        """
        from .torch import make_torch_loader

        return make_torch_loader(self.cache_dir_url, batch_size=batch_size, num_epochs=num_epochs, workers_count=workers_count, **reader_kwargs)

    def make_tf_dataset(self, batch_size: int = 32, num_epochs: int | None = None, workers_count: int = 4, **reader_kwargs: Any):
        """A context manager yielding a ``tf.data.Dataset`` of dicts of tensors over one shard.

        Arguments as in make_torch_dataloader. Every iteration of the dataset (Keras iterates
        once per epoch) reads afresh; list columns in ``list_lengths`` have static shape
        ``(None, length)``. Leaving the ``with`` stops the readers still running.
        """
        from .tensorflow import TFDatasetContext

        return TFDatasetContext(self.cache_dir_url, batch_size=batch_size, num_epochs=num_epochs, workers_count=workers_count,
                                list_lengths=self.list_lengths, **reader_kwargs)

    def delete(self) -> None:
        """Delete the cached Parquet files; later converters of the same plan write them again.

        Converters returned for the same plan share the directory, so it is gone for them too. A converter over a
        saved dataset (``make_spark_converter(path)``) deletes nothing: the files are the user's.
        """
        if not self.written:
            return
        fs, path = resolve_url(self.cache_dir_url)
        with contextlib.ExitStack() as held:
            # Under the slot's lock, so that make_spark_converter never hands out the directory being deleted.
            for slot in _cache.slots_with_url(self.cache_dir_url):
                held.enter_context(slot.lock)
            _cache.forget(self.cache_dir_url)
            _written.discard(self.cache_dir_url)
            fs.delete_dir(path)


#: The directories this process wrote and has not deleted; removed when it exits, as Petastorm's are
_written: set[str] = set()


@atexit.register
def _delete_written() -> None:
    for url in list(_written):
        try:
            fs, path = resolve_url(url)
            if fs.get_file_info(path).type != pafs.FileType.NotFound:  # gone already (its parent deleted): done
                fs.delete_dir(path)
        except (OSError, ValueError) as exc:  # the exit goes on; say what is left
            print(f"sparkhvd.data: could not delete the converter's cache directory {url} at exit ({exc}); delete it "
                  "yourself.", file=sys.stderr)
        _written.discard(url)


def _parent_url(df, parent_cache_dir_url: str | None) -> str:
    conf = df.sparkSession.conf
    parent = parent_cache_dir_url or conf.get(PARENT_CACHE_DIR_CONF, None) or conf.get(PETASTORM_PARENT_CACHE_DIR_CONF, None)
    if not parent:
        raise ValueError(
            "make_spark_converter needs a cache directory: pass parent_cache_dir_url='file:///dbfs/tmp/cache' (a URL every "
            f"worker can read) or set the Spark conf {PARENT_CACHE_DIR_CONF} (or Petastorm's {PETASTORM_PARENT_CACHE_DIR_CONF})."
        )
    if "://" not in parent:
        raise ValueError(f"parent_cache_dir_url={parent!r} is not a URL; use e.g. 'file://{os.path.abspath(parent)}' or 's3://bucket/cache'.")
    return parent.rstrip("/")


def _check_spark_can_write(df, parent: str) -> None:
    """Refuse, in a sentence, a cache directory whose scheme Spark's Hadoop has no filesystem for (the pip release of
    pyspark has none for s3:// or s3a://). Under Spark Connect, where the JVM is out of reach, Spark's write says it."""
    context = getattr(df.sparkSession, "_sc", None)
    jvm = getattr(context, "_jvm", None)
    if jvm is None:
        return
    scheme = parent.split("://", 1)[0]
    try:
        jvm.org.apache.hadoop.fs.FileSystem.getFileSystemClass(scheme, context._jsc.hadoopConfiguration())
    except Exception as exc:  # noqa: BLE001 - py4j's error: UnsupportedFileSystemException, ClassNotFoundException
        java = getattr(exc, "java_exception", None)
        detail = (str(java.toString()) if java is not None else str(exc).split("\n", 1)[0])[:300]
        version = jvm.org.apache.hadoop.util.VersionInfo.getVersion()
        if scheme in ("s3", "s3a", "s3n"):
            fix = (f"the pip release of pyspark lacks Hadoop's S3 connector: start Spark with "
                   f"spark.jars.packages=org.apache.hadoop:hadoop-aws:{version} and use an s3a:// URL")
        elif scheme in ("abfs", "abfss", "wasb", "wasbs"):
            fix = f"start Spark with spark.jars.packages=org.apache.hadoop:hadoop-azure:{version}"
        elif scheme == "gs":
            fix = "put Google's GCS connector for Hadoop (gcs-connector) on Spark's classpath"
        else:
            fix = f"put a Hadoop filesystem for {scheme}:// on Spark's classpath"
        raise ValueError(
            f"Spark cannot write the converter's cache under parent_cache_dir_url={parent!r}: its Hadoop {version} has "
            f"no filesystem for {scheme}:// ({detail}). To write there, {fix}; or use a directory every worker "
            "reaches as a path (a /dbfs or /Volumes mount, a shared disk)."
        ) from None


def _materialize(df, parent: str, row_group_bytes: int, compression_codec: str | None, dtype: str | None) -> tuple[str, dict]:
    """Write ``df`` into a new directory under ``parent``; return its URL and completion marker."""
    url = f"{parent}/sparkhvd-{uuid.uuid4().hex}"
    cast = _float_casts(df, dtype)
    observed, observation = _observe_list_lengths(cast)
    block = choose_row_group_bytes(_estimated_bytes(cast), int(row_group_bytes))
    writer = observed.write.option("parquet.block.size", block)
    if compression_codec is not None:
        writer = writer.option("compression", compression_codec)
    fs, root = resolve_url(url)
    try:
        writer.parquet(url)
        dataset = open_dataset(url, schema_fields=None, filters=None)
        marker = {
            "rows": dataset.num_rows,
            "list_lengths": _list_lengths(cast, observation),
            "row_group_bytes": block,
            "files": [posixpath.relpath(path, root) for path in dataset.files],
        }
        _cache.write_marker(url, marker)
        _written.add(url)
    except BaseException:
        # Leave no partly written directory behind: it would never be reused, only take space.
        try:
            if fs.get_file_info(root).type != pafs.FileType.NotFound:
                fs.delete_dir(root)
        except OSError:
            pass  # the write's own error, raised below, is the one to report
        raise
    return url, marker


def make_spark_converter(
    df,
    *,
    parent_cache_dir_url: str | None = None,
    parquet_row_group_size_bytes: int = DEFAULT_ROW_GROUP_BYTES,
    compression_codec: str | None = None,
    dtype: str | None = "float32",
) -> SparkDatasetConverter:
    """Write ``df`` as Parquet under ``parent_cache_dir_url`` and return a converter over it.

    ``parent_cache_dir_url``: a URL every worker can read (``file:///dbfs/...``, ``s3://...``);
    defaults to the Spark conf ``sparkhvd.data.parentCacheDirUrl``, then to Petastorm's
    ``petastorm.spark.converter.parentCacheDirUrl``. A DataFrame whose plan this process has
    already written with the same options, in the same SparkSession, reuses that directory
    (see ``_cache.py``); otherwise the call writes a new directory under the parent (and
    deletes it again if the write fails). ``converter.delete()``
    removes it. ``dtype='float32'`` casts double columns, arrays of double and ML vectors to
    float32 (``None`` keeps the types).

    ``parquet_row_group_size_bytes`` caps the row-group size; smaller data sets get smaller
    row groups, about 64 of them but at least 1 MiB each (see ``choose_row_group_bytes``).

    ``df`` may also be the path or URL of a saved Parquet dataset (Petastorm 0.12's form:
    ``'file:/dbfs/tmp/saved'``, ``'/dbfs/tmp/saved'``, ``'dbfs:/tmp/saved'``, ``'s3://...'``):
    the converter then reads it where it is, writing nothing and casting nothing, and its
    ``delete()`` leaves the files alone.
    """
    if isinstance(df, (str, os.PathLike)):
        return _saved(df)
    parent = _parent_url(df, parent_cache_dir_url)
    _check_spark_can_write(df, parent)
    _check_dtype(dtype)
    if isinstance(parquet_row_group_size_bytes, bool) or not isinstance(parquet_row_group_size_bytes, int) or parquet_row_group_size_bytes < 1:
        raise ValueError(f"parquet_row_group_size_bytes must be a positive int, got {parquet_row_group_size_bytes!r}; the default is {DEFAULT_ROW_GROUP_BYTES} (32 MiB).")
    options = (parent, int(parquet_row_group_size_bytes), compression_codec, dtype)
    slot = _cache.slot_for(df, options)
    with slot.lock:
        marker = _cache.read_complete_marker(slot.url) if slot.url is not None else None
        if marker is None:
            try:
                slot.url, marker = _materialize(df, parent, parquet_row_group_size_bytes, compression_codec, dtype)
            except BaseException:
                _cache.drop(slot)
                raise
            _cache.keep(slot)
        return SparkDatasetConverter(slot.url, marker["rows"], marker["list_lengths"])


def _saved(path) -> SparkDatasetConverter:
    """A converter over a saved Parquet dataset, read in place (its rows counted from the footers)."""
    url = os.fspath(path)
    if url.startswith("dbfs:/"):  # Databricks' DBFS, as its FUSE mount shows it on every node
        url = "file:///dbfs/" + url[len("dbfs:/"):].lstrip("/")
    elif "://" not in url:  # a local path, or Spark's file:/path
        url = "file://" + os.path.abspath(url[len("file:"):] if url.startswith("file:") else url)
    dataset = open_dataset(url, schema_fields=None, filters=None)
    return SparkDatasetConverter(url.rstrip("/"), dataset.num_rows, written=False)
