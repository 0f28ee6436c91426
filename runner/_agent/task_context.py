"""The Spark task the agent runs in, read for its rank: pyspark's ``TaskContext`` values (_common/spark_task.py).

The agent runs inside the Spark task (runner/_backends/spark.py and connect.py call ``run_task`` there), so pyspark's
worker has set the task's context in this process. ``read`` takes its values; ``for_rank`` writes the GPU addresses
as the rank sees them. On the driver (np<0) there is no task, and the rank gets none.
"""

from __future__ import annotations

import sys
from dataclasses import replace

from ..._common.spark_task import SparkTask

#: The local properties travel in the rank's environment, where one variable holds at most 128 KiB (Linux's
#: MAX_ARG_STRLEN); past this many characters only those Spark itself sets ("addresses", "spark.*") are kept.
MAX_PROPERTIES_CHARS = 64 << 10
_GPU = "gpu"  # the resource sparkhvd's tasks ask for (runner/_backends/spark.py: gpu_task_profile)


def read() -> SparkTask | None:
    """The values of the Spark task this process runs, or None where it runs none. Never imports pyspark: in a
    Spark task, pyspark's worker has."""
    module = sys.modules.get("pyspark.taskcontext")
    ctx = module.TaskContext.get() if module is not None else None
    if ctx is None:
        return None
    amount = ctx.cpuAmount() if hasattr(ctx, "cpuAmount") else None  # pyspark 4.3 on
    properties = {str(k): str(v) for k, v in (getattr(ctx, "_localProperties", None) or {}).items()}
    if sum(len(k) + len(v) for k, v in properties.items()) > MAX_PROPERTIES_CHARS:
        properties = {k: v for k, v in properties.items() if k == "addresses" or k.startswith("spark.")}
    return SparkTask(
        stage_id=int(ctx.stageId()), partition_id=int(ctx.partitionId()), attempt_number=int(ctx.attemptNumber()),
        task_attempt_id=int(ctx.taskAttemptId()), cpus=int(ctx.cpus()),
        barrier=isinstance(ctx, module.BarrierTaskContext),
        cpu_amount=None if amount is None else str(amount),
        resources={name: [str(a) for a in info.addresses] for name, info in (ctx.resources() or {}).items()},
        local_properties=properties)


def for_rank(task: SparkTask, placement: dict, *, pinned: bool, use_gpu: bool) -> SparkTask:
    """``task`` as its rank sees it. Spark's GPU addresses index the executor's ``CUDA_VISIBLE_DEVICES`` (where it
    has one); the rank has a list of its own, so where the runner ``pinned`` its GPUs they become the rank's indices
    into that list (``placement``'s ``cuda_devices``), the same convention pyspark's TorchDistributor maps through.
    Without ``use_gpu`` the rank uses no GPU, and its task lists none."""
    resources = dict(task.resources)
    if not use_gpu:
        resources.pop(_GPU, None)
    elif pinned and resources.get(_GPU):
        resources[_GPU] = [str(i) for i in placement.get("cuda_devices") or ()]
    return replace(task, resources=resources)
