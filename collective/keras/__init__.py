"""The Horovod API for Keras 3: ``import sparkhvd.collective.keras as hvd``.

``DistributedOptimizer`` wraps any Keras 3 optimizer so that ``model.fit`` averages gradients
across the ranks; the callbacks broadcast the initial state and average metrics. The
topology and tensor functions are those of ``sparkhvd.collective.tensorflow``.
"""

from __future__ import annotations

from ..tensorflow import (Average, Compression, Max, Min, Product, Sum, allgather, allgather_object, allreduce,
                          broadcast, broadcast_object, broadcast_variables, cross_rank, cross_size, init,
                          is_initialized, local_rank, local_size, rank, shutdown, size)
from ._callbacks import (BestModelCheckpoint, BroadcastGlobalVariablesCallback, LearningRateScheduleCallback,
                         LearningRateWarmupCallback, MetricAverageCallback)
from ._optimizer import DistributedOptimizer, load_model

__all__ = [
    "init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size", "cross_rank", "cross_size",
    "allreduce", "allgather", "broadcast", "broadcast_variables", "broadcast_object", "allgather_object",
    "DistributedOptimizer", "load_model", "BroadcastGlobalVariablesCallback", "MetricAverageCallback",
    "LearningRateWarmupCallback", "LearningRateScheduleCallback", "BestModelCheckpoint", "Compression",
    "Average", "Sum", "Min", "Max", "Product",
]
