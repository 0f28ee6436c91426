"""pyspark's ``TorchDistributor``, run by sparkhvd: ``from sparkhvd import TorchDistributor`` is the only change.

A thin layer over ``HorovodRunner``, so a TorchDistributor job gets the same launch, live logs, errors and
pre-flight. As pyspark's (``pyspark/ml/torch/distributor.py``):

- ``local_mode=True``: ``num_processes`` processes on the driver, as ``torchrun --standalone --nnodes=1
  --nproc_per_node=<num_processes>`` runs them (``LOCAL_RANK`` 0..n-1); with ``use_gpu``, as many as the driver
  has GPUs at most, saying so on the ``TorchDistributor`` logger (pyspark's, through ``logging``) where it sets fewer.
- ``local_mode=False``: one Spark barrier task per process, each a torchrun node of its own (``LOCAL_RANK=0``,
  ``NODE_RANK=RANK``: runner/_shared/framework_env.py's ``node_per_task``), seeing only its own GPU with ``use_gpu``,
  and none without. Where each task holds k GPUs (``spark.task.resource.gpu.amount=k``), ``num_processes / k``
  tasks of k processes each, a torchrun node of k (``LOCAL_RANK`` 0..k-1 indexing the task's GPUs), as pyspark 4.3
  runs them; ``num_processes`` must be a multiple of k.
- ``run(fn, *args, **kwargs)`` returns rank 0's value; ``run("train.py", *args)`` runs a script on every rank and
  returns None.
- ``input_params``: pyspark's dict of ``num_processes``, ``local_mode``, ``use_gpu`` and ``num_tasks``.
- Where Spark encrypts its traffic, training sends tensors unencrypted: refused unless
  ``pytorch.spark.distributor.ignoreSsl`` is ``true``, then a warning.
"""

from __future__ import annotations

import functools
import logging
import numbers
import os
import sys

from .._backends.spark import refuse_unencrypted
from .._horovod_runner import HorovodRunner
from .._runner_config import RunnerConfig
from .._shared.framework_env import NODE_PER_TASK, TORCHRUN

__all__ = ["TorchDistributor"]

_SSL_CONF = "pytorch.spark.distributor.ignoreSsl"


