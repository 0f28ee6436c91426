"""make_spark_converter: a Spark DataFrame materialized as Parquet, read back by sharded readers.

Petastorm's ``make_spark_converter`` API: ``converter.make_torch_dataloader(...)`` is a context
manager yielding a torch loader over one shard. Imports pyspark (and torch, for the loader)
only when called.
"""

from __future__ import annotations

import os
import uuid
from typing import Any

from ._metadata import list_files, open_dataset

PARENT_CACHE_DIR_CONF = "sparkhvd.data.parentCacheDirUrl"
DEFAULT_ROW_GROUP_BYTES = 32 * 1024 * 1024


def _float_casts(df, dtype: str | None):
    """Cast double columns (and arrays of double, and ML vectors) to ``dtype``, as Petastorm does."""
    from pyspark.sql import functions as F
    from pyspark.sql import types as T

    if dtype not in (None, "float32", "float64"):
        raise ValueError(f"dtype must be 'float32', 'float64' or None, got {dtype!r}; pass dtype=None to keep the DataFrame's types.")
    columns = []
    for field in df.schema.fields:
        col, kind = F.col(f"`{field.name}`"), field.dataType
        if type(kind).__name__ == "VectorUDT":
            from pyspark.ml.functions import vector_to_array

            col, kind = vector_to_array(col, "float32" if dtype == "float32" else "float64"), None
        elif dtype == "float32" and isinstance(kind, T.DoubleType):
            col = col.cast(T.FloatType())
        elif dtype == "float32" and isinstance(kind, T.ArrayType) and isinstance(kind.elementType, T.DoubleType):
            col = col.cast(T.ArrayType(T.FloatType()))
        columns.append(col.alias(field.name))
    return df.select(*columns)


class SparkDatasetConverter:
    """A DataFrame written once as Parquet under a cache directory; makes sharded loaders over it."""

    def __init__(self, cache_dir_url: str, dataset_size: int):
        self.cache_dir_url = cache_dir_url
        self.dataset_size = dataset_size
        scheme = cache_dir_url.split("://", 1)[0]
        self.file_urls = [f"{scheme}://{path}" for path in list_files(cache_dir_url)[1]]

    def __len__(self) -> int:
        return self.dataset_size

    def make_torch_dataloader(self, batch_size: int = 32, num_epochs: int | None = None, workers_count: int = 4, **reader_kwargs: Any):
        """A torch loader over one shard (``cur_shard``/``shard_count`` default to the communicator's).

        As in Petastorm, ``num_epochs=None`` (the default) reads forever. Other keyword
        arguments go to make_batch_reader. Use it in ``with``: leaving it stops the reader.
        """
        from .torch import make_torch_loader

        return make_torch_loader(self.cache_dir_url, batch_size=batch_size, num_epochs=num_epochs, workers_count=workers_count, **reader_kwargs)

    def delete(self) -> None:
        """Delete the cached Parquet files."""
        import pyarrow.fs as pafs

        fs, path = pafs.FileSystem.from_uri(self.cache_dir_url)
        fs.delete_dir(path)


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
    defaults to the Spark conf ``sparkhvd.data.parentCacheDirUrl``. Each call writes a new
    directory under it; ``converter.delete()`` removes it. ``dtype='float32'`` casts double
    columns, arrays of double and ML vectors to float32 (``None`` keeps the types).
    """
    parent = parent_cache_dir_url or df.sparkSession.conf.get(PARENT_CACHE_DIR_CONF, None)
    if not parent:
        raise ValueError(f"make_spark_converter needs a cache directory: pass parent_cache_dir_url='file:///dbfs/tmp/cache' (a URL every worker can read) or set the Spark conf {PARENT_CACHE_DIR_CONF}.")
    if "://" not in parent:
        raise ValueError(f"parent_cache_dir_url={parent!r} is not a URL; use e.g. 'file://{os.path.abspath(parent)}' or 's3://bucket/cache'.")
    url = parent.rstrip("/") + f"/sparkhvd-{uuid.uuid4().hex}"
    writer = _float_casts(df, dtype).write.option("parquet.block.size", int(parquet_row_group_size_bytes))
    if compression_codec is not None:
        writer = writer.option("compression", compression_codec)
    writer.parquet(url)
    size = open_dataset(url, schema_fields=None, filters=None).num_rows
    return SparkDatasetConverter(url, size)
