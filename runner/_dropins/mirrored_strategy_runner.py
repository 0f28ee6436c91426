"""spark-tensorflow-distributor's ``MirroredStrategyRunner``, run by sparkhvd: ``from sparkhvd import
MirroredStrategyRunner`` is the only change.

A thin layer over ``HorovodRunner``, so a MirroredStrategyRunner job gets the same launch, live logs, errors and
pre-flight. As theirs (``spark_tensorflow_distributor/mirrored_strategy_runner.py``):

- ``local_mode=False``: one Spark barrier task per TensorFlow worker, each given ``TF_CONFIG`` (``{"cluster":
  {"worker": [...]}, "task": {"type": "worker", "index": rank}}``: runner/_shared/framework_env.py), with its task's
  GPUs where ``use_gpu`` (``spark.task.resource.gpu.amount`` of them: ``ceil(num_slots / amount)`` workers), and
  none without (``CUDA_VISIBLE_DEVICES=""``).
- ``local_mode=True``: one worker on the driver, without ``TF_CONFIG``, over ``num_slots`` of the driver's Spark
  GPUs (``spark.driver.resource.<gpu_resource_name>``, chosen at random), or on the CPU (``num_slots=1``).
- Unless ``use_custom_strategy``, the function runs inside ``tf.distribute.MultiWorkerMirroredStrategy()``'s
  scope, after TensorFlow's eager context is reset, so that ``tf.distribute.get_strategy()`` is that strategy.
- ``run(train_fn, **kwargs)`` returns the chief's (rank 0's, TF_CONFIG's worker 0) value.
- Where Spark encrypts its traffic, training sends tensors unencrypted: refused unless
  ``tensorflow.spark.distributor.ignoreSsl`` is ``true``, then a warning.

Where ours differs:

- GPUs are always Spark's ``gpu`` resource: another ``gpu_resource_name`` is refused outside local mode.
- ``local_mode=True`` runs the function in a fresh process on the driver (``HorovodRunner(np=-1)``), not in the
  driver's own. TensorFlow configures its collective ops once, when its context starts ("Collective ops must be
  configured at program startup"); theirs resets the driver's eager context for that, a private API that also
  invalidates every tensor and model the notebook holds. A fresh process gets a clean context, gives its GPU
  memory back when it ends, and has the same live logs and error report as ``local_mode=False``. So the return
  value must be picklable, as it must be outside local mode, and the function cannot change the driver's
  objects.
- With no active SparkSession, theirs starts one in ``__init__``; ours finds no GPU configuration then (pass
  ``use_gpu=False``), and ``HorovodRunner`` starts an embedded ``local[num_slots]`` session where it needs one.
- It does not log through ``logging``, and has no ``sc`` attribute; HorovodRunner prints the run's progress.
- A rank's failure raises ``HorovodRunError`` on the driver, naming the rank and its exception.
- Errors are theirs' types, or subclasses: ``RuntimeError`` where theirs raises a bare ``Exception`` (no GPU
  scheduling, an encrypted cluster), and each says the fix. ``spark.network.crypto.enabled`` counts as
  encryption too, as for the TorchDistributor drop-in (theirs looks at ``spark.ssl.enabled`` alone).
"""

from __future__ import annotations

import functools
import math
import numbers
import os
import random
from dataclasses import dataclass
from typing import Callable

from ..._common import settings
from .._shared.framework_env import NODE_PER_TASK

__all__ = ["MirroredStrategyRunner"]

_SSL_CONF = "tensorflow.spark.distributor.ignoreSsl"
_GPU = "gpu"  # the Spark resource HorovodRunner's tasks ask for (runner/_backends/spark.py: gpu_task_profile)


