"""``TorchEstimator`` and ``TorchModel``: horovod.spark.torch's, on the runner, the sharded readers and the Store.

``TorchEstimator(model=net, optimizer=opt, loss=F.mse_loss, ...)`` trains ``net`` with ``opt``
(built on ``net.parameters()``) under ``hvd.DistributedOptimizer`` on ``num_proc`` ranks; the rank
loop is ``_torch_train.py``. ``fit`` returns a ``TorchModel`` whose ``transform`` predicts on the
executors (``_predict.py``).
"""

from __future__ import annotations

import copy
import hashlib
import posixpath

import cloudpickle
import numpy as np

from ._checkpoints import RunDir
from ._columns import count_values, numel
from ._estimator import HorovodEstimator
from ._model import HorovodModel
from ._params import _accessors, _p
from ._spec import FitSpec, metadata
from ._torch_predict import load_for_predict
from ._torch_train import CHECKPOINT, INITIAL, MODEL, as_outputs, feature_tensors, label_tensors, matched, train


def fingerprint(model) -> dict:
    """The model's class and its state's names, shapes and dtypes: what a run's checkpoints fit."""
    state = model.state_dict()
    described = sorted((name, tuple(t.shape), str(t.dtype)) for name, t in state.items())
    return {"framework": "torch", "model": f"{type(model).__module__}.{type(model).__qualname__}",
            "tensors": len(described), "parameters": int(sum(numel(shape) for _, shape, _ in described)),
            "digest": hashlib.sha256(repr(described).encode()).hexdigest()}


def input_shapes_of(features, given) -> tuple:
    """Per feature, the per-row shape the model takes: ``input_shapes`` (horovod.spark's, batch dimension first) or
    the column's own (a number: ``(1,)``)."""
    if given:
        return tuple(tuple(int(d) for d in shape[1:]) for shape in given)
    return tuple(column.shape or (1,) for column in features)


def dry_run(model, features, labels, row, given_shapes, who: str):
    """Run ``model`` on the first ``row`` on the driver, as the ranks will: ``(outputs, labels, per-row output shapes)``,
    or ValueError where the outputs do not match the label columns (their number, or each one's size)."""
    import torch

    shapes = input_shapes_of(features, given_shapes)
    batch = {c.name: np.asarray([row[c.name].toArray() if c.kind == "vector" else row[c.name]]) for c in
             (*features, *labels)}
    try:
        inputs = feature_tensors(batch, features, shapes, torch)
    except ValueError as exc:
        raise ValueError(f"{who}: the feature columns do not fit input_shapes={given_shapes!r} ({exc}); give each "
                         "feature column's shape, batch dimension first.") from exc
    label_values = label_tensors(batch, labels, torch)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            outputs = as_outputs(model(*inputs))
    except Exception as exc:
        raise ValueError(f"{who}: the model fails on the first row of the DataFrame (inputs of shapes "
                         f"{[tuple(x.shape) for x in inputs]} from feature_cols {[c.name for c in features]}): "
                         f"{type(exc).__name__}: {exc}. Fix feature_cols or input_shapes.") from exc
    finally:
        model.train(was_training)
    if len(outputs) != len(labels):
        raise ValueError(f"{who}: the model returns {len(outputs)} output(s), but label_cols has {len(labels)} "
                         f"column(s) {[c.name for c in labels]}; return one output per label column.")
    output_shapes = []
    for output, column in zip(outputs, labels):
        per_row = tuple(output.shape[1:])
        classes = column.integer and column.shape == () and output.dim() == 2  # class scores for a class index
        if numel(per_row) != numel(column.shape) and not classes:
            raise ValueError(
                f"{who}: the model's output for label {column.name!r} has shape {per_row} per row "
                f"({count_values(numel(per_row))}), but the label has shape {column.shape} "
                f"({count_values(numel(column.shape))}); make the model's last layer match the label, or pass the "
                "matching label column.")
        output_shapes.append(per_row)
    return outputs, label_values, output_shapes


