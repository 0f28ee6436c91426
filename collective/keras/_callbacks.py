"""Keras callbacks: the same start on every rank, and metrics averaged over the ranks."""

from __future__ import annotations

import keras
import numpy as np

from ..tensorflow._ops import broadcast_variables
from ..torch import allgather_object


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """At the start of training, every rank takes rank ``root_rank``'s weights (and optimizer state)."""

    def __init__(self, root_rank: int = 0, device: str = ""):
        super().__init__()
        self.root_rank = root_rank

    def on_train_begin(self, logs=None):
        broadcast_variables(self.model.variables, self.root_rank)
        optimizer = self.model.optimizer
        if optimizer is not None and optimizer.built:
            broadcast_variables(optimizer.variables, self.root_rank)


class MetricAverageCallback(keras.callbacks.Callback):
    """At each epoch's end, every logged metric becomes its average over the ranks.

    Put it before callbacks that read the metrics (checkpoints, early stopping, logging).
    """

    def on_epoch_end(self, epoch, logs=None):
        if not logs:
            return
        names = sorted(logs)
        values = [float(np.asarray(logs[k])) for k in names]
        gathered = allgather_object(values)
        for i, k in enumerate(names):
            logs[k] = float(np.mean([g[i] for g in gathered]))