class MirroredStrategyRunner:
    """``MirroredStrategyRunner(num_slots=, local_mode=False, use_gpu=True, gpu_resource_name='gpu',
    use_custom_strategy=False)``, with spark-tensorflow-distributor's meaning (above)."""

    def __init__(self, *, num_slots: int, local_mode: bool = False, use_gpu: bool = True,
                 gpu_resource_name: str = _GPU, use_custom_strategy: bool = False):
        if isinstance(num_slots, bool) or not isinstance(num_slots, numbers.Integral):
            raise TypeError(f"num_slots has to be a whole number, got {num_slots!r} ({type(num_slots).__name__}): "
                            "the number of GPUs, or of CPU workers, to train on, e.g. "
                            "MirroredStrategyRunner(num_slots=2).")
        if num_slots <= 0:
            raise ValueError(f"num_slots is set to {num_slots} but cannot be less than or equal to 0; pass the "
                             "number of GPUs, or of CPU workers, to train on, e.g. MirroredStrategyRunner("
                             "num_slots=2).")
        self._num_slots = int(num_slots)
        self._local_mode = bool(local_mode)
        self._use_gpu = bool(use_gpu)
        self._gpu_resource_name = gpu_resource_name
        self._use_custom_strategy = bool(use_custom_strategy)
        self._num_tasks = None if self._local_mode else self.get_num_tasks()

    def get_num_tasks(self) -> int:
        """How many Spark tasks (TensorFlow workers) train: ``num_slots``, or with ``use_gpu`` (which needs Spark's
        GPU scheduling: ``spark.task.resource.gpu.amount`` of 1 or more) ``ceil(num_slots / amount)``, each worker
        with its task's GPUs, as spark-tensorflow-distributor packs them."""
        if not self._use_gpu:
            return self._num_slots
        name = self._gpu_resource_name
        if name != _GPU:
            raise ValueError(f"gpu_resource_name={name!r}, but sparkhvd's tasks ask Spark for the resource named "
                             f"{_GPU!r}; name the GPU resource {_GPU!r} in the Spark configuration "
                             f"(spark.executor.resource.{_GPU}.amount, spark.task.resource.{_GPU}.amount), or pass "
                             "use_gpu=False to train on CPUs.")
        key = f"spark.task.resource.{name}.amount"
        conf = _active_conf()
        value = None if conf is None else conf(key, None)
        if value is None:
            where = "the Spark configuration (no SparkSession is active)" if conf is None else \
                "the active SparkSession's configuration"
            raise RuntimeError(f"The conf `{key}` was not found in {where}, so the cluster might not have Spark "
                               "GPU-aware scheduling enabled: MirroredStrategyRunner(use_gpu=True, local_mode=False) "
                               f"gives each worker a GPU of its executor; start the SparkSession with {key}=1 (and "
                               f"spark.executor.resource.{name}.amount with a discovery script), or pass "
                               "use_gpu=False to train on CPUs.")
        try:
            amount = float(value)
        except ValueError:
            amount = 0.0
        if amount < 1:
            raise ValueError(f"The Spark conf `{key}` has a value of {value} but it should not have a value less "
                             f"than 1: each worker needs a whole GPU; set {key}=1, or pass use_gpu=False to train "
                             "on CPUs.")
        return math.ceil(self._num_slots / int(amount))

    def run(self, train_fn, **kwargs):
        """Run ``train_fn(**kwargs)`` on every worker, inside ``MultiWorkerMirroredStrategy``'s scope unless
        ``use_custom_strategy``; return the chief's value (rank 0's)."""
        if not callable(train_fn):
            raise TypeError(f"MirroredStrategyRunner.run needs a function to run, got {type(train_fn).__name__}; "
                            "pass the training function, e.g. run(train, epochs=3).")
        from .._horovod_runner import HorovodRunner  # here: a rank imports this module for _train alone
        from .._runner_config import RunnerConfig

        if self._local_mode:
            if not self._use_gpu and self._num_slots > 1:
                raise ValueError(f"Cannot run with more than 1 CPU machine in local mode: num_slots={self._num_slots} "
                                 "with use_gpu=False; pass num_slots=1, or local_mode=False to train on num_slots "
                                 "Spark tasks.")
            devices = self._local_gpus() if self._use_gpu else None
            config = RunnerConfig(-1, use_gpu=self._use_gpu, warn_unencrypted=True)
        else:
            self._check_encryption()
            devices = None
            config = RunnerConfig(self._num_tasks,
                                  layout=NODE_PER_TASK,  # each rank sees its own GPUs only: a replica on each
                                  use_gpu=self._use_gpu,  # False: tasks ask for no GPU and ranks see none
                                  one_rank_per_task=True,  # a worker per task, with all of the task's GPUs
                                  warn_unencrypted=False)  # _check_encryption said it, or refused
        runner = HorovodRunner._from_config(config)
        task = _Task(train_fn, self._use_custom_strategy, self._local_mode, devices)

        # Not partial(_train, task): HorovodRunner ships the user's module by value where it is their own file,
        # found through main.__module__ (a partial's func's), which is train_fn's here (functools.wraps).
        @functools.wraps(train_fn)
        def in_strategy(**kwargs):
            return _train(task, **kwargs)

        return runner.run(in_strategy, **kwargs)

    def _local_gpus(self) -> str:
        """``num_slots`` of the driver's Spark GPUs, at random, as ``CUDA_VISIBLE_DEVICES`` lists them (theirs)."""
        name = self._gpu_resource_name
        addresses = _driver_gpu_addresses(name)
        if addresses is None:
            raise ValueError(f"The provided GPU resource name `{name}` was not found in the driver's Spark "
                             "resources, and MirroredStrategyRunner(local_mode=True, use_gpu=True) trains on those; "
                             f"start the SparkSession with spark.driver.resource.{name}.amount and "
                             f"spark.driver.resource.{name}.discoveryScript, or pass use_gpu=False to train on the "
                             "CPU.")
        if any(not (a.isdigit() and (a == "0" or not a.startswith("0"))) for a in addresses):
            raise ValueError(f"Found GPU addresses {addresses} which are not all in the correct format for "
                             "CUDA_VISIBLE_DEVICES, which requires integers with no zero padding; make "
                             f"spark.driver.resource.{name}.discoveryScript print indices such as "
                             '{"name": "gpu", "addresses": ["0", "1"]}.')
        owned = addresses
        visible = settings.CUDA_VISIBLE_DEVICES.get()
        if visible:  # Spark's addresses index the driver's own list, as theirs maps them
            devices = [d.strip() for d in visible.split(",") if d.strip()]
            beyond = [a for a in addresses if int(a) >= len(devices)]
            if beyond:
                raise ValueError(f"Spark gave the driver GPU addresses {addresses}, but its CUDA_VISIBLE_DEVICES="
                                 f"{visible!r} lists {len(devices)} device{'s' if len(devices) != 1 else ''}, "
                                 f"which {', '.join(beyond)} cannot index; make spark.driver.resource.{name}."
                                 "discoveryScript print indices into that list, or unset CUDA_VISIBLE_DEVICES.")
            owned = [devices[int(a)] for a in addresses]
        if self._num_slots > len(owned):
            raise ValueError(f"{self._num_slots} slots were requested for local training with GPU training but only "
                             f"{len(owned)} GPU{'s' if len(owned) != 1 else ''} were available on the driver "
                             f"({', '.join(owned) or 'none'}); use num_slots<={max(len(owned), 1)}, or "
                             "local_mode=False to train on the cluster's GPUs.")
        return ",".join(random.sample(owned, self._num_slots))

    def _check_encryption(self) -> None:
        """Refuse, as theirs does, where Spark encrypts its traffic and the user has not said to go on."""
        from .._backends.spark import refuse_unencrypted

        refuse_unencrypted(_active_conf(), _SSL_CONF, "MirroredStrategyRunner's workers", "TensorFlow's collectives")