@_accessors
class TorchEstimator(HorovodEstimator):
    """horovod.spark's ``TorchEstimator``: fit a DataFrame with a torch model, get a ``TorchModel``.

    ``model``: an ``nn.Module``; ``optimizer``: a torch optimizer over its parameters; ``loss``: a
    function ``loss(output, label)`` (or a list, one per label column, weighted by ``loss_weights``);
    the model is called as ``model(*features)``, one tensor per feature column (float32,
    ``(rows, *shape)``, reshaped to ``input_shapes`` where given). Integer labels arrive as int64
    class indices, others as float32. ``metrics``: functions ``metric(output, label)`` averaged over
    each epoch. ``decode``: ``{column: fn}`` for binary feature columns (encoded images):
    ``fn(cell bytes)`` returns the row's NumPy array, of one shape for every row; it runs in the
    ranks' reader threads, and in the fitted model's ``transform``, which keeps it. See docs/ml.md.
    """

    _framework = "torch"
    input_shapes = _p("input_shapes", "per feature column, the shape the model takes, batch dimension first: "
                                      "[[-1, 1, 28, 28]]")
    _extra_defaults = {"input_shapes": None}

    def __init__(self, **kwargs):
        super().__init__(**kwargs)

    def _fingerprint(self, model) -> dict:
        return fingerprint(model)

    def _check_params(self, who: str, parquet: bool = False) -> None:
        super()._check_params(who, parquet)
        import torch

        if not isinstance(self.getModel(), torch.nn.Module):
            raise ValueError(f"{who}: model must be a torch.nn.Module, got {type(self.getModel()).__name__}.")
        optimizer = self.getOptimizer()
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ValueError(f"{who}: optimizer must be a torch.optim.Optimizer built on model.parameters(), got "
                             f"{type(optimizer).__name__}.")
        parameters = {id(p) for p in self.getModel().parameters()}
        if not any(id(p) in parameters for group in optimizer.param_groups for p in group["params"]):
            raise ValueError(f"{who}: the optimizer holds none of the model's parameters; build it on this model: "
                             "torch.optim.SGD(model.parameters(), lr=...).")
        losses = self.getLoss() if isinstance(self.getLoss(), (list, tuple)) else [self.getLoss()]
        if not all(callable(loss) for loss in losses):
            raise ValueError(f"{who}: loss must be a function loss(output, label) or a list of them, one per label "
                             f"column; got {self.getLoss()!r}.")
        if isinstance(self.getLoss(), (list, tuple)) and len(losses) != len(self.getLabelCols()):
            raise ValueError(f"{who}: loss is a list of {len(losses)} functions for {len(self.getLabelCols())} label "
                             "columns; pass one function, or one per label column.")

    def _check_model(self, features, labels, weight, row, who: str):
        outputs, label_values, output_shapes = dry_run(self.getModel(), features, labels, row, self.getInputShapes(),
                                                       who)
        losses = self._losses()
        try:
            for loss, output, label in zip(losses, outputs, matched(outputs, label_values)):
                loss(output, label)
        except Exception as exc:
            raise ValueError(f"{who}: the loss fails on the model's output for the first row: {type(exc).__name__}: "
                             f"{exc}. Check the loss against the label columns' types (integer labels arrive as "
                             "int64 class indices, others as float32).") from exc
        return output_shapes

    def _losses(self) -> list:
        loss = self.getLoss()
        return list(loss) if isinstance(loss, (list, tuple)) else [loss] * len(self.getLabelCols())

    def _write_initial(self, run: RunDir) -> None:
        import torch

        with run.store.open_output(run.file_url(INITIAL)) as out:
            torch.save({"model": self.getModel(), "optimizer": self.getOptimizer()}, out, pickle_module=cloudpickle)

    def _framework_objects(self, spec: FitSpec) -> dict:
        return {"losses": self._losses(), "loss_weights": self.getLossWeights(), "metrics": list(self.getMetrics()),
                "compression": self.getGradientCompression(), "transformation_fn": self.getTransformationFn(),
                "input_shapes": input_shapes_of(spec.data.features, self.getInputShapes())}

    def _train_function(self):
        return train

    def _fitted(self, run: RunDir, spec: FitSpec, history) -> TorchModel:
        state = final_checkpoint(run, spec, CHECKPOINT)
        return fitted_model(TorchModel, self, run, spec, state["model"], state["history"])


def final_checkpoint(run: RunDir, spec: FitSpec, name: str) -> dict:
    """The file ``name`` of the run's checkpoint of its last epoch, loaded on the driver's CPU."""
    import torch

    newest = run.newest()
    if newest is None or newest[0] != spec.epochs:
        raise RuntimeError(f"The run {run.run_id!r} ended without its checkpoint of epoch {spec.epochs} in "
                           f"{run.checkpoints_url}; fit again with the same run_id to resume it.")
    with run.store.filesystem.open_input_file(run.store.path_of(f"{newest[1]}/{name}")) as f:
        return torch.load(f, map_location="cpu", weights_only=False)


def fitted_model(model_class, estimator, run: RunDir, spec: FitSpec, state_dict: dict, history: list):
    """A ``model_class`` (TorchModel, LightningModel) holding a copy of the estimator's model with ``state_dict``, whose
    file (``model-<digest>.pt`` in the run's directory, its own: a later fit of the run writes another) the executors
    load."""
    model = copy.deepcopy(estimator.getModel())
    model.load_state_dict(state_dict)
    model.eval()
    fitted = model_class(model=model, history=history, feature_columns=estimator.getFeatureCols(),
                         label_columns=estimator.getLabelCols(), run_id=run.run_id,
                         input_shapes=estimator.getInputShapes(), decode=spec.data.decode, _metadata=metadata(spec))
    fitted._use_file(run.write_model(MODEL, fitted._serialize(model)))
    return fitted


@_accessors
class TorchModel(HorovodModel):
    """horovod.spark's ``TorchModel``: ``transform(df)`` adds ``<label>__output`` columns predicted on the executors."""

    input_shapes = _p("input_shapes", "per feature column, the shape the model takes, batch dimension first")
    _extra_defaults = {"input_shapes": None}
    _model_file_name = MODEL
    _load_for_predict = staticmethod(load_for_predict)

    def __init__(self, **kwargs):
        super().__init__(**kwargs)

    def _input_shapes(self, features) -> tuple:
        return input_shapes_of(features, self.getInputShapes())

    def _serialize(self, model) -> bytes:
        import io

        import torch

        buffer = io.BytesIO()
        torch.save(model, buffer, pickle_module=cloudpickle)
        return buffer.getvalue()

    def _save_model(self, model, fs, root: str) -> None:
        import torch

        with fs.open_output_stream(posixpath.join(root, MODEL)) as out:
            torch.save(model, out, pickle_module=cloudpickle)

    @classmethod
    def _load_model(cls, fs, root: str):
        import torch

        with fs.open_input_file(posixpath.join(root, MODEL)) as f:
            return torch.load(f, map_location="cpu", weights_only=False)

    def _log_to_mlflow(self, mlflow) -> None:
        import inspect

        import mlflow.pytorch

        accepted = inspect.signature(mlflow.pytorch.log_model).parameters
        kwargs = {("name" if "name" in accepted else "artifact_path"): "model"}  # mlflow 3 renamed it
        if "serialization_format" in accepted:
            kwargs["serialization_format"] = "pickle"  # mlflow 3's default, pt2, needs an input example to trace
        mlflow.pytorch.log_model(self.getModel(), **kwargs)

