"""sparkhvd.ml: Spark ML estimators that train on the runner, and models that predict on the executors.

horovod.spark's API: ``TorchEstimator``, ``LightningEstimator`` and ``KerasEstimator`` are
``pyspark.ml`` Estimators; ``fit(df)`` trains on ``num_proc`` ranks and returns a ``TorchModel``,
``LightningModel`` or ``KerasModel``, whose ``transform(df)`` adds ``<label>__output`` columns.
The ``Store`` keeps the intermediate Parquet, each run's checkpoints and the fitted models.
Names are imported on first use: ``import sparkhvd.ml`` imports neither torch nor TensorFlow.
docs/ml.md is the reference.
"""

import importlib

__all__ = [
    "DBFSLocalStore",
    "FilesystemStore",
    "HDFSStore",
    "KerasEstimator",
    "KerasModel",
    "LightningEstimator",
    "LightningModel",
    "LocalStore",
    "Store",
    "TorchEstimator",
    "TorchModel",
]

_WHERE = {
    "Store": "._store", "LocalStore": "._store", "FilesystemStore": "._store", "HDFSStore": "._store",
    "DBFSLocalStore": "._store",
    "TorchEstimator": "._torch", "TorchModel": "._torch",
    "LightningEstimator": "._lightning", "LightningModel": "._lightning",
    "KerasEstimator": "._keras", "KerasModel": "._keras",
}


def __getattr__(name):
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'sparkhvd.ml' has no attribute {name!r}")
    return getattr(importlib.import_module(module, __name__), name)


def __dir__():
    return sorted(set(globals()) | set(__all__))
