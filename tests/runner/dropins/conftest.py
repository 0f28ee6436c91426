"""``pysparks``: pyspark's own distributors, built over a fake session, to say what the drop-ins must match."""

from __future__ import annotations

import importlib
import logging

import pytest

# pyspark's distributors, by class name: where each lives
_PYSPARKS = {"TorchDistributor": "pyspark.ml.torch.distributor",
             "DeepspeedTorchDistributor": "pyspark.ml.deepspeed.deepspeed_distributor"}


@pytest.fixture
def pysparks():
    """``pysparks(conf, gpus=(), name="TorchDistributor", **arguments)``: pyspark's own distributor of that name, over
    a session that is only its conf (and the driver's GPU addresses). The loggers' levels and handlers, which pyspark
    sets, are put back afterwards."""
    distributor = pytest.importorskip("pyspark.ml.torch.distributor")  # where every one reads the active session
    loggers = [logging.getLogger(name) for name in _PYSPARKS]
    saved = [(logger.level, list(logger.handlers)) for logger in loggers]

    class _Gpus:
        def __init__(self, addresses):
            self.addresses = list(addresses)

    class _Session:  # what pyspark reads: spark.conf.get(key, default) and spark.sparkContext.resources
        def __init__(self, conf, gpus):
            self.conf = conf  # a dict: the test's later changes reach it
            self.sparkContext = self
            self.resources = {"gpu": _Gpus(gpus)} if gpus else {}

    def make(conf, gpus=(), name="TorchDistributor", **arguments):
        session = _Session(conf, gpus)
        cls = getattr(importlib.import_module(_PYSPARKS[name]), name)
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(distributor.SparkSession, "active", staticmethod(lambda: session))
            return cls(**arguments)

    yield make
    for logger, (level, handlers) in zip(loggers, saved):
        logger.setLevel(level)
        logger.handlers[:] = handlers
