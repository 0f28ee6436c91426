"""The Horovod API for Keras 3: ``import sparkhvd.collective.keras as hvd``.

``DistributedOptimizer`` wraps any Keras 3 optimizer so that ``model.fit`` averages gradients
across the ranks; the callbacks (also ``hvd.callbacks.X``, as in Horovod) broadcast the initial
state and average metrics. The topology and tensor functions are those of
``sparkhvd.collective.tensorflow``, which also answers as ``sparkhvd.collective.tensorflow.keras``
(Horovod's ``horovod.tensorflow.keras``).
"""

from __future__ import annotations

from ..tensorflow import (
                          Adasum,
                          Average,
                          Compression,
                          Max,
                          Min,
                          Product,
                          Sum,
                          allgather,
                          allgather_object,
                          allreduce,
                          broadcast,
                          broadcast_object,
                          broadcast_variables,
                          ccl_built,
                          cross_rank,
                          cross_size,
                          cuda_built,
                          ddl_built,
                          gloo_built,
                          gloo_enabled,
                          init,
                          is_initialized,
                          local_rank,
                          local_size,
                          mpi_built,
                          mpi_enabled,
                          mpi_threads_supported,
                          nccl_built,
                          rank,
                          rocm_built,
                          shutdown,
                          size,
                          start_timeline,
                          stop_timeline,
)
from . import callbacks, elastic
from ._optimizer import DistributedOptimizer, load_model
from .callbacks import (
                          BestModelCheckpoint,
                          BroadcastGlobalVariablesCallback,
                          LearningRateScheduleCallback,
                          LearningRateWarmupCallback,
                          MetricAverageCallback,
)

__all__ = [
    "init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size", "cross_rank", "cross_size",
    "mpi_threads_supported", "mpi_enabled", "mpi_built", "gloo_enabled", "gloo_built", "nccl_built", "ddl_built",
    "ccl_built", "cuda_built", "rocm_built",
    "allreduce", "allgather", "broadcast", "broadcast_variables", "broadcast_object", "allgather_object",
    "DistributedOptimizer", "load_model", "BroadcastGlobalVariablesCallback", "MetricAverageCallback",
    "LearningRateWarmupCallback", "LearningRateScheduleCallback", "BestModelCheckpoint", "Compression",
    "Average", "Sum", "Adasum", "Min", "Max", "Product", "callbacks", "elastic", "start_timeline", "stop_timeline",
]
