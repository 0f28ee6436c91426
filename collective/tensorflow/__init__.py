"""The Horovod API for TensorFlow 2: ``import sparkhvd.collective.tensorflow as hvd``.

The same engine and communicator as ``sparkhvd.collective.torch`` (the framework-neutral core,
``collective/_core``; one c10d process group per process); tf.Tensors reach it through DLPack. Ops work eagerly and inside ``tf.function``, keep static
shapes where they are known, and have gradients.
"""

from __future__ import annotations

try:
    import tensorflow as _tf  # noqa: F401
except ModuleNotFoundError as _exc:  # Ray Train's guard: one sentence, the install command
    if _exc.name != "tensorflow":
        raise
    raise ModuleNotFoundError("TensorFlow isn't installed: pip install 'sparkhvd[tensorflow]'",
                              name="tensorflow") from None

from .._core import (
    Adasum,
    Average,
    Max,
    Min,
    ProcessSet,
    Product,
    ReduceOp,
    Sum,
    add_process_set,
    ccl_built,
    cross_rank,
    cross_size,
    cuda_built,
    ddl_built,
    global_process_set,
    gloo_built,
    gloo_enabled,
    is_homogeneous,
    is_initialized,
    local_rank,
    local_size,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    rank,
    remove_process_set,
    rocm_built,
    shutdown,
    size,
    start_timeline,
    stop_timeline,
)
from . import elastic, util
from ._compression import Compression
from ._devices import init  # the core's init, then only the rank's own GPU visible to TensorFlow
from ._functions import (
    allgather_object,
    broadcast_object,
    broadcast_object_fn,
    join,
    local_rank_op,
    local_size_op,
    process_set_included_op,
    rank_op,
    size_op,
)
from ._ops import (
    allgather,
    allreduce,
    alltoall,
    broadcast,
    broadcast_,
    broadcast_global_variables,
    broadcast_variables,
    grouped_allgather,
    grouped_allreduce,
    grouped_reducescatter,
    reducescatter,
)
from ._sync_batch_norm import SyncBatchNormalization
from ._tape import DistributedGradientTape, PartialDistributedGradientTape
from .util import _executing_eagerly  # noqa: F401 - Horovod's tests call hvd._executing_eagerly()

__all__ = [
    "init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size", "cross_rank",
    "cross_size", "is_homogeneous", "mpi_threads_supported", "mpi_enabled", "mpi_built", "gloo_enabled",
    "gloo_built", "nccl_built", "ddl_built", "ccl_built", "cuda_built", "rocm_built", "join",
    "rank_op", "local_rank_op", "size_op", "local_size_op", "process_set_included_op",
    "allreduce", "grouped_allreduce", "allgather", "grouped_allgather", "broadcast", "broadcast_",
    "broadcast_variables", "broadcast_global_variables", "alltoall", "reducescatter", "grouped_reducescatter",
    "ProcessSet", "global_process_set", "add_process_set", "remove_process_set",
    "broadcast_object", "broadcast_object_fn", "allgather_object", "DistributedGradientTape",
    "PartialDistributedGradientTape", "SyncBatchNormalization", "Compression", "util", "elastic",
    "ReduceOp", "Average", "Sum", "Adasum", "Min", "Max", "Product", "start_timeline", "stop_timeline",
]
