"""sparkhvd.data: sharded Parquet readers with Petastorm's API, on pyarrow.dataset.

``make_batch_reader(url, cur_shard=hvd.rank(), shard_count=hvd.size())`` yields namedtuples of
NumPy arrays; shards are balanced by rows, every row is read once per epoch, and every shard
takes the same number of steps. The torch adapter lives in ``sparkhvd.data.torch``, the tf.data
adapter in ``sparkhvd.data.tensorflow``; this package imports none of torch, TensorFlow and
pyspark (``make_spark_converter`` imports pyspark when called).
"""

from ._converter import SparkDatasetConverter, make_spark_converter
from ._delta_reader import make_delta_reader
from ._errors import DatasetNotFoundError, EmptyShardError, ReadError, SchemaError
from ._plan import ResumePoint
from ._reader import Reader, make_batch_reader
from ._rows import RowReader, make_reader

__all__ = [
    "DatasetNotFoundError",
    "EmptyShardError",
    "ReadError",
    "Reader",
    "ResumePoint",
    "RowReader",
    "SchemaError",
    "SparkDatasetConverter",
    "make_batch_reader",
    "make_delta_reader",
    "make_reader",
    "make_spark_converter",
]
