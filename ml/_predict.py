"""``transform`` on the executors: an Arrow UDF that loads the model once per Python worker and predicts Arrow batches.

The feature columns reach the UDF as one struct of Arrow arrays (ML vectors as arrays of floats,
tensors flattened); each becomes a NumPy array without a per-row Python loop (a binary column goes
through the ``decode`` function the model was fitted with, cell by cell), the model runs on chunks
of ``batch_size`` rows, and the outputs go back as Arrow arrays. The loaded model is kept per
Python worker and device (Spark reuses its Python workers, so a model is loaded once per worker,
not per task or batch); each task runs on the GPU Spark gave it
(``TaskContext.resources()['gpu']``), and on the CPU where it has none.
"""

from __future__ import annotations

import collections
import threading
from dataclasses import dataclass
from typing import Callable, Iterator

import cloudpickle
import numpy as np
import pyarrow as pa

from ._columns import Column, count_values, numel


@dataclass(frozen=True)
class Output:
    """One prediction column: its name, and whether it holds one number per row (else an array)."""

    name: str
    scalar: bool
    integer: bool  # an integer label's scalar output is rounded, as horovod.spark does


@dataclass(frozen=True)
class PredictSpec:
    """What the UDF needs to predict; pickled into the Spark job (the model travels by file, not in here)."""

    key: str  # one per model instance: the cache key on the workers
    load: Callable  # load(source, blob, device) -> predict(list of arrays) -> list of arrays; a module-level function
    source: str | None  # the model file's URL
    blob: bytes | None  # the model itself, where it has no file
    features: tuple[Column, ...]
    input_shapes: tuple[tuple[int, ...], ...]  # per feature, per row
    outputs: tuple[Output, ...]
    batch_size: int
    # {feature column: fn(cell bytes) -> array}, the estimator's, cloudpickled here as the fit's launch pickles it
    # (Spark's own copy of cloudpickle ignores cloudpickle.register_pickle_by_value); None without binary columns
    decode: bytes | None = None


_LOADED: collections.OrderedDict = collections.OrderedDict()  # (key, device) -> predict; the last few models
_LOADED_MAX = 4
_LOCK = threading.Lock()


def device_for(gpus: list[str] | None) -> str:
    """The device a task predicts on: the first GPU Spark assigned it (``cuda:<address>``), else the CPU. The
    framework's loader falls back to the CPU where it sees no such GPU."""
    return f"cuda:{int(gpus[0])}" if gpus else "cpu"


def task_gpus() -> list[str] | None:
    from pyspark import TaskContext

    context = TaskContext.get()
    if context is None:
        return None
    gpu = context.resources().get("gpu")
    return list(gpu.addresses) if gpu is not None else None


def loaded(spec: PredictSpec, device: str):
    """The model of ``spec`` on ``device``, loaded on first use in this process and kept."""
    with _LOCK:
        found = _LOADED.get((spec.key, device))
        if found is not None:
            _LOADED.move_to_end((spec.key, device))
            return found
        predict = spec.load(spec.source, spec.blob, device)
        _LOADED[(spec.key, device)] = predict
        while len(_LOADED) > _LOADED_MAX:
            _LOADED.popitem(last=False)
        return predict


def decoded(array: pa.Array, column: Column, fn) -> np.ndarray:
    """A binary column's cells through ``fn`` (the estimator's ``decode``), stacked: ``(rows, *column.shape)``."""
    arrays = []
    for cell in array.to_pylist():
        try:
            value = np.asarray(fn(cell))
        except Exception as exc:
            if hasattr(exc, "add_note"):
                exc.add_note(f"sparkhvd.ml: raised by decode[{column.name!r}] on a cell of a transform batch.")
            raise
        if value.shape != tuple(column.shape):
            raise ValueError(f"decode[{column.name!r}] returned an array of shape {value.shape} for a row, where the "
                             f"model was fitted on rows of shape {tuple(column.shape)}; return that shape for every "
                             "cell (resize in decode), as in training.")
        arrays.append(value)
    return np.stack(arrays) if arrays else np.zeros((0, *column.shape), dtype=np.float32)


def to_numpy(array: pa.Array, column: Column, shape: tuple[int, ...], decode=None) -> np.ndarray:
    """A feature column's Arrow array as float32 NumPy of shape ``(rows, *shape)``; a decoded column's bytes through
    ``decode`` first."""
    if array.null_count:
        raise ValueError(f"The feature column {column.name!r} has {array.null_count} null rows in a batch; a model "
                         "cannot take nulls: fill them (DataFrame.fillna) or drop those rows before transform.")
    n = len(array)
    if column.kind == "decoded":
        values = decoded(array, column, decode)
    else:
        values = array.flatten() if pa.types.is_list(array.type) or pa.types.is_large_list(array.type) else array
        values = values.to_numpy(zero_copy_only=False)
    flat = np.asarray(values, dtype=np.float32).reshape(-1)
    if flat.size != n * numel(shape):
        raise ValueError(f"The feature column {column.name!r} has rows of {flat.size // max(n, 1)} values where the "
                         f"model was fitted on rows of shape {tuple(column.shape)} "
                         f"({count_values(numel(shape))}); transform "
                         "a DataFrame whose rows have the training data's shapes.")
    return flat.reshape((n, *shape))


