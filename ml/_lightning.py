"""``LightningEstimator`` and ``LightningModel``: horovod.spark.lightning's, on Lightning 2's own DDP.

``LightningEstimator(model=module, ...)`` trains a ``LightningModule`` with ``Trainer(strategy="ddp")``
on ``num_proc`` ranks, each its own node (the TorchDistributor drop-in's layout: ``devices=1``,
``num_nodes=num_proc``), which Lightning finds through torchrun's variables. The module's
``training_step`` gets each batch as a dict ``{column: tensor}`` (features float32, integer labels
int64); its ``configure_optimizers`` and logged metrics are its own. The rank side is
``_lightning_train.py``; the fitted ``LightningModel`` predicts with the module's ``forward``.
"""

from __future__ import annotations

import cloudpickle

from ..runner._shared.framework_env import NODE_PER_TASK
from ._checkpoints import RunDir
from ._estimator import HorovodEstimator
from ._lightning_train import CHECKPOINT, lightning, train
from ._params import _accessors, _p
from ._spec import FitSpec
from ._torch import TorchModel, dry_run, final_checkpoint, fingerprint, fitted_model, input_shapes_of
from ._torch_train import INITIAL


@_accessors
class LightningEstimator(HorovodEstimator):
    """horovod.spark's ``LightningEstimator``: fit a DataFrame with a ``LightningModule``, get a ``LightningModel``.

    ``trainer_args``: more ``lightning.Trainer`` arguments (``gradient_clip_val``, ``precision``, ...).
    ``callbacks``: Lightning callbacks. ``input_shapes``: as TorchEstimator's, for the forward pass
    that ``transform`` runs. ``decode``: ``{column: fn}`` for binary feature columns (encoded
    images), as TorchEstimator's: ``training_step`` gets the decoded column as a float32
    ``(rows, *shape)`` tensor, and the fitted model's ``transform`` decodes with the same ``fn``.
    See docs/ml.md.
    """

    _framework = "lightning"
    input_shapes = _p("input_shapes", "per feature column, the shape forward() takes, batch dimension first")
    trainer_args = _p("trainer_args", "more lightning.Trainer arguments, as a dict")
    _extra_defaults = {"input_shapes": None, "trainer_args": None}

    def __init__(self, **kwargs):
        super().__init__(**kwargs)

    def _fingerprint(self, model) -> dict:
        return {**fingerprint(model), "framework": "lightning"}

    def _check_params(self, who: str, parquet: bool = False) -> None:
        super()._check_params(who, parquet)
        pl = lightning()
        if not isinstance(self.getModel(), pl.LightningModule):
            raise ValueError(f"{who}: model must be a lightning.pytorch.LightningModule, got "
                             f"{type(self.getModel()).__name__}; for a plain nn.Module use TorchEstimator.")
        if self.getOptimizer() is not None or self.getLoss() is not None:
            raise ValueError(f"{who}: a LightningModule brings its own optimizer (configure_optimizers) and loss "
                             "(training_step); drop optimizer= and loss=.")
        reserved = {"strategy", "devices", "num_nodes", "max_epochs", "callbacks"} & set(self.getTrainerArgs() or {})
        if reserved:
            raise ValueError(f"{who}: trainer_args sets {sorted(reserved)}, which the estimator sets (num_proc, epochs, "
                             "callbacks=); pass them as the estimator's own parameters.")

    def _check_model(self, features, labels, weight, row, who: str):
        return dry_run(self.getModel(), features, labels, row, self.getInputShapes(), who)[2]

    def _write_initial(self, run: RunDir) -> None:
        import torch

        with run.store.open_output(run.file_url(INITIAL)) as out:
            torch.save({"model": self.getModel()}, out, pickle_module=cloudpickle)

    def _framework_objects(self, spec: FitSpec) -> dict:
        return {"callbacks": list(self.getCallbacks()), "trainer_args": dict(self.getTrainerArgs() or {}),
                "transformation_fn": self.getTransformationFn(),
                "input_shapes": input_shapes_of(spec.data.features, self.getInputShapes())}

    def _runner_options(self) -> dict:
        return {"layout": NODE_PER_TASK}  # Trainer(devices=1, num_nodes=num_proc) on any placement

    def _train_function(self):
        return train

    def _fitted(self, run: RunDir, spec: FitSpec, history) -> LightningModel:
        state = final_checkpoint(run, spec, CHECKPOINT)  # Lightning's own, with the history beside its state
        return fitted_model(LightningModel, self, run, spec, state["state_dict"], state["sparkhvd_history"])


@_accessors
class LightningModel(TorchModel):
    """horovod.spark's ``LightningModel``: ``transform(df)`` runs the module's ``forward`` on the executors."""
