"""``hvd.elastic`` for Keras 3: ``KerasState``, the elastic callbacks and ``run``, as Horovod's ``horovod.keras.elastic``.

A commit is kept in this process's memory and, inside a HorovodRunner run, off the ranks too
(see ``collective/_core/_elastic.py``).
"""

from __future__ import annotations

import keras

from .._core._elastic import HostsUpdatedInterrupt, HostUpdateResult, ObjectState, State
from ..tensorflow.elastic import TensorFlowKerasState, run

__all__ = ["KerasState", "CommitStateCallback", "UpdateBatchStateCallback", "UpdateEpochStateCallback",
           "TensorFlowKerasState", "ObjectState", "State", "HostsUpdatedInterrupt", "HostUpdateResult", "run"]


class KerasState(TensorFlowKerasState):
    """A Keras model, its optimizer (``optimizer`` or the model's own) and plain values (any keyword)."""

    def __init__(self, model, optimizer=None, **kwargs):
        super().__init__(model, optimizer=optimizer, backend=keras.backend, **kwargs)


class CommitStateCallback(keras.callbacks.Callback):
    """Commits ``state`` every ``batches_per_commit`` batches, and at the end of each epoch.

    Each commit is made once every callback has seen the batch or epoch end, at the next batch's or
    epoch's start (or the end of training), so that it holds what ``UpdateBatchStateCallback`` and
    ``UpdateEpochStateCallback`` set, in whatever order they are listed: a commit at an epoch's end
    resumes at the next epoch. (Horovod commits at once, before the callbacks listed after it, so
    that in its documented order a restart repeats the epoch.)
    """

    def __init__(self, state, batches_per_commit: int = 1):
        super().__init__()
        self.state = state
        self.batches_per_commit = batches_per_commit
        self.batches_remaining = batches_per_commit
        self._due = False

    def on_train_begin(self, logs=None):
        self.batches_remaining = self.batches_per_commit  # alike on every rank after a reset
        self._due = False

    def on_train_batch_end(self, batch, logs=None):
        self.batches_remaining -= 1
        if self.batches_remaining == 0:
            self._due = True
            self.batches_remaining = self.batches_per_commit

    def on_epoch_end(self, epoch, logs=None):
        self._due = True

    def on_train_batch_begin(self, batch, logs=None):
        self._commit_if_due()

    def on_epoch_begin(self, epoch, logs=None):
        self._commit_if_due()

    def on_train_end(self, logs=None):
        self._commit_if_due()

    def _commit_if_due(self) -> None:
        if self._due:
            self._due = False
            self.state.commit()


class UpdateBatchStateCallback(keras.callbacks.Callback):
    """Keeps ``state.batch`` at the batch just finished (0 after each epoch).

    It sets ``params["steps"]`` short by ``state.batch`` at the first epoch after a reset, as Horovod's, but Keras 3
    does not read it back: skip the first ``state.batch`` batches of your data yourself to resume mid-epoch."""

    def __init__(self, state):
        super().__init__()
        self.state = state
        self.steps_per_epoch = None

    def on_train_begin(self, logs=None):
        self.steps_per_epoch = None

    def on_epoch_begin(self, epoch, logs=None):
        if self.params.get("steps"):
            if self.steps_per_epoch is None:
                self.steps_per_epoch = self.params.get("steps")
            self.params["steps"] = self.steps_per_epoch - self.state.batch

    def on_train_batch_end(self, batch, logs=None):
        self.state.batch = batch

    def on_epoch_end(self, epoch, logs=None):
        self.state.batch = 0


class UpdateEpochStateCallback(keras.callbacks.Callback):
    """Keeps ``state.epoch`` at the next epoch to run, counted across resets (Keras counts from 0 each time)."""

    def __init__(self, state):
        super().__init__()
        self.state = state
        self.initial_epoch = state.epoch

    def on_train_begin(self, logs=None):
        self.initial_epoch = self.state.epoch

    def on_epoch_end(self, epoch, logs=None):
        self.state.epoch = self.initial_epoch + epoch + 1
