"""pyspark's ``TaskContext.get()`` and ``BarrierTaskContext.get()`` in a rank: its Spark task's context.

A rank is a process of its own, which its task's agent starts, so pyspark would find no context there. The agent
hands the rank its task's values (``SPARKHVD_TASK_CONTEXT``: _common/spark_task.py); ``install`` makes them
pyspark's current context as soon as ``pyspark.taskcontext`` is imported, by whatever imports it (the function, its
module, unpickling it). It never imports pyspark itself, so a rank that does not use it pays nothing for it.

The context answers ``partitionId()``, ``stageId()``, ``attemptNumber()``, ``taskAttemptId()``, ``cpus()``,
``cpuAmount()``, ``resources()``, ``getLocalProperty()`` and ``getTaskInfos()`` with the Spark task's values (its
``gpu`` addresses index the rank's ``CUDA_VISIBLE_DEVICES``, runner/_agent/task_context.py), and ``barrier()`` and
``allGather()`` with Spark's semantics, over the run's store (runner/_rank/spark_barrier.py).

A rank on the driver (np<0) runs no Spark task: ``TaskContext.get()`` is None, as on Spark's driver, and
``BarrierTaskContext.get()`` raises pyspark's own error, its sentence saying what to call instead.
"""

from __future__ import annotations

from decimal import Decimal

from ..._common import context as _context
from ..._common import settings
from ..._common.spark_task import SparkTask
from ..._common.topology import Placement
from .after_import import when_imported
from .spark_barrier import ALL_GATHER, BARRIER, SparkBarrier

MODULE = "pyspark.taskcontext"


def install(placement: Placement) -> None:
    """Make this rank's Spark task (``SPARKHVD_TASK_CONTEXT``; unset: none, np<0) pyspark's current context once
    ``pyspark.taskcontext`` is imported, now if it is."""
    raw = settings.TASK_CONTEXT.raw()
    task = SparkTask.from_json(raw) if raw else None

    def then(module) -> None:
        if task is None:
            _explain_no_stage(module, placement)
        else:
            _set_current(module, _context_of(module, task, placement))

    when_imported(MODULE, then)


def _set_current(module, ctx) -> None:
    module.TaskContext._setTaskContext(ctx)
    module.BarrierTaskContext._setTaskContext(ctx)  # a class attribute of its own where pyspark's worker set one


def _context_of(module, task: SparkTask, placement: Placement):
    """The context: a ``BarrierTaskContext`` (a plain ``TaskContext`` for a task outside a barrier stage) holding
    ``task``'s values, whose ``barrier()`` and ``allGather()`` sync through the driver."""
    base = module.BarrierTaskContext if task.barrier else module.TaskContext
    ctx = object.__new__(_classes(module)[base])  # not base(): its __new__ hands back the current context
    ctx._stageId, ctx._partitionId = task.stage_id, task.partition_id
    ctx._attemptNumber, ctx._taskAttemptId = task.attempt_number, task.task_attempt_id
    ctx._cpus = task.cpus
    if task.cpu_amount is not None:
        ctx._cpuAmount = Decimal(task.cpu_amount)
    ctx._resources = {name: module.ResourceInformation(name, list(addresses))
                      for name, addresses in task.resources.items()}
    ctx._localProperties = dict(task.local_properties)
    if task.barrier:
        ctx._sparkhvd_task = task
        tasks = len([a for a in task.addresses if a]) or placement.size  # the stage's tasks, one address each
        if tasks == placement.size:  # a rank per task: Spark's own sync of the stage's tasks, by partition
            ctx._sparkhvd_sync = SparkBarrier(_new_client, stage=task.stage_id, partition=task.partition_id,
                                              tasks=tasks)
        else:  # k ranks in each task (k GPUs each): every rank takes part, its message in rank order
            ctx._sparkhvd_sync = SparkBarrier(_new_client, stage=task.stage_id, partition=placement.rank,
                                              tasks=placement.size)
    return ctx


def _new_client():
    """The barrier's own connection to the driver: a sync blocks, and the rank's main connection stays free."""
    current = _context.current()
    if current is None:  # the worker sets it before the function runs: only code outside a rank's run gets here
        raise RuntimeError("BarrierTaskContext.barrier() and allGather() work once the rank has joined its run, inside "
                           "the training function; call them there.")
    return current.new_client()


_made: dict = {}  # pyspark.taskcontext module id -> {pyspark's class: ours}


def _classes(module) -> dict:
    """Our subclasses of this pyspark's ``TaskContext`` and ``BarrierTaskContext`` (made once per module)."""
    if id(module) in _made:
        return _made[id(module)]

    class RankTaskContext(module.TaskContext):
        """pyspark's ``TaskContext`` of the Spark task this rank runs for (runner/_rank/task_context.py)."""

    class RankBarrierTaskContext(module.BarrierTaskContext):
        """pyspark's ``BarrierTaskContext`` of the Spark task this rank runs for (runner/_rank/task_context.py)."""

        def barrier(self) -> None:
            """Wait until every task of the stage has called ``barrier()`` as many times, as Spark's does."""
            self._sparkhvd_sync.sync(BARRIER)

        def allGather(self, message: str = "") -> list:
            """Every task's ``message``, in partition order, once every task has called it as often, as Spark's."""
            if not isinstance(message, str):
                raise TypeError(f"Argument `message` must be of type `str`, but partition {self._partitionId} passed "
                                f"{type(message).__name__} {message!r:.80}; pass a string, e.g. json.dumps(value), and "
                                "json.loads each of the messages allGather() returns.")
            return self._sparkhvd_sync.sync(ALL_GATHER, message)

        def getTaskInfos(self) -> list:
            """Every task's ``BarrierTaskInfo`` (its executor's ``host:port``), by partition, as Spark's."""
            return [module.BarrierTaskInfo(address) for address in self._sparkhvd_task.addresses]

    _made[id(module)] = classes = {module.TaskContext: RankTaskContext, module.BarrierTaskContext: RankBarrierTaskContext}
    return classes


def _explain_no_stage(module, placement: Placement) -> None:
    """On the driver (np<0): ``BarrierTaskContext.get()`` raises pyspark's error, with a sentence saying what to call."""
    pyspark_get = module.BarrierTaskContext.__dict__["get"].__func__
    error = module.PySparkRuntimeError
    message = (f"It is not in a barrier stage: rank {placement.rank} of this run runs on the driver "
               f"(np=-{placement.size}), not in a Spark task; call hvd.rank(), hvd.barrier() and "
               f"hvd.allgather_object() instead, which work on the driver and in Spark alike, or run with "
               f"np={placement.size} to run each rank in a Spark barrier task.")

    def get(cls):
        if not isinstance(cls._taskContext, module.BarrierTaskContext):
            raise error(message=message, errorClass="NOT_IN_BARRIER_STAGE", messageParameters={})
        return pyspark_get(cls)

    get.__doc__ = pyspark_get.__doc__
    module.BarrierTaskContext.get = classmethod(get)
