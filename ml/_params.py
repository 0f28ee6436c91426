"""The estimators' and models' Spark ML Params, with horovod.spark's names (horovod/spark/common/params.py).

Each Param ``name`` gets horovod.spark's accessors ``getName()`` / ``setName(value)`` (``num_proc``:
``getNumProc``, ``setNumProc``), and the constructors take every Param as a keyword.
"""

from __future__ import annotations

from pyspark.ml.param import Param, Params, TypeConverters


def _camel(name: str) -> str:
    return "".join(part[:1].upper() + part[1:] for part in name.split("_"))


def _accessors(cls):
    """Add ``getX``/``setX`` for every Param of ``cls`` that lacks them (horovod.spark's spelling)."""
    for name in dir(cls):
        param = getattr(cls, name, None)
        if not isinstance(param, Param):
            continue
        getter, setter = f"get{_camel(name)}", f"set{_camel(name)}"
        if getattr(cls, getter, None) is None:
            setattr(cls, getter, lambda self, _n=name: self.getOrDefault(getattr(self, _n)))
        if getattr(cls, setter, None) is None:
            setattr(cls, setter, lambda self, value, _n=name: self._set(**{_n: value}))
    return cls


def _p(name: str, doc: str, converter=None) -> Param:
    return Param(Params._dummy(), name, doc, typeConverter=converter)


_INT, _BOOL, _STR, _STRS = TypeConverters.toInt, TypeConverters.toBoolean, TypeConverters.toString, TypeConverters.toListString


class _KeywordParams(Params):
    """Params set from constructor keywords; an unknown keyword is a TypeError naming the known ones."""

    _extra_defaults: dict = {}  # a framework subclass's own Params' defaults

    def _set_keywords(self, kwargs: dict) -> None:
        """The framework's defaults, then ``kwargs``."""
        self._setDefault(**self._extra_defaults)
        unknown = sorted(name for name in kwargs if not self.hasParam(name))
        if unknown:
            known = ", ".join(sorted(p.name for p in self.params))
            raise TypeError(f"{type(self).__name__} got unknown parameter(s) {unknown}; its parameters are: {known}.")
        self._set(**{name: value for name, value in kwargs.items() if value is not None or name in self._nullable})

    _nullable: frozenset = frozenset()


@_accessors
class EstimatorParams(_KeywordParams):
    """What every estimator takes: horovod.spark's EstimatorParams, and sparkhvd's restarts."""

    num_proc = _p("num_proc", "number of processes (ranks); default: the SparkContext's defaultParallelism", _INT)
    store = _p("store", "the Store for the intermediate data, checkpoints and logs")
    model = _p("model", "the model to train")
    optimizer = _p("optimizer", "the optimizer")
    loss = _p("loss", "the loss function, or one per label column")
    loss_weights = _p("loss_weights", "a weight per label column's loss")
    metrics = _p("metrics", "metric functions, computed on every batch and averaged per epoch")
    feature_cols = _p("feature_cols", "feature column names", _STRS)
    label_cols = _p("label_cols", "label column names", _STRS)
    sample_weight_col = _p("sample_weight_col", "a column of per-row loss weights", _STR)
    validation = _p("validation", "a fraction of rows in [0, 1) held out, or the name of a column marking them")
    callbacks = _p("callbacks", "framework callbacks")
    batch_size = _p("batch_size", "rows per batch on each rank", _INT)
    val_batch_size = _p("val_batch_size", "rows per validation batch on each rank (default: batch_size)", _INT)
    epochs = _p("epochs", "epochs to train in all (a resumed run trains those not yet done)", _INT)
    train_steps_per_epoch = _p("train_steps_per_epoch", "at most this many training steps per epoch", _INT)
    validation_steps_per_epoch = _p("validation_steps_per_epoch", "at most this many validation steps per epoch", _INT)
    random_seed = _p("random_seed", "the seed of the framework and of the row order", _INT)
    shuffle = _p("shuffle", "whether to shuffle the rows each epoch", _BOOL)
    verbose = _p("verbose", "0: silent; 1: a line per epoch", _INT)
    run_id = _p("run_id", "the run's name in the store: a fit with the same run_id resumes it", _STR)
    transformation_fn = _p("transformation_fn", "a function applied to every batch (a dict of column arrays) on the ranks")
    decode = _p("decode", "per binary feature column, fn(cell bytes) -> NumPy array, run in the ranks' reader threads "
                          "and in transform: {'image': fn}")
    gradient_compression = _p("gradient_compression", "Horovod's gradient compression (hvd.Compression.fp16)")
    backward_passes_per_step = _p("backward_passes_per_step", "backward passes per allreduce and optimizer step", _INT)
    use_gpu = _p("use_gpu", "train on the ranks' GPUs where they have them", _BOOL)
    max_restarts = _p("max_restarts", "relaunches after an infrastructure failure, each resuming from the last commit",
                      _INT)
    batches_per_commit = _p("batches_per_commit", "with max_restarts: commit the training state every this many steps",
                            _INT)

    def __init__(self):
        super().__init__()
        self._setDefault(num_proc=None, store=None, model=None, optimizer=None, loss=None, loss_weights=None,
                         metrics=[], feature_cols=None, label_cols=None, sample_weight_col=None, validation=None,
                         callbacks=[], batch_size=32, val_batch_size=None, epochs=1, train_steps_per_epoch=None,
                         validation_steps_per_epoch=None, random_seed=None, shuffle=True, verbose=1, run_id=None,
                         transformation_fn=None, decode=None, gradient_compression=None, backward_passes_per_step=1,
                         use_gpu=True, max_restarts=0, batches_per_commit=100)


@_accessors
class ModelParams(_KeywordParams):
    """What every fitted model carries: horovod.spark's ModelParams."""

    history = _p("history", "the training history: a dict per epoch")
    model = _p("model", "the trained model")
    feature_columns = _p("feature_columns", "feature column names", _STRS)
    label_columns = _p("label_columns", "label column names", _STRS)
    outputCols = _p("outputCols", "the prediction columns, one per label column", _STRS)
    run_id = _p("run_id", "the run that trained this model", _STR)
    decode = _p("decode", "per binary feature column, the fn(cell bytes) -> NumPy array it was fitted with")
    _metadata = _p("_metadata", "the input and output columns' shapes and types")

    def __init__(self):
        super().__init__()
        self._setDefault(history=[], run_id=None, model=None, decode=None)

    def getOutputCols(self) -> list[str]:
        if self.isDefined(self.outputCols):
            return self.getOrDefault(self.outputCols)
        return [f"{label}__output" for label in self.getLabelColumns()]