@dataclass(frozen=True)
class _Task:
    """What every rank runs, and how (pickled with the function: this module is importable on every rank)."""

    train_fn: Callable
    use_custom_strategy: bool  # False: inside MultiWorkerMirroredStrategy's scope
    local: bool  # local mode: one worker, no TF_CONFIG, as theirs in the driver
    cuda_devices: str | None  # local mode on GPUs: the driver's GPUs it trains on; None: as HorovodRunner set them


def _train(task: _Task, /, **kwargs):
    """On a rank: ``task.train_fn(**kwargs)``, as theirs runs it (``_run_tensorflow_program``)."""
    if task.local:
        os.environ.pop(settings.TF_CONFIG.name, None)  # one worker over the local devices, as theirs runs on the driver
        if task.cuda_devices is not None:
            os.environ[settings.CUDA_VISIBLE_DEVICES.name] = task.cuda_devices  # before TensorFlow first lists its devices
    if task.use_custom_strategy:
        return task.train_fn(**kwargs)
    import tensorflow as tf
    from tensorflow.python.eager import context

    # As theirs: collective ops are configured only when TensorFlow's context starts, which unpickling the
    # function's arguments (a tensor) may already have done; without the reset the strategy raises.
    context._reset_context()
    strategy = tf.distribute.MultiWorkerMirroredStrategy()  # theirs: the .experimental alias, the same defaults
    with strategy.scope():
        return task.train_fn(**kwargs)


def _active_conf():
    """The active SparkSession's ``conf.get``, or None where there is none (HorovodRunner then starts one)."""
    from pyspark.sql import SparkSession

    session = SparkSession.getActiveSession()
    return None if session is None else session.conf.get


def _driver_gpu_addresses(name: str) -> list | None:
    """The driver's Spark resource ``name``'s addresses (``spark.driver.resource.<name>``), or None."""
    from pyspark import SparkContext

    sc = SparkContext._active_spark_context
    if sc is None or name not in sc.resources:
        return None
    return [str(a) for a in sc.resources[name].addresses]
