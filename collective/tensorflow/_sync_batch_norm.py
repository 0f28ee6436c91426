"""SyncBatchNormalization: Keras batch normalization whose batch statistics span every rank."""

from __future__ import annotations

import keras
import tensorflow as tf

from .._core import Sum, global_process_set
from ._ops import allreduce


class SyncBatchNormalization(keras.layers.BatchNormalization):
    """``keras.layers.BatchNormalization`` whose training-time mean and variance are those of
    the ranks' batches together (Horovod's layer; uneven batches are weighted by their size).

    ``fused`` is accepted for Horovod compatibility and must stay False. The statistics are
    summed across the ranks in one differentiable allreduce, so gradients are those of the
    global batch too.
    """

    def __init__(self, fused=False, process_set=global_process_set, **kwargs):
        if fused in (True, None):
            raise ValueError(f"SyncBatchNormalization(fused={fused}): a fused kernel cannot share statistics "
                             "across ranks; leave fused=False.")
        if not kwargs.get("name"):
            kwargs["name"] = "sync_batch_normalization"
        super().__init__(**kwargs)
        self._process_set = process_set

    def _moments(self, inputs, mask):
        mean, variance = super()._moments(inputs, mask)
        ps = self._process_set
        if ps.size() == 1 or not ps.included():
            return mean, variance
        if mask is None:
            shape = tf.shape(inputs)
            count = tf.cast(tf.reduce_prod(tf.gather(shape, self._reduction_axes)), mean.dtype)
        else:  # the rows the mask keeps
            keep = tf.cast(tf.broadcast_to(tf.expand_dims(mask, -1), tf.shape(inputs)), mean.dtype)
            count = tf.reduce_sum(keep) / tf.cast(tf.shape(inputs)[self.axis], mean.dtype)
        # Var[X] = E[X^2] - E[X]^2, each moment weighted by its rank's number of values
        local = tf.stack([mean * count, (variance + tf.square(mean)) * count, tf.ones_like(mean) * count])
        total = allreduce(local, op=Sum, process_set=ps)
        group_mean = total[0] / total[2]
        return group_mean, total[1] / total[2] - tf.square(group_mean)
