"""The peers' own entry points, each a thin layer over ``HorovodRunner``: pyspark's ``TorchDistributor``,
spark-tensorflow-distributor's ``MirroredStrategyRunner``, Horovod's ``horovod.spark.run`` and Databricks'
``sparkdl.HorovodRunner``. They run in the driver, build a ``RunnerConfig`` and call the runner, so every job gets
the same launch, logs, errors and restarts. Tests: tests/runner/dropins/.
"""