def from_numpy(values: np.ndarray, output: Output) -> pa.Array:
    """One output of the model, ``(rows, ...)``, as the Arrow array of its prediction column."""
    n = values.shape[0] if values.ndim else 1
    if output.scalar:
        flat = values.reshape(n)
        return pa.array(np.rint(flat).astype(np.int64) if output.integer else flat.astype(np.float64))
    flat = np.ascontiguousarray(values.reshape(n, -1), dtype=np.float32)
    width = flat.shape[1]
    offsets = pa.array(np.arange(0, (n + 1) * width, width, dtype=np.int32)[: n + 1])
    return pa.ListArray.from_arrays(offsets, pa.array(flat.reshape(-1)))


def predict_batches(spec: PredictSpec, batches: Iterator[pa.Array]) -> Iterator[pa.Array]:
    """The UDF's body: for each Arrow batch of the feature struct, the predictions (a struct where there are several)."""
    predict = loaded(spec, device_for(task_gpus()))
    decode = cloudpickle.loads(spec.decode) if spec.decode is not None else {}
    for batch in batches:
        inputs = [to_numpy(batch.field(i), column, shape, decode.get(column.name))
                  for i, (column, shape) in enumerate(zip(spec.features, spec.input_shapes))]
        n = len(batch)
        chunks = [predict([x[start:start + spec.batch_size] for x in inputs]) for start in range(0, n, spec.batch_size)]
        outputs = []
        for k, output in enumerate(spec.outputs):
            parts = [chunk[k] for chunk in chunks]
            values = np.concatenate(parts) if parts else np.zeros((0,), dtype=np.float32)
            if values.shape[0] != n:
                raise ValueError(f"The model returned {values.shape[0]} rows of {output.name!r} for {n} input rows; "
                                 "its outputs must have one row per input row (batch first).")
            outputs.append(from_numpy(values, output))
        if len(outputs) == 1:
            yield outputs[0]
        else:
            yield pa.StructArray.from_arrays(outputs, names=[output.name for output in spec.outputs])


def return_type(outputs: tuple[Output, ...]):
    from pyspark.sql import types as T

    def one(output: Output):
        if output.scalar:
            return T.LongType() if output.integer else T.DoubleType()
        return T.ArrayType(T.FloatType(), containsNull=False)

    if len(outputs) == 1:
        return one(outputs[0])
    return T.StructType([T.StructField(output.name, one(output), nullable=False) for output in outputs])


def make_udf(spec: PredictSpec):
    """The Arrow UDF: ``udf(struct_of_features)`` gives the prediction column (or a struct of them)."""
    from pyspark.sql.functions import arrow_udf

    def predict(batches: Iterator[pa.Array]) -> Iterator[pa.Array]:
        return predict_batches(spec, batches)

    return arrow_udf(predict, return_type(spec.outputs)).asNondeterministic()


def transform(df, spec: PredictSpec, vector_outputs: tuple[str, ...] = ()):
    """``df`` with a prediction column per output (ML vectors for ``vector_outputs``), computed on the executors."""
    from pyspark.ml.functions import array_to_vector, vector_to_array
    from pyspark.sql import functions as F

    names = set(df.columns)
    missing = [column.name for column in spec.features if column.name not in names]
    if missing:
        raise ValueError(f"transform: the DataFrame has no column {missing[0]!r}, which the model takes as a feature "
                         f"(feature columns {[c.name for c in spec.features]}); its columns are {sorted(names)}.")
    inputs = []
    for column in spec.features:
        col = F.col(f"`{column.name}`")
        if column.kind == "vector":
            col = vector_to_array(col, "float32")
        for _ in range(column.depth - 1):
            col = F.flatten(col)
        inputs.append(col.alias(column.name))
    predictions = make_udf(spec)(F.struct(*inputs))

    def shown(col, output: Output):
        return array_to_vector(col) if output.name in vector_outputs else col

    if len(spec.outputs) == 1:
        return df.withColumn(spec.outputs[0].name, shown(predictions, spec.outputs[0]))
    hidden = "__sparkhvd_predictions"
    with_struct = df.withColumn(hidden, predictions)
    return with_struct.withColumns({output.name: shown(F.col(hidden)[output.name], output)
                                    for output in spec.outputs}).drop(hidden)
