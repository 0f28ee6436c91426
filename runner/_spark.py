"""The Spark launcher: one barrier-mode task per rank, on the active session or an embedded one."""

from __future__ import annotations

import functools
import os
import sys
import threading
import time

from ._agent import TaskSpec, run_task
from ._launcher import Launcher

#: How long to wait for executors to register before judging the slot count (local-cluster,
#: a cluster still starting): the slot check then fails in seconds, not Spark's ~10 minutes.
_SLOT_WAIT_S = 15.0
_embedded = None  # the SparkSession sparkhvd created, if any


def spark_context(np: int):
    """The active SparkContext; where there is none, start an embedded ``local[np]`` session."""
    global _embedded
    from pyspark import SparkContext

    sc = SparkContext._active_spark_context
    if sc is not None and _embedded is not None and sc is _embedded.sparkContext \
            and sc.defaultParallelism < np:
        _embedded.stop()  # ours and too small for this run: start a bigger one
        sc = None
    if sc is not None:
        return sc
    from ._java import check_java

    check_java()
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)  # executors run this interpreter
    from pyspark.sql import SparkSession

    _embedded = (SparkSession.builder.master(f"local[{max(np, 2)}]").appName("sparkhvd")
                 .config("spark.ui.enabled", "false")
                 .config("spark.ui.showConsoleProgress", "false")
                 .getOrCreate())
    return _embedded.sparkContext


def _gpu_amount(sc) -> float:
    conf = sc.getConf()
    return float(conf.get("spark.executor.resource.gpu.amount", "0") or 0)


def task_slots(sc) -> int:
    """How many tasks the cluster can run at once (Spark's own barrier-stage count)."""
    jsc = sc._jsc.sc()
    try:
        return int(jsc.maxNumConcurrentTasks(jsc.resourceProfileManager().defaultResourceProfile()))
    except Exception:  # noqa: BLE001 - a Spark without this private API
        return int(sc.defaultParallelism)


def check_barrier_conf(conf) -> None:
    """Barrier stages fail under dynamic allocation: say so before Spark does."""
    if (conf.get("spark.dynamicAllocation.enabled") or "false").lower() == "true":
        raise RuntimeError(
            "Spark barrier mode, which HorovodRunner uses, does not work with dynamic allocation; "
            "set spark.dynamicAllocation.enabled=false for this session, or use np<0 to run on the driver.")


def check_slots(sc, np: int) -> None:
    """Fail in seconds, with both numbers and the fix, when np tasks cannot all run at once."""
    check_barrier_conf(sc.getConf())
    deadline = time.monotonic() + (0 if sc.master.startswith("local[") else _SLOT_WAIT_S)
    while True:
        slots = task_slots(sc)
        if slots >= np or time.monotonic() >= deadline:
            break
        time.sleep(0.2)
    if slots < np:
        raise RuntimeError(
            f"np={np} needs {np} task slots but the cluster has {slots} ({sc.master}); "
            f"use np<={slots}, add executors or cores, or use np=-{np} to run on the driver.")


class SparkLauncher(Launcher):
    """Runs the task agents as one Spark barrier stage, in a job group of its own."""

    def __init__(self, sc, np: int):
        self.sc = sc
        self.np = np
        self.description = f"a Spark barrier stage on {sc.master}"
        self._group = None
        self._thread = None
        self._error: str | None = None
        self._stopped = False

    def start(self, spec: TaskSpec) -> None:
        self._group = f"sparkhvd-{spec.run_id}"
        self._thread = threading.Thread(target=self._job, args=(spec,), daemon=True,
                                        name=f"sparkhvd-job-{spec.run_id}")
        self._thread.start()

    def _job(self, spec: TaskSpec) -> None:
        sc = self.sc
        try:
            sc.setJobGroup(self._group, f"sparkhvd run {spec.run_id} (np={self.np})", interruptOnCancel=True)
            rdd = sc.parallelize(range(self.np), self.np).barrier().mapPartitions(
                functools.partial(_barrier_task, spec))
            if _gpu_amount(sc) > 0:
                from pyspark.resource import ResourceProfileBuilder, TaskResourceRequests

                cpus = int(sc.getConf().get("spark.task.cpus", "1"))
                requests = TaskResourceRequests().cpus(cpus).resource("gpu", 1.0)
                rdd = rdd.withResources(ResourceProfileBuilder().require(requests).build)
            rdd.collect()  # the outcome arrives through the driver service
        except Exception as exc:  # noqa: BLE001 - reported through failure()
            if not self._stopped:
                self._error = f"the Spark job failed: {_first_line(exc)}"

    def failure(self) -> str | None:
        return self._error

    def join(self, timeout: float) -> bool:
        if self._thread is not None:
            self._thread.join(timeout)
            return not self._thread.is_alive()
        return True

    def stop(self) -> None:
        self._stopped = True
        if self._group is not None:
            self.sc.cancelJobGroup(self._group)


def _barrier_task(spec: TaskSpec, _partition):
    """Runs inside the barrier task on an executor."""
    from pyspark import BarrierTaskContext

    ctx = BarrierTaskContext.get()
    gpu = ctx.resources().get("gpu")
    yield run_task(spec, ctx.partitionId(), gpus=list(gpu.addresses) if gpu is not None else [])


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    for line in text.splitlines():
        if line.strip():
            return line.strip()[:500]
    return text[:500]
