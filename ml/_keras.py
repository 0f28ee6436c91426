"""``KerasEstimator`` and ``KerasModel``: horovod.spark.keras's, for Keras 3 on TensorFlow, on the runner and the Store.

``KerasEstimator(model=model, optimizer=keras.optimizers.Adam(), loss="mse", ...)`` trains a Keras 3
model (compiled by the user, or compiled from ``optimizer``, ``loss``, ``metrics``) under
``hvd.DistributedOptimizer`` on ``num_proc`` ranks; the rank loop is ``_keras_train.py``. The
ranks load the model from ``.keras`` files in the run's directory, so custom layers, losses and
metrics must be registered with Keras or given as ``custom_objects`` (the functions passed as
``loss`` and ``metrics`` are added by their names). ``fit`` returns a ``KerasModel`` whose
``transform`` predicts on the executors (``_predict.py``). Keras is imported on first use only.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import inspect
import json
import posixpath

import numpy as np

from ._checkpoints import RunDir
from ._columns import count_values
from ._estimator import HorovodEstimator
from ._keras_train import CHECKPOINT, INITIAL, MODEL, STATE, as_outputs, keras_bytes, load_keras, train
from ._model import HorovodModel
from ._params import _accessors, _p
from ._spec import FitSpec, metadata


def fingerprint(model) -> dict:
    """The model's class and its weights' names, shapes and dtypes, in order: what a run's checkpoints fit.

    The weights' short names (``kernel``), not their paths: Keras numbers its layers' names per
    session (``dense_3``), so the same model built again in a notebook resumes its run.
    """
    described = [(w.name, tuple(int(d) for d in w.shape), str(w.dtype)) for w in model.weights]
    return {"framework": "keras", "model": f"{type(model).__module__}.{type(model).__qualname__}",
            "tensors": len(described), "parameters": int(sum(int(np.prod(shape)) for _, shape, _ in described)),
            "digest": hashlib.sha256(repr(described).encode()).hexdigest()}


def _callables(value) -> dict:
    """The functions and custom Keras classes in a ``loss`` or ``metrics`` value, by the names Keras saves them under."""
    values = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else [value]
    found = {}
    for item in values:
        if isinstance(item, (list, tuple, dict)):
            found.update(_callables(item))
        elif inspect.isfunction(item) or isinstance(item, type):
            found[item.__name__] = item
        elif item is not None and not isinstance(item, str) and not type(item).__module__.startswith("keras"):
            found[type(item).__name__] = type(item)
    return found


@_accessors
class KerasEstimator(HorovodEstimator):
    """horovod.spark's ``KerasEstimator``: fit a DataFrame with a Keras 3 model, get a ``KerasModel``.

    ``model``: a ``keras.Model``, compiled, or given ``optimizer`` (a Keras optimizer or its name)
    and ``loss`` (and ``metrics``, ``loss_weights``), which override the model's own: a copy of
    the model is compiled with them, the model itself is left as it is. The model is called with one float32 tensor ``(rows, *shape)`` per feature column
    (a list where there are several; a number is ``(rows, 1)``). Integer labels arrive as int64
    class indices, others as float32. ``callbacks``: Keras callbacks, run on every rank.
    ``custom_objects``: what ``keras.models.load_model`` needs to load the model. ``decode``:
    ``{column: fn}`` for binary feature columns (encoded images): ``fn(cell bytes)`` returns the
    row's NumPy array, of one shape for every row, in the ranks' reader threads and in the fitted
    model's ``transform``, which keeps it. See docs/ml.md.
    """

    _framework = "keras"
    custom_objects = _p("custom_objects", "the custom layers, losses and metrics the model needs to load: {name: object}")
    _extra_defaults = {"custom_objects": None}

    def __init__(self, **kwargs):
        super().__init__(**kwargs)

    def _fingerprint(self, model) -> dict:
        return fingerprint(model)

    def _check_params(self, who: str, parquet: bool = False) -> None:
        super()._check_params(who, parquet)
        import keras

        model, optimizer = self.getModel(), self.getOptimizer()
        if not isinstance(model, keras.Model):
            raise ValueError(f"{who}: model must be a Keras 3 keras.Model, got {type(model).__name__}; build it with "
                             "keras.Sequential, the functional API or a keras.Model subclass.")
        if not model.compiled:
            missing = [name for name in ("optimizer", "loss") if self.getOrDefault(name) is None]
            if missing:
                raise ValueError(f"{who}: the model is not compiled and {' and '.join(missing)} "
                                 f"{'is' if len(missing) == 1 else 'are'} not given; compile "
                                 "it (model.compile(optimizer='adam', loss='mse')) or pass optimizer= and loss= to "
                                 "the estimator.")
        if optimizer is not None and not isinstance(optimizer, (str, keras.optimizers.Optimizer)):
            raise ValueError(f"{who}: optimizer must be a Keras optimizer (keras.optimizers.Adam(1e-3)) or its name "
                             f"('adam'), got {type(optimizer).__name__}.")
        objects = self.getCustomObjects()
        if objects is not None and not isinstance(objects, dict):
            raise ValueError(f"{who}: custom_objects must be a dict {{name: class or function}}, got "
                             f"{type(objects).__name__}.")
        if self.getBackwardPassesPerStep() != 1:
            raise ValueError(f"{who}: backward_passes_per_step={self.getBackwardPassesPerStep()} is not implemented "
                             "for Keras; create the optimizer with gradient_accumulation_steps="
                             f"{self.getBackwardPassesPerStep()} instead (Keras 3 accumulates itself).")
        for callback in self.getCallbacks() or []:
            if not isinstance(callback, keras.callbacks.Callback):
                raise ValueError(f"{who}: callbacks must be Keras callbacks (keras.callbacks.Callback), got "
                                 f"{type(callback).__name__}.")

    def _custom_objects(self) -> dict:
        """The user's ``custom_objects``, with the functions given as (or compiled into the model as) losses and
        metrics, which Keras saves by name."""
        found = _callables(getattr(self.getModel(), "loss", None))
        found.update(_callables(self.getLoss()))
        found.update(_callables(self.getMetrics() or []))
        found.update(self.getCustomObjects() or {})
        return found

    def _initial_model(self, who: str):
        """A copy of the model, compiled as the ranks train it (the given optimizer, loss and metrics override the
        model's own), its optimizer built: the user's model is left as it is."""
        import keras

        model, objects = self.getModel(), self._custom_objects()
        try:
            copy = load_keras(keras_bytes(model), objects)
        except Exception as exc:
            raise ValueError(f"{who}: the model cannot be saved and loaded back as a .keras file, as the ranks load it: "
                             f"{type(exc).__name__}: {exc}. Register its custom layers, losses and metrics with "
                             "@keras.saving.register_keras_serializable(), or pass them as custom_objects={name: "
                             "object}.") from exc
        given = {name: self.getOrDefault(name) for name in ("optimizer", "loss", "metrics", "loss_weights")}
        given = {name: value for name, value in given.items() if value is not None and value != []}
        if given:
            config = {}
            if copy.compiled:
                with keras.saving.custom_object_scope(objects):
                    config = keras.saving.deserialize_keras_object(copy.get_compile_config())
            optimizer = given.get("optimizer")
            if isinstance(optimizer, keras.optimizers.Optimizer):  # a new one: the user's stays unbuilt
                given["optimizer"] = type(optimizer).from_config(optimizer.get_config())
            try:
                copy.compile(**{**config, **given})
            except Exception as exc:
                raise ValueError(f"{who}: the model does not compile with {sorted(given)} as given: "
                                 f"{type(exc).__name__}: {exc}. Fix those arguments.") from exc
        if getattr(copy, "optimizer", None) is None:
            raise ValueError(f"{who}: the {type(model).__name__} loaded back from its .keras file is not compiled (a "
                             "model that overrides compile() must also override get_compile_config() and "
                             "compile_from_config()); pass optimizer= and loss= to the estimator instead.")
        if not copy.optimizer.built:
            copy.optimizer.build(copy.trainable_variables)
        return copy

    def _check_model(self, features, labels, weight, row, who: str):
        model = self.getModel()

        def value(column):
            return row[column.name].toArray() if column.kind == "vector" else row[column.name]

        inputs = [np.asarray([value(c)], dtype=np.float32).reshape((1, *(c.shape or (1,)))) for c in features]
        try:
            outputs = as_outputs(model(inputs[0] if len(inputs) == 1 else inputs, training=False))
        except Exception as exc:
            raise ValueError(f"{who}: the model fails on the first row of the DataFrame (inputs of shapes "
                             f"{[x.shape for x in inputs]} from feature_cols {[c.name for c in features]}): "
                             f"{type(exc).__name__}: {exc}. Fix feature_cols, or the model's input shapes.") from exc
        if len(outputs) != len(labels):
            raise ValueError(f"{who}: the model returns {len(outputs)} output(s), but label_cols has {len(labels)} "
                             f"column(s) {[c.name for c in labels]}; return one output per label column.")
        output_shapes, label_values = [], []
        for output, column in zip(outputs, labels):
            per_row = tuple(int(d) for d in output.shape[1:])
            classes = column.integer and column.shape == () and len(output.shape) == 2  # class scores for an index
            if int(np.prod(per_row)) != int(np.prod(column.shape)) and not classes:
                raise ValueError(
                    f"{who}: the model's output for label {column.name!r} has shape {per_row} per row "
                    f"({count_values(int(np.prod(per_row)))}), but the label has shape {column.shape} "
                    f"({count_values(int(np.prod(column.shape)))}); make the model's last layer match the label, or pass "
                    "the matching label column.")
            output_shapes.append(per_row)
            shape = per_row if not classes else column.shape
            label_values.append(np.asarray([value(column)], dtype=np.int64 if column.integer else np.float32)
                                .reshape((1, *shape)))
        initial = self._initial_model(who)
        weights = np.asarray([float(row[weight.name])], dtype=np.float32) if weight is not None else None
        try:
            initial.compute_loss(y=label_values[0] if len(labels) == 1 else label_values,
                                 y_pred=outputs[0] if len(outputs) == 1 else outputs, sample_weight=weights)
        except Exception as exc:
            raise ValueError(f"{who}: the loss fails on the model's output for the first row: {type(exc).__name__}: "
                             f"{exc}. Check the loss against the label columns' types (integer labels arrive as "
                             "int64 class indices, others as float32).") from exc
        self._initial_bytes = keras_bytes(initial)
        return output_shapes

    def _write_initial(self, run: RunDir) -> None:
        data = self.__dict__.pop("_initial_bytes", None) or keras_bytes(self._initial_model("KerasEstimator.fit"))
        run.store.write(run.file_url(INITIAL), data)

    def _framework_objects(self, spec: FitSpec) -> dict:
        return {"custom_objects": self._custom_objects(), "callbacks": list(self.getCallbacks() or []),
                "compression": self.getGradientCompression(), "transformation_fn": self.getTransformationFn()}

    def _train_function(self):
        return train

    def _fitted(self, run: RunDir, spec: FitSpec, history) -> KerasModel:
        done = len(history) if isinstance(history, list) else spec.epochs  # fewer where a callback stopped early
        newest = run.newest()
        if newest is None or newest[0] != done:
            raise RuntimeError(f"The run {run.run_id!r} ended without its checkpoint of epoch {done} in "
                               f"{run.checkpoints_url}; fit again with the same run_id to resume it.")
        data = run.store.read(f"{newest[1]}/{CHECKPOINT}")
        state = json.loads(run.store.read(f"{newest[1]}/{STATE}"))
        objects = self._custom_objects()  # the loss and metric functions too: KerasModel.load compiles the model
        model = load_keras(data, objects)
        fitted = KerasModel(model=model, history=state["history"], feature_columns=self.getFeatureCols(),
                            label_columns=self.getLabelCols(), custom_objects=objects or None,
                            run_id=run.run_id, decode=spec.data.decode, _metadata=metadata(spec))
        fitted._use_file(run.write_model(MODEL, data))  # the checkpoint's bytes: exactly the fitted model
        return fitted


def _tf_device(tf, device: str) -> str:
    """TensorFlow's name for ``device`` (``cuda:n`` or ``cpu``): the GPU where TensorFlow sees it, else the CPU."""
    if device.startswith("cuda"):
        gpus = tf.config.list_logical_devices("GPU")
        index = int(device.split(":", 1)[1]) if ":" in device else 0
        if gpus:
            return f"/GPU:{index if index < len(gpus) else 0}"
    return "/CPU:0"


def load_for_predict(source: str | None, blob: bytes | None, device: str, custom_objects: dict | None = None):
    """Executor side: the model from its file (or bytes), as ``predict(list of arrays)`` on ``device``."""
    import tensorflow as tf

    from ..data._metadata import resolve_url

    for gpu in tf.config.list_physical_devices("GPU"):  # a Python worker shares its GPU: take memory as needed
        try:
            tf.config.experimental.set_memory_growth(gpu, True)
        except RuntimeError:  # TensorFlow has initialised its devices already; its choice stands
            pass
    if source is not None:
        fs, path = resolve_url(source)
        with fs.open_input_stream(path) as f:
            blob = f.read()
    model = load_keras(blob, custom_objects, compile=False)
    where = _tf_device(tf, device)

    def predict(inputs: list) -> list:
        with tf.device(where):
            outputs = as_outputs(model(inputs[0] if len(inputs) == 1 else list(inputs), training=False))
        return [np.asarray(output, dtype=np.float32) for output in outputs]

    return predict


@_accessors
class KerasModel(HorovodModel):
    """horovod.spark's ``KerasModel``: ``transform(df)`` adds ``<label>__output`` columns predicted on the executors."""

    custom_objects = _p("custom_objects", "the custom layers, losses and metrics the model needs to load: {name: object}")
    _extra_defaults = {"custom_objects": None}
    _model_file_name = MODEL
    _load_for_predict = staticmethod(load_for_predict)

    def __init__(self, **kwargs):
        super().__init__(**kwargs)

    def _predict_spec(self, batch_size: int = 1024):
        spec = super()._predict_spec(batch_size)
        objects = self.getCustomObjects()
        return dataclasses.replace(spec, load=functools.partial(load_for_predict, custom_objects=objects)) \
            if objects else spec

    def _serialize(self, model) -> bytes:
        return keras_bytes(model)

    def _save_model(self, model, fs, root: str) -> None:
        with fs.open_output_stream(posixpath.join(root, MODEL)) as out:
            out.write(keras_bytes(model))

    @classmethod
    def _load_model(cls, fs, root: str):
        import cloudpickle

        from ._persistence import OBJECTS

        with fs.open_input_stream(posixpath.join(root, OBJECTS)) as f:
            objects = cloudpickle.loads(f.read()).get("custom_objects")  # the Reader sets the Params after this
        with fs.open_input_stream(posixpath.join(root, MODEL)) as f:
            return load_keras(f.read(), objects)

    def _log_to_mlflow(self, mlflow) -> None:
        import mlflow.tensorflow

        mlflow.tensorflow.log_model(self.getModel(), name="model")
