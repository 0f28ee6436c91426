"""The rank process's environment: its place in the run, the driver, its GPUs and its CPU threads.

The agent builds it (``rank_env``) from its own environment, after the driver has placed the rank. GPUs
are named as the host names them (``visible_gpus``), through the executor's own ``CUDA_VISIBLE_DEVICES``.
"""

from __future__ import annotations

import json
import os

from ..._common import settings, torch_ops
from ..._common.spark_task import SparkTask
from .._shared.framework_env import NAMES, NODE_PER_TASK, framework_env
from .spec import TaskSpec
from .task_context import for_rank


def rank_env(spec: TaskSpec, placement: dict, host_gpus: list[str], *, endpoints: list = (),
             node: tuple = (0, 1), task: SparkTask | None = None) -> dict:
    """The rank process's environment. ``host_gpus``: this job's GPUs on the host, in local-rank order
    (``_common/topology.py: host_gpus``), its ``CUDA_VISIBLE_DEVICES``; empty: the executor's is kept.
    ``endpoints`` and ``node``: what torchrun's variables and TF_CONFIG are made of (runner/_shared/framework_env.py);
    they replace any the executor has (another job's). In the ``node_per_task`` layout the rank sees its own
    GPUs only, as pyspark's TorchDistributor pins them, so that ``LOCAL_RANK=0`` indexes its own. ``task``: the Spark
    task the agent runs in (runner/_agent/task_context.py), which the rank's pyspark ``TaskContext.get()`` returns; None
    on the driver (np<0)."""
    if spec.layout == NODE_PER_TASK and host_gpus:
        own = placement.get("cuda_devices") or []
        j = placement["rank"] % spec.per_task  # where the rank's GPUs sit among its task's: the task's ranks are
        first = own[0] - j * len(own) if own else 0  # consecutive, each with len(own) entries of host_gpus
        host_gpus = host_gpus[first:first + spec.per_task * len(own)] if spec.per_task > 1 else [host_gpus[i] for i in own]
        placement = {**placement, "cuda_devices": [j * len(own) + i for i in range(len(own))]}
    elif spec.layout == NODE_PER_TASK and spec.use_gpu and placement["local_size"] > 1:
        # Spark gave the tasks no GPU addresses (a local master): as pyspark's TorchDistributor pins task i to the
        # driver's GPU i there, the host's i-th rank sees the host's i-th GPU alone
        visible = [d.strip() for d in (settings.CUDA_VISIBLE_DEVICES.get() or "").split(",") if d.strip()]
        local_rank = placement["local_rank"]
        if not visible or local_rank < len(visible):
            host_gpus = [visible[local_rank] if visible else str(local_rank)]
            placement = {**placement, "cuda_devices": [0]}
    env = {k: v for k, v in os.environ.items() if k not in NAMES}
    env.update(spec.env)
    env.update(framework_env(placement, layout=spec.layout, endpoints=list(endpoints), node=node,
                             run_id=spec.run_id, attempt=spec.attempt, max_restarts=spec.max_restarts,
                             per_task=spec.per_task))
    env.update({
        settings.DRIVER.name: f"{spec.address[0]}:{spec.address[1]}",
        settings.RUN_ID.name: spec.run_id,
        settings.PLACEMENT.name: json.dumps(placement),
        settings.PARENT_PID.name: str(os.getpid()),
        settings.RETURN.name: "all" if spec.every_value else "0",
        settings.PYTHONUNBUFFERED.name: "1",
    })
    env.pop(settings.TASK_CONTEXT.name, None)  # an agent that is itself a rank's child: never its parent's task
    if task is not None:
        env[settings.TASK_CONTEXT.name] = for_rank(task, placement, pinned=bool(host_gpus),
                                                   use_gpu=spec.use_gpu).to_json()
    if spec.commit_dir:
        env[settings.COMMIT_DIR.name] = spec.commit_dir
    if spec.network_interface:
        env[settings.NETWORK_INTERFACE.name] = spec.network_interface
        env[settings.GLOO_SOCKET_IFNAME.name] = env[settings.NCCL_SOCKET_IFNAME.name] = spec.network_interface
    if settings.OMP_NUM_THREADS.name not in env:
        # As torchrun does: ranks sharing a host split its cores, instead of each starting one OpenMP
        # thread per core, whose spinning would starve the other ranks (docs/performance.md).
        env[settings.OMP_NUM_THREADS.name] = str(omp_threads(placement["local_size"]))
    if settings.TORCH_FR_BUFFER_SIZE.name not in env and "TORCH_NCCL_TRACE_BUFFER_SIZE" not in env:
        # torch's flight recorder: the stall report names the torch.distributed op ranks wait in (_common/torch_ops.py)
        env[settings.TORCH_FR_BUFFER_SIZE.name] = str(torch_ops.BUFFER_SIZE)
    if host_gpus:
        env[settings.CUDA_VISIBLE_DEVICES.name] = ",".join(host_gpus)
        env[settings.CUDA_DEVICE_ORDER.name] = "PCI_BUS_ID"
    return env


def visible_gpus(addresses: list, visible: str | None) -> list:
    """A task's GPUs as its host names them: Spark's GPU addresses, mapped through an executor's own
    ``CUDA_VISIBLE_DEVICES`` when it has one (Spark's addresses then index that list), as
    pyspark's TorchDistributor does. Each task maps its own, before it registers: executors on one
    host may have different lists."""
    addresses = [str(a) for a in addresses]
    if not visible:
        return addresses
    if any(not a.isdigit() for a in addresses):
        raise ValueError(f"Spark gave this task the GPU addresses {addresses}, which cannot index the executor's "
                         f"CUDA_VISIBLE_DEVICES={visible!r}; make the discovery script print indices 0..n-1 into "
                         "that list, or unset CUDA_VISIBLE_DEVICES in the executors' environment.")
    devices = [d.strip() for d in visible.split(",") if d.strip()]
    beyond = [a for a in addresses if int(a) >= len(devices)]
    if beyond:
        raise ValueError(f"Spark gave this task GPU address{'es' if len(beyond) > 1 else ''} {', '.join(beyond)}, "
                         f"but the executor's CUDA_VISIBLE_DEVICES={visible!r} lists only {len(devices)} device"
                         f"{'s' if len(devices) != 1 else ''}; make the discovery script print indices into that list "
                         "(0.." f"{len(devices) - 1}), or unset CUDA_VISIBLE_DEVICES in the executors' environment.")
    return [devices[int(a)] for a in addresses]


def omp_threads(local_size: int) -> int:
    """The CPU threads each of ``local_size`` ranks on this host gets: an equal share, at least 1."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        cpus = os.cpu_count() or 1
    return max(1, cpus // max(1, local_size))
