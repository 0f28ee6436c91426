"""Keras callbacks: the same start on every rank, and metrics averaged over the ranks."""

from __future__ import annotations

import keras
import numpy as np

from .._core import rank, size
from ..tensorflow import allgather_object, broadcast_variables
from ._optimizer import turn_off_xla


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """At the start of training, every rank takes rank ``root_rank``'s weights (and optimizer state).

    It also compiles the train step without XLA when the model asked for it (see DistributedOptimizer).
    """

    def __init__(self, root_rank: int = 0, device: str = "", local_variables=None):
        super().__init__()
        self.root_rank = root_rank
        self._local_vars = set()
        for var in local_variables or ():
            self.register_local_var(var)

    def register_local_var(self, var):
        """Leave ``var`` as each rank has it (Horovod's worker-local variable): it is not broadcast."""
        self._local_vars.add(id(var))

    def set_model(self, model):
        super().set_model(model)
        turn_off_xla(model)  # fit() sets the model before it makes the train step

    def on_train_begin(self, logs=None):
        broadcast_variables([v for v in self.model.variables if id(v) not in self._local_vars], self.root_rank)
        optimizer = self.model.optimizer
        if optimizer is not None and optimizer.built:
            broadcast_variables(optimizer.variables, self.root_rank)


class MetricAverageCallback(keras.callbacks.Callback):
    """At each epoch's end, every logged metric becomes its average over the ranks.

    Put it before callbacks that read the metrics (checkpoints, early stopping, logging).
    ``device`` is accepted for Horovod compatibility.
    """

    def __init__(self, device: str = ""):
        super().__init__()

    def on_epoch_end(self, epoch, logs=None):
        if not logs:
            return
        names = sorted(logs)
        values = [float(np.asarray(logs[k])) for k in names]
        gathered = allgather_object(values)
        for i, k in enumerate(names):
            logs[k] = float(np.mean([g[i] for g in gathered]))


class LearningRateScheduleCallback(keras.callbacks.Callback):
    """Sets the learning rate to ``initial_lr * multiplier(epoch)`` from ``start_epoch`` to ``end_epoch``.

    ``multiplier`` is a number or a function of the epoch; with ``staircase=False`` the epoch is
    fractional (``epoch + batch / steps_per_epoch``) and the rate changes every batch. The rate
    is logged as ``lr`` at each epoch's end. ``momentum_correction`` is accepted for Horovod
    compatibility; Keras 3 compiles momentum into the train step, so it is not adjusted.
    """

    def __init__(self, initial_lr, multiplier, start_epoch=0, end_epoch=None, staircase=True,
                 momentum_correction=True, steps_per_epoch=None):
        super().__init__()
        self.initial_lr = float(initial_lr)
        self.multiplier = multiplier if callable(multiplier) else (lambda epoch, m=multiplier: m)
        self.start_epoch = start_epoch
        self.end_epoch = end_epoch
        self.staircase = staircase
        self.steps_per_epoch = steps_per_epoch
        self.current_epoch = 0

    def _steps(self) -> int:
        steps = self.steps_per_epoch or (self.params or {}).get("steps")
        if not steps:
            raise ValueError("the learning-rate callback needs the number of steps per epoch; pass steps_per_epoch=.")
        return int(steps)

    def _set(self, epoch: float) -> None:
        self.model.optimizer.learning_rate.assign(self.initial_lr * self.multiplier(epoch))

    def on_epoch_begin(self, epoch, logs=None):
        self.current_epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        if self.current_epoch < self.start_epoch or (self.end_epoch is not None and self.current_epoch >= self.end_epoch):
            return
        if self.staircase:
            if batch == 0:
                self._set(self.current_epoch)
        else:
            self._set(self.current_epoch + batch / self._steps())

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs["lr"] = float(np.asarray(self.model.optimizer.learning_rate))


class LearningRateWarmupCallback(LearningRateScheduleCallback):
    """Ramps the learning rate from ``initial_lr / size()`` to ``initial_lr`` over ``warmup_epochs``.

    Horovod's rule (Goyal et al., 2017): at fractional epoch e, ``initial_lr / size() *
    (e * (size() - 1) / warmup_epochs + 1)``, counted so that each epoch ends on a round value.
    Pass the learning rate already scaled by ``size()`` as ``initial_lr``.
    """

    def __init__(self, initial_lr, warmup_epochs=5, momentum_correction=True, steps_per_epoch=None, verbose=0):
        def multiplier(epoch):
            epoch += 1.0 / self._steps()  # end each epoch on a round value, as Horovod does
            return 1.0 / size() * (epoch * (size() - 1) / warmup_epochs + 1)

        super().__init__(initial_lr, multiplier, start_epoch=0, end_epoch=warmup_epochs, staircase=False,
                         momentum_correction=momentum_correction, steps_per_epoch=steps_per_epoch)
        self.verbose = verbose

    def on_epoch_end(self, epoch, logs=None):
        super().on_epoch_end(epoch, logs)
        if epoch == self.end_epoch - 1 and self.verbose > 0 and rank() == 0:  # Horovod's line, on rank 0
            new_lr = float(np.asarray(self.model.optimizer.learning_rate))
            print("\nEpoch %d: finished gradual learning rate warmup to %g." % (epoch + 1, new_lr))


class BestModelCheckpoint(keras.callbacks.ModelCheckpoint):
    """Keras's ModelCheckpoint with ``save_best_only=True``, written by rank 0 only."""

    def __init__(self, filepath, monitor="val_loss", verbose=0, mode="auto", save_freq="epoch"):
        super().__init__(filepath, monitor=monitor, verbose=verbose, save_best_only=True, mode=mode,
                         save_freq=save_freq)

    def _save_model(self, *args, **kwargs):
        if rank() == 0:
            return super()._save_model(*args, **kwargs)
        return None