class TorchDistributor:
    """``TorchDistributor(num_processes=1, local_mode=True, use_gpu=True)``, with pyspark's meaning (above)."""

    def __init__(self, num_processes: int = 1, local_mode: bool = True, use_gpu: bool = True,
                 _ssl_conf: str = _SSL_CONF):
        if isinstance(num_processes, bool) or not isinstance(num_processes, numbers.Integral) or num_processes <= 0:
            raise ValueError(f"num_processes has to be a positive integer, got {num_processes!r}: the number of "
                             "training processes, e.g. TorchDistributor(num_processes=2, local_mode=False).")
        self.num_processes = int(num_processes)
        self.local_mode = bool(local_mode)
        self.use_gpu = bool(use_gpu)
        self.ssl_conf = _ssl_conf
        # pyspark's _get_logger also sets INFO and a stderr handler; a library leaves that to the application, and
        # logging's last-resort handler still prints a warning where nothing is configured.
        self.logger = logging.getLogger(type(self).__name__)
        self.num_tasks = self._get_num_tasks()
        # pyspark's _create_input_params: its attributes less spark, ssl_conf, logger, is_remote, is_spark_local_master
        self.input_params = {"num_processes": self.num_processes, "local_mode": self.local_mode,
                             "use_gpu": self.use_gpu, "num_tasks": self.num_tasks}

    def _get_num_tasks(self) -> int:
        """How many processes run: ``num_processes``, or the driver's GPUs where fewer (pyspark's rule)."""
        if not self.use_gpu:
            return self.num_processes
        if self.local_mode:
            gpus = _driver_gpus()
            if gpus == 0:
                raise RuntimeError("GPUs were unable to be found on the driver: TorchDistributor(local_mode=True, "
                                   "use_gpu=True) runs one process per driver GPU; pass use_gpu=False to train on "
                                   "CPUs.")
            if self.num_processes > gpus:
                self.logger.warning(f"num_processes={self.num_processes} is more than the {gpus} GPU"
                                    f"{'s' if gpus != 1 else ''} on the driver; it was reset to {gpus}, as pyspark's "
                                    f"TorchDistributor does; pass num_processes<={gpus}, or give the driver more GPUs.")
                self.num_processes = gpus
            return self.num_processes
        conf = _active_conf()
        if conf is not None:
            key = "spark.task.resource.gpu.amount"
            value = conf(key, None)
            fix = (f"TorchDistributor(use_gpu=True, local_mode=False) gives each process a GPU of its executor; set "
                   f"{key}=1 (with spark.executor.resource.gpu.amount and a discovery script), or pass use_gpu=False "
                   "to train on CPUs.")
            if value is None:
                raise RuntimeError(f"'{key}' was unset, so gpu usage is unavailable: {fix}")
            try:
                amount = float(value)
            except ValueError:
                amount = 0.0
            if amount < 1:
                raise RuntimeError(f"'{key}' is {value!r}, less than the whole GPU each process needs: {fix}")
            per_task = int(amount)
            if per_task > 1:  # pyspark 4.3: a task of k GPUs runs torchrun --nproc_per_node=k
                if self.num_processes % per_task:
                    below, above = self.num_processes // per_task * per_task, (self.num_processes // per_task + 1) * per_task
                    raise RuntimeError(
                        f"TorchDistributor 'num_processes' value ({self.num_processes}) must be a multiple of '{key}' "
                        f"({per_task}) value: each Spark task holds {per_task} GPUs and runs a process on each; use "
                        f"num_processes={above}{f' or {below}' if below else ''}.")
                return self.num_processes // per_task
        return self.num_processes

    def run(self, train_object, *args, **kwargs):
        """Run ``train_object(*args, **kwargs)`` on every process and return rank 0's value, or run the script
        ``train_object`` (a path) with the command-line arguments ``args`` and return None."""
        script = isinstance(train_object, (str, os.PathLike))
        if script and kwargs:
            raise ValueError(f"Running pytorch file does not support key-word type arguments: got "
                             f"{', '.join(sorted(kwargs))} for {os.fspath(train_object)!r}; pass them as "
                             "command-line strings, e.g. run('train.py', '--lr', '0.1').")
        if not script and not callable(train_object):
            raise TypeError(f"TorchDistributor.run needs a function or the path of a Python script, got "
                            f"{type(train_object).__name__}.")
        if not self.local_mode:
            self._check_encryption()
        runner = HorovodRunner._from_config(RunnerConfig(
            -self.num_processes if self.local_mode else self.num_processes,
            layout=TORCHRUN if self.local_mode else NODE_PER_TASK,
            use_gpu=self.use_gpu or self.local_mode,  # local mode leaves the driver's GPUs visible
            warn_unencrypted=False))  # _check_encryption said it, or refused
        if script:
            return runner.run(train_object, *args)
        return runner.run(functools.partial(train_object, *args) if args else train_object, **kwargs)

    def _train_on_dataframe(self, train_function, spark_dataframe, *args, **kwargs):
        """Run ``train_function(*args, **kwargs)`` in a barrier stage over ``spark_dataframe``, task ``i`` on its
        partition ``i`` (pyspark's semantics, which ``pyspark.ml.connect``'s estimators use): inside the function,
        ``pyspark.ml.torch.distributor._get_spark_partition_data_loader(num_samples, batch_size)`` loads that
        partition's rows. Returns rank 0's value. The DataFrame needs one partition per task (``num_tasks``)."""
        if self.local_mode:
            raise ValueError("TorchDistributor.train_on_dataframe requires setting TorchDistributor.local_mode to "
                             "False.")
        if not callable(train_function):
            raise TypeError(f"TorchDistributor._train_on_dataframe needs a function, got "
                            f"{type(train_function).__name__}.")
        partitions = spark_dataframe.rdd.getNumPartitions()
        if partitions != self.num_tasks:
            raise ValueError(f"The DataFrame has {partitions} partition{'s' if partitions != 1 else ''}, but "
                             f"TorchDistributor(num_processes={self.num_processes}) runs {self.num_tasks} Spark "
                             f"task{'s' if self.num_tasks != 1 else ''}, each training on one partition; pass "
                             f"spark_dataframe.repartition({self.num_tasks}).")
        self._check_encryption()
        runner = HorovodRunner._from_config(RunnerConfig(
            self.num_processes, layout=NODE_PER_TASK, use_gpu=self.use_gpu, warn_unencrypted=False,
            dataframe=spark_dataframe))
        return runner.run(functools.partial(train_function, *args) if args else train_function, **kwargs)

    def _check_encryption(self) -> None:
        """Refuse, as pyspark does, where Spark encrypts its traffic and the user has not said to go on."""
        refuse_unencrypted(_active_conf(), self.ssl_conf, "TorchDistributor's processes", "gloo and NCCL")


def _active_conf():
    """The active SparkSession's ``conf.get``, or None where there is none (the run then starts one)."""
    from pyspark.sql import SparkSession

    session = SparkSession.getActiveSession()
    return None if session is None else session.conf.get


def _driver_gpus() -> int:
    """The driver's GPUs: Spark's (``spark.driver.resource.gpu``) where it has them, else those CUDA sees."""
    pyspark = sys.modules.get("pyspark")  # a driver without pyspark (local mode needs none) has no SparkContext
    sc = None if pyspark is None else pyspark.SparkContext._active_spark_context
    if sc is not None and "gpu" in sc.resources:
        return len(sc.resources["gpu"].addresses)
    import torch

    return torch.cuda.device_count()
