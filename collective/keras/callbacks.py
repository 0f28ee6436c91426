"""Horovod's ``horovod.keras.callbacks`` / ``horovod.tensorflow.keras.callbacks``: ``hvd.callbacks.X``.

A public module name, not ``_callbacks``, because Horovod code reaches the callbacks by this
path (``hvd.callbacks.BroadcastGlobalVariablesCallback(0)``).
"""

from __future__ import annotations

from ._callbacks import (
                         BestModelCheckpoint,
                         BroadcastGlobalVariablesCallback,
                         LearningRateScheduleCallback,
                         LearningRateWarmupCallback,
                         MetricAverageCallback,
)

__all__ = ["BroadcastGlobalVariablesCallback", "MetricAverageCallback", "LearningRateWarmupCallback",
           "LearningRateScheduleCallback", "BestModelCheckpoint"]
