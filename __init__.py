"""sparkhvd: the Horovod programming model, run by Apache Spark.

``import sparkhvd`` stays light: it imports neither torch, pyspark nor TensorFlow.
"""

__version__ = "0.1.0"

__all__ = ["Checkpoint", "DeepspeedTorchDistributor", "HorovodRunner", "HorovodRunError", "MirroredStrategyRunner",
           "RunResult", "TorchDistributor", "get_checkpoint", "log_to_driver", "plot", "report", "__version__"]

_LAZY = {
    "HorovodRunner": "sparkhvd.runner",
    "HorovodRunError": "sparkhvd.runner",
    "RunResult": "sparkhvd.runner",
    "log_to_driver": "sparkhvd.runner",
    "plot": "sparkhvd.runner",  # a RunResult's metrics drawn (matplotlib: the plot extra)
    "report": "sparkhvd.runner",  # Ray Train's train.report, get_checkpoint and Checkpoint
    "get_checkpoint": "sparkhvd.runner",
    "Checkpoint": "sparkhvd.runner",
    "TorchDistributor": "sparkhvd.runner",  # pyspark's, on HorovodRunner
    "DeepspeedTorchDistributor": "sparkhvd.runner",  # pyspark's, on the TorchDistributor above
    "MirroredStrategyRunner": "sparkhvd.runner",  # spark-tensorflow-distributor's, on HorovodRunner
}


def __getattr__(name):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'sparkhvd' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)


def __dir__():
    return sorted(set(globals()) | set(__all__))
