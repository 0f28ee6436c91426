"""Launching training functions: ``HorovodRunner`` and what it returns or raises.

Names are imported on first use, so a rank process (``python -m sparkhvd.runner._rank.worker``)
does not import the driver-side modules.
"""

import importlib

__all__ = [
    "Checkpoint",
    "DeepspeedTorchDistributor",
    "HorovodRunner",
    "HorovodRunError",
    "JavaNotFoundError",
    "MirroredStrategyRunner",
    "Placement",
    "RunIdInUse",
    "RunResult",
    "StartTimeoutError",
    "TorchDistributor",
    "assign_ranks",
    "get_checkpoint",
    "horovod_spark_run",
    "log_to_driver",
    "plot",
    "report",
]

_WHERE = {
    "HorovodRunner": "._horovod_runner",
    "RunResult": "._policy.result",
    "plot": "._policy.plot",  # a RunResult's steps/s per rank, with matplotlib
    "log_to_driver": "._rank.log",
    "report": "._rank.report",  # Ray Train's report(metrics, checkpoint=), get_checkpoint() and Checkpoint
    "get_checkpoint": "._rank.report",
    "Checkpoint": "._rank.report",
    "HorovodRunError": "._shared.errors",
    "StartTimeoutError": "._shared.errors",
    "RunIdInUse": "._shared.errors",
    "JavaNotFoundError": "._backends.java",
    "Placement": ".._common.topology",
    "assign_ranks": ".._common.topology",
    "TorchDistributor": "._dropins.torch_distributor",  # pyspark's TorchDistributor, on HorovodRunner
    "DeepspeedTorchDistributor": "._dropins.deepspeed_distributor",  # pyspark's, a TorchDistributor of ours
    "MirroredStrategyRunner": "._dropins.mirrored_strategy_runner",  # spark-tensorflow-distributor's, on HorovodRunner
    "horovod_spark_run": "._dropins.horovod_spark",  # Horovod's horovod.spark.run, on HorovodRunner
}

_RENAMED = {"horovod_spark_run": "run"}


def __getattr__(name):
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'sparkhvd.runner' has no attribute {name!r}")
    return getattr(importlib.import_module(module, __name__), _RENAMED.get(name, name))


def __dir__():
    return sorted(set(globals()) | set(__all__))
