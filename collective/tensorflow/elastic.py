"""``hvd.elastic`` for TensorFlow 2: ``TensorFlowState``, ``TensorFlowKerasState`` and ``run``, as Horovod's.

Eager TensorFlow only (as Horovod for TF2). A commit is kept in this process's memory and, inside
a HorovodRunner run, off the ranks too (see ``collective/_core/_elastic.py``).
"""

from __future__ import annotations

import tensorflow as tf

from .._core import rank
from .._core._elastic import HostsUpdatedInterrupt, HostUpdateResult, ObjectState, State, run
from ._functions import broadcast_object
from ._ops import broadcast_variables

__all__ = ["TensorFlowKerasState", "TensorFlowState", "ObjectState", "State", "HostsUpdatedInterrupt",
           "HostUpdateResult", "run"]


def _eager(what: str) -> None:
    if not tf.executing_eagerly():
        raise RuntimeError(f"hvd.elastic.{what} needs eager TensorFlow (as Horovod's for TensorFlow 2); build it "
                           "outside tf.function and TF1 graphs.")


def _variables(thing) -> list:
    """An optimizer's or model's variables: a list in Keras 3, a method in older optimizers."""
    variables = thing.variables
    return list(variables() if callable(variables) else variables)


class _VariablesState(ObjectState):
    """Saves, restores and syncs the values of ``_tracked()``'s variables, and plain values (any keyword)."""

    def __init__(self, **kwargs):
        self._save_variables()
        super().__init__(bcast_object=broadcast_object, get_rank=rank, **kwargs)

    def _tracked(self) -> list:
        raise NotImplementedError

    def save(self) -> None:
        self._save_variables()
        super().save()

    def restore(self) -> None:
        for var, value in zip(self._tracked(), self._values, strict=True):
            var.assign(value)
        super().restore()

    def sync(self) -> None:
        broadcast_variables(self._tracked(), root_rank=0, inplace=True)
        self._save_variables()
        super().sync()

    def _save_variables(self) -> None:
        self._values = [var.numpy() for var in self._tracked()]

    def _snapshot(self) -> dict:
        return dict(super()._snapshot(), variables=self._values)

    def _load(self, snapshot: dict) -> None:
        self._values = list(snapshot["variables"])
        super()._load(snapshot)


class TensorFlowState(_VariablesState):
    """A list of ``tf.Variable`` (``variables``) and plain values (any keyword), as attributes.

    ``session`` is TensorFlow 1's and is not used.
    """

    def __init__(self, variables=None, session=None, **kwargs):
        _eager("TensorFlowState")
        if variables is None:
            raise ValueError("hvd.elastic.TensorFlowState(variables=None): eager TensorFlow has no global variables "
                             "to default to; pass the variables to track, e.g. model.variables.")
        self.variables = list(variables)
        self.session = session
        super().__init__(**kwargs)

    def _tracked(self) -> list:
        return self.variables


class TensorFlowKerasState(_VariablesState):
    """A Keras model and its optimizer (``optimizer`` or the model's own), and plain values (any keyword).

    The model must be built. ``backend`` is TensorFlow 1's and is not used.
    """

    def __init__(self, model, optimizer=None, backend=None, **kwargs):
        _eager("TensorFlowKerasState")
        if not getattr(model, "built", True):
            raise ValueError("hvd.elastic state: the model is not built yet; call model.build(input_shape) (or run "
                             "one batch through it) first, so that its variables exist.")
        self.model = model
        self.optimizer = optimizer or model.optimizer
        if self.optimizer is not None and not getattr(self.optimizer, "built", True):
            self.optimizer.build(model.trainable_variables)  # Keras 3 makes its slots at the first step: now
        self.backend = backend
        super().__init__(**kwargs)

    def _tracked(self) -> list:
        return _variables(self.model) + (_variables(self.optimizer) if self.optimizer is not None else [])
