"""What every estimator's ``fit`` does: check, write the data once, find the run's checkpoint, launch, build the Model.

Every check runs on the driver before the barrier stage launches (bad parameters, a missing
column or an unsupported type, an empty DataFrame, a model whose outputs do not match the
labels, a Store that cannot be written, a ``run_id`` of another model), so a mistake costs
seconds, not a cluster launch. The framework subclasses (``_torch.py``, ``_lightning.py``,
``_keras.py``) supply the model's checks, files, training function and fitted Model.
"""

from __future__ import annotations

import numbers
import time
import uuid

from pyspark.ml import Estimator

from ..data import make_spark_converter
from ..data._cache import session_stopped
from ._checkpoints import RunDir
from ._columns import check_decode, columns_of, decoded_row, with_shapes
from ._params import EstimatorParams
from ._persistence import Persisted
from ._spec import DataSpec, FitSpec
from ._store import Store


def _positive(who: str, name: str, value, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{who}: {name} must be a positive int, got {value!r}.")


class HorovodEstimator(Estimator, EstimatorParams, Persisted):
    """The shared ``fit``; a framework subclass supplies the model's part."""

    _framework = ""

    def __init__(self, **kwargs):
        super().__init__()
        self._set_keywords(kwargs)

    # ---- fit ----

    def _fit(self, df):
        who = f"{type(self).__name__}.fit"
        self._check_params(who)
        features, labels, weight = self._columns(df, who)
        sample = first_row(df.select(*{c.name for c in (*features, *labels, *([weight] if weight else []))}))
        if sample is None:
            raise ValueError(f"{who}: the DataFrame is empty: there is nothing to train on. Check the filters and "
                             "joins that built it (df.count() is 0).")
        features, labels, weight, output_shapes, run = self._prepare(features, labels, weight, sample, who)
        data = self._write_data(df, features, labels, weight, run.store, who)
        return self._fit_data(data, run, output_shapes, who)

    def fit_on_parquet(self, train_path: str, validation_path: str | None = None):
        """Fit on Parquet files already written (numbers, arrays of numbers, binary columns named in decode; no
        vectors): no DataFrame is written."""
        from pyspark.sql import SparkSession

        who = f"{type(self).__name__}.fit_on_parquet"
        self._check_params(who, parquet=True)
        spark = SparkSession.active()
        df = spark.read.parquet(train_path)
        features, labels, weight = self._columns(df, who)
        for column in (*features, *labels, *([weight] if weight else [])):
            if column.kind == "vector" or column.depth > 1:
                raise ValueError(f"{who}: the column {column.name!r} is {column.spark_type}, which the readers cannot "
                                 "take from Parquet as it is; write arrays of numbers (vector_to_array, flatten), or "
                                 "call fit(df), which converts it.")
        sample = df.limit(1).collect()  # never a kept row: files rewritten in place keep their plan
        sample = sample[0] if sample else None
        if sample is None:
            raise ValueError(f"{who}: {train_path!r} holds no rows: there is nothing to train on.")
        features, labels, weight, output_shapes, run = self._prepare(features, labels, weight, sample, who)
        val_rows = spark.read.parquet(validation_path).count() if validation_path else 0
        data = DataSpec(train_path, df.count(), validation_path, val_rows, tuple(features), tuple(labels), weight,
                        self._decode())
        return self._fit_data(data, run, output_shapes, who)

    def _prepare(self, features, labels, weight, row, who: str):
        """What fit and fit_on_parquet check alike on the sampled ``row``: the columns' shapes, the model's dry run,
        the store and the run's model; ``(features, labels, weight, output shapes, run)``. Binary columns named in
        ``decode`` are decoded first: the model's dry run sees the arrays the ranks will."""
        row = decoded_row(row, features, self._decode(), who)
        features, labels = with_shapes(features, row, who), with_shapes(labels, row, who)
        weight = with_shapes([weight], row, who)[0] if weight else None
        output_shapes = self._check_model(features, labels, weight, row, who)
        store = self.getStore()
        store.check_writable()
        run = RunDir(store, self.getRunId() or f"sparkhvd_{int(time.time())}_{uuid.uuid4().hex[:6]}")
        run.claim(self._fingerprint(self.getModel()))
        return features, labels, weight, output_shapes, run

    def _check_params(self, who: str, parquet: bool = False) -> None:
        if self.getModel() is None:
            raise ValueError(f"{who}: no model; pass model= to the estimator.")
        if not isinstance(self.getStore(), Store):
            raise ValueError(f"{who}: store must be a sparkhvd.ml.Store, got {self.getStore()!r}; pass "
                             "store=Store.create('/dbfs/tmp/hvd') (a path or URL every worker reaches).")
        for name in ("feature_cols", "label_cols"):
            if not self.getOrDefault(name):
                raise ValueError(f"{who}: {name} is empty; pass the names of the columns to train on, e.g. "
                                 f"{name}=['features'].")
        overlap = set(self.getFeatureCols()) & set(self.getLabelCols())
        if overlap:
            raise ValueError(f"{who}: {sorted(overlap)} are both feature and label columns; a model must not see its "
                             "labels as features.")
        for name in ("batch_size", "epochs", "backward_passes_per_step", "batches_per_commit"):
            _positive(who, name, self.getOrDefault(name))
        for name in ("val_batch_size", "train_steps_per_epoch", "validation_steps_per_epoch"):
            _positive(who, name, self.getOrDefault(name), allow_none=True)
        num_proc = self.getNumProc()
        if num_proc is not None and (isinstance(num_proc, bool) or not isinstance(num_proc, int) or num_proc == 0):
            raise ValueError(f"{who}: num_proc must be a non-zero int (negative: that many processes on the driver, "
                             f"as HorovodRunner's np), got {num_proc!r}.")
        validation = self.getValidation()
        if parquet and validation is not None:
            raise ValueError(f"{who}: validation={validation!r} applies to fit(df); pass validation_path= to "
                             "fit_on_parquet instead.")
        if isinstance(validation, numbers.Real) and not isinstance(validation, bool):
            if not 0 <= validation < 1:
                raise ValueError(f"{who}: validation={validation!r} must be a fraction in [0, 1) or a column name.")
        elif validation is not None and not isinstance(validation, str):
            raise ValueError(f"{who}: validation must be a fraction in [0, 1), a column name or None, got "
                             f"{validation!r}.")

    def _decode(self) -> dict | None:
        """``decode`` as checked by ``_columns``: a dict, or None for none."""
        return dict(self.getDecode()) if self.getDecode() else None

    def _columns(self, df, who: str):
        decode = check_decode(self.getDecode(), df.schema, self.getFeatureCols(), who)
        features = columns_of(df.schema, "feature_cols", self.getFeatureCols(), who, decoded=decode or ())
        labels = columns_of(df.schema, "label_cols", self.getLabelCols(), who)
        weight_col = self.getSampleWeightCol()
        weight = columns_of(df.schema, "sample_weight_col", [weight_col], who)[0] if weight_col else None
        if weight is not None and weight.kind != "scalar":
            raise ValueError(f"{who}: sample_weight_col {weight.name!r} is {weight.spark_type}; it must hold one "
                             "number per row.")
        if isinstance(self.getValidation(), str):
            columns_of(df.schema, "validation", [self.getValidation()], who)
        return features, labels, weight

    def _write_data(self, df, features, labels, weight, store: Store, who: str) -> DataSpec:
        """The training (and validation) rows as Parquet in the store, written once per DataFrame (the converter's
        cache: a second fit of the same DataFrame writes nothing)."""
        from pyspark.sql import functions as F

        columns = [*features, *labels, *([weight] if weight else [])]

        def select(frame):
            chosen = []
            for column in columns:
                col = F.col(f"`{column.name}`")
                for _ in range(column.depth - 1):  # tensors travel flat, and are reshaped on the ranks
                    col = F.flatten(col)
                chosen.append(col.alias(column.name))
            return frame.select(*chosen)

        validation, val = self.getValidation(), None
        if isinstance(validation, str):
            marked = F.coalesce(F.col(f"`{validation}`").cast("boolean"), F.lit(False))
            train, val = select(df.filter(~marked)), select(df.filter(marked))
        elif validation:
            seed = self.getRandomSeed() if self.getRandomSeed() is not None else 0
            train, val = select(df).randomSplit([1.0 - validation, validation], seed=seed)
        else:
            train = select(df)
        parent = store.get_data_path()
        converter = make_spark_converter(train, parent_cache_dir_url=parent)
        ranks = abs(self._num_proc(df))
        if len(converter) < ranks:
            raise ValueError(f"{who}: the training data has {len(converter)} rows, fewer than the {ranks} ranks "
                             "(num_proc); every rank needs rows: use fewer processes or more data.")
        val_url, val_rows = None, 0
        if val is not None:
            val_converter = make_spark_converter(val, parent_cache_dir_url=parent)
            if len(val_converter):
                val_url, val_rows = val_converter.cache_dir_url, len(val_converter)
        return DataSpec(converter.cache_dir_url, len(converter), val_url, val_rows, tuple(features), tuple(labels),
                        weight, self._decode())

    def _num_proc(self, df=None) -> int:
        if self.getNumProc() is not None:
            return self.getNumProc()
        from pyspark.sql import SparkSession

        session = df.sparkSession if df is not None else SparkSession.active()
        return session.sparkContext.defaultParallelism

    def _fit_data(self, data: DataSpec, run: RunDir, output_shapes, who: str):
        from ..runner import HorovodRunner
        from ..runner._runner_config import RunnerConfig

        newest = run.newest()
        start_epoch = newest[0] if newest else 0
        epochs = self.getEpochs()
        if start_epoch > epochs:
            raise ValueError(f"{who}: run_id={run.run_id!r} already trained {start_epoch} epochs, more than "
                             f"epochs={epochs}; pass epochs>={start_epoch}, or a new run_id to start over.")
        restarts = self.getMaxRestarts()
        spec = FitSpec(
            data=data, store=run.store, run_id=run.run_id, epochs=epochs, start_epoch=start_epoch,
            batch_size=self.getBatchSize(),
            val_batch_size=self.getValBatchSize() or self.getBatchSize(), shuffle=self.getShuffle(),
            seed=self.getRandomSeed() if self.getRandomSeed() is not None else 0, random_seed=self.getRandomSeed(),
            train_steps_per_epoch=self.getTrainStepsPerEpoch(),
            validation_steps_per_epoch=self.getValidationStepsPerEpoch(), verbose=self.getVerbose(),
            use_gpu=self.getUseGpu(), backward_passes_per_step=self.getBackwardPassesPerStep(),
            batches_per_commit=self.getBatchesPerCommit() if restarts else 0, output_shapes=tuple(output_shapes),
            every_epoch=bool(restarts or self.getRunId()))
        self._write_initial(run)
        runner = HorovodRunner._from_config(RunnerConfig(np=self._num_proc(), max_restarts=restarts,
                                                         **self._runner_options()))
        history = runner.run(self._train_function(), spec=spec, framework=self._framework_objects(spec))
        model = self._fitted(run, spec, history)
        _log_to_mlflow(model)
        return model

    # ---- the framework's part ----

    def _check_model(self, features, labels, weight, row, who: str) -> list[tuple[int, ...]]:
        """Run the model on ``row`` on the driver; return each output's per-row shape, or raise ValueError."""
        raise NotImplementedError

    def _fingerprint(self, model) -> dict:
        raise NotImplementedError

    def _write_initial(self, run: RunDir) -> None:
        """Write what the ranks load (the model, its optimizer) into the run's directory."""
        raise NotImplementedError

    def _framework_objects(self, spec: FitSpec) -> dict:
        """Small objects the ranks need (losses, metrics, callbacks), pickled into the launch."""
        return {}

    def _runner_options(self) -> dict:
        """The framework's keyword-only RunnerConfig fields (its layout)."""
        return {}

    def _train_function(self):
        raise NotImplementedError

    def _fitted(self, run: RunDir, spec: FitSpec, history):
        raise NotImplementedError


#: the first rows fit sampled, with their DataFrames (the newest last): a later fit of a DataFrame of the same plan
#: in this process (a notebook's cell run again) takes its row from here, with no Spark job, as its Parquet is reused
#: (``make_spark_converter``'s rule, data/_cache.py)
_SAMPLES: list = []
_KEPT_SAMPLES = 8


def first_row(frame):
    """A row of ``frame`` for the checks and the model's dry run (None: it has none): one Spark job, or none where a
    DataFrame of the same plan was sampled before in this process."""
    semantic_hash = frame.semanticHash()
    _SAMPLES[:] = [kept for kept in _SAMPLES if not session_stopped(kept[1].sparkSession)]
    for kept_hash, kept, row in reversed(_SAMPLES):
        if kept_hash == semantic_hash and kept.sparkSession is frame.sparkSession and kept.sameSemantics(frame):
            return row
    rows = frame.limit(1).collect()
    if not rows:
        return None
    _SAMPLES.append((semantic_hash, frame, rows[0]))
    del _SAMPLES[:-_KEPT_SAMPLES]
    return rows[0]


def _log_to_mlflow(model) -> None:
    """Inside an active MLflow run, log the fitted model with its flavor's ``log_model``."""
    import sys
    import warnings

    mlflow = sys.modules.get("mlflow")
    if mlflow is None or mlflow.active_run() is None:
        return
    try:
        model._log_to_mlflow(mlflow)
    except Exception as exc:  # noqa: BLE001 - the fit succeeded; a tracking server's failure must not lose it
        warnings.warn(f"The fitted model was not logged to MLflow run {mlflow.active_run().info.run_id}: "
                      f"{type(exc).__name__}: {exc}", RuntimeWarning, stacklevel=3)
