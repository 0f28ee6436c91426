"""The Spark backend: one barrier-mode task per rank, on the active session or an embedded one.

pyspark is imported inside the functions that use it, so that ``import sparkhvd`` and runs on the
driver (np<0) never import it.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
import shutil
import socket
import sys
import threading
import time
import warnings

from ..._common import settings
from .._agent.agent import TaskSpec, run_task, run_tasks
from .._shared.error_text import SPARK_STOPPED, read_text, says
from .._shared.waits import WaitNote
from . import running
from .api import Backend, Launcher, check_ranks_per_task
from .java import check_java
from .job import JobLauncher
from .preflight import check_executors
from .spark_info import executor_resources, spark_reason

#: How long to wait for executors to register before judging the slot count (local-cluster,
#: a cluster still starting): the slot check then fails in seconds, not after Spark's own wait for barrier slots.
_SLOT_WAIT_S = 15.0
_SLOT_SETTLE_S = 5.0  # executors that register together come within this of each other
_embedded = None  # the SparkSession sparkhvd created, if any
_embedded_lock = threading.Lock()  # two runs at once start one embedded session, and never stop it under each other


def spark_context(np: int):
    """The active SparkContext; where there is none, start an embedded ``local[np]`` session.

    Raises:
        RuntimeError: the embedded session is too small for np while other runs of this driver use it.
    """
    with _embedded_lock:
        return _spark_context(np)


def _spark_context(np: int):
    global _embedded
    from pyspark import SparkContext

    sc = SparkContext._active_spark_context
    if sc is not None and _embedded is not None and sc is _embedded.sparkContext \
            and sc.defaultParallelism < np:
        using = sorted({s.run_id for s in running.held(application(sc))})
        if using:  # stopping it would fail those runs
            raise RuntimeError(
                f"np={np} needs {np} task slots but the session sparkhvd started for the runs of this driver, "
                f"{sc.master}, has {sc.defaultParallelism}, and run{'s' if len(using) > 1 else ''} "
                f"{', '.join(using)} still use{'' if len(using) > 1 else 's'} it; start this run once "
                f"{'they have' if len(using) > 1 else 'it has'} ended (sparkhvd then starts a local[{np}] session), "
                f"start a SparkSession with {np} or more cores before the first run, or use np=-{np} to run on the "
                "driver.")
        _embedded.stop()  # ours and too small for this run: start a bigger one
        sc = None
    if sc is not None:
        return sc
    check_java()
    os.environ.setdefault(settings.PYSPARK_PYTHON.name, sys.executable)  # executors run this interpreter
    from pyspark.sql import SparkSession

    _embedded = (SparkSession.builder.master(f"local[{max(np, 2)}]").appName("sparkhvd")
                 .config("spark.ui.enabled", "false")
                 .config("spark.ui.showConsoleProgress", "false")
                 .getOrCreate())
    return _embedded.sparkContext


def _gpu_amount(sc) -> float:
    conf = sc.getConf()
    return float(conf.get("spark.executor.resource.gpu.amount", "0") or 0)


def ranks_per_task(sc, gpus: bool = True) -> int:
    """How many ranks each Spark task runs: ``k`` where each task holds ``k`` GPUs (``spark.task.resource.gpu.amount``
    = k > 1, on executors with GPUs: ``spark.executor.resource.gpu.amount``), one rank on each, as pyspark's
    TorchDistributor runs ``k`` processes in such a task; else 1. ``gpus``: whether the run's tasks ask for GPUs."""
    if not gpus or _gpu_amount(sc) <= 0:
        return 1
    amount = float(sc.getConf().get("spark.task.resource.gpu.amount", "1") or 1)
    return int(amount) if amount > 1 else 1  # Spark itself refuses a fractional amount above 1


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


#: Spark's settings that encrypt its own traffic; the ranks' gloo and NCCL traffic is not encrypted under either.
ENCRYPTION_CONFS = ("spark.ssl.enabled", "spark.network.crypto.enabled")


def encrypted_by(conf_get) -> list:
    """Which of ``ENCRYPTION_CONFS`` are ``true``, read through ``conf_get(key, default)`` (a SparkConf's or a
    session's ``conf.get``)."""
    return [key for key in ENCRYPTION_CONFS if str(conf_get(key, "false")).strip().lower() == "true"]


def refuse_unencrypted(conf_get, override: str, senders: str, carrier: str) -> None:
    """The drop-ins' check, as pyspark's TorchDistributor and spark-tensorflow-distributor make it: where Spark
    encrypts its traffic (read through ``conf_get``, None: no session), refuse unless ``override`` is ``true``,
    then warn. ``senders``: who sends tensors ("TorchDistributor's processes"); ``carrier``: what carries them."""
    if conf_get is None:
        return
    on = encrypted_by(conf_get)
    if not on:
        return
    what = " and ".join(f"{key}=true" for key in on)
    if str(conf_get(override, "false")).strip().lower() == "true":
        warnings.warn(f"This cluster has encryption enabled ({what}); however, training does not support data "
                      f"encryption in transit: {senders} send model parameters and possibly training data to each "
                      f"other unencrypted ({carrier} do not encrypt); going on because {override}=true.",
                      RuntimeWarning, stacklevel=4)
        return
    # pyspark's words ("encryption enabled", "does not support data encryption in transit", "unencrypted"), with
    # which setting is on and what carries the tensors
    raise RuntimeError(f"This cluster has encryption enabled ({what}); however, training does not support data "
                       f"encryption in transit: {senders} would send model parameters and possibly training data to "
                       f"each other unencrypted ({carrier} do not encrypt). To train anyway, set {override}=true in "
                       f"the Spark configuration.")


def warn_unencrypted(sc, run_id: str, *, stacklevel: int = 4) -> None:
    """Where Spark encrypts its own traffic, say once that the ranks' is not (HorovodRunner goes on, as Horovod
    does; the TorchDistributor drop-in refuses, as pyspark's does)."""
    on = encrypted_by(sc.getConf().get)
    if on:
        warnings.warn(f"sparkhvd run {run_id}: this cluster encrypts Spark's traffic ({' and '.join(on)}), but the "
                      "ranks' gloo and NCCL traffic (tensors, gradients, parameters) is not encrypted; run where the "
                      "network between executors is trusted (docs/security.md).", RuntimeWarning, stacklevel=stacklevel)


def preflight(sc, np: int, *, verbose: bool = True, gpus: bool = True, one_rank_per_task: bool = False) -> None:
    """Every check before the barrier stage, each failing in seconds with one sentence: np against the GPUs each
    task holds (``one_rank_per_task``: one rank has them all), the configuration (dynamic allocation), the task
    slots, the GPU slots (``gpus``: where tasks ask for them), and the executors' Python (``_preflight``)."""
    gpus_per_task = ranks_per_task(sc, gpus)
    per_task = 1 if one_rank_per_task else gpus_per_task
    check_ranks_per_task(np, per_task)
    check_slots(sc, np, verbose=verbose, per_task=per_task)
    if gpus:
        check_gpus(sc, np, per_task, gpus_per_task)
    check_executors(sc, np // per_task, task_slots(sc))


def check_slots(sc, np: int, *, verbose: bool = False, per_task: int = 1) -> None:
    """Fail in seconds, with both numbers and the fix, when np ranks' tasks (``per_task`` ranks in each:
    ``ranks_per_task``) cannot all run at once.

    Executors of a cluster still starting register over a few seconds: wait for them until the
    slots suffice, the most the configuration allows is below np, or (where the configuration does
    not say how many will come) no executor has joined for ``_SLOT_SETTLE_S``; at most ``_SLOT_WAIT_S``. ``verbose``: say once what it waits for.
    Slots that other sparkhvd runs of this driver hold (``running``) are not free: a barrier stage would wait
    for them until start_timeout.
    """
    check_barrier_conf(sc.getConf())
    ranks, np = np, np // per_task  # from here on, np counts the stage's tasks
    bound = max_slots(sc.master, sc.getConf())
    waiting = not sc.master.startswith("local[") and (bound is None or bound >= np)
    deadline = time.monotonic() + (_SLOT_WAIT_S if waiting else 0)
    seen, changed = -1, time.monotonic()
    note = WaitNote(verbose)
    while True:
        slots = task_slots(sc)
        now = time.monotonic()
        if slots != seen:
            seen, changed = slots, now
        # where the configuration promises np slots (local-cluster, spark.cores.max), the missing executors are
        # still coming (a lost one being replaced, a loaded machine): wait for them up to the deadline
        settled = bound is None and slots > 0 and now - changed >= _SLOT_SETTLE_S
        if slots >= np or now >= deadline or settled:
            break
        note.progress(slots, lambda: f"waiting for {np} task slots: Spark has {slots} ({_slots_detail(sc)}); will "
                                     f"wait up to {_SLOT_WAIT_S:g} s for executors to register")
        time.sleep(0.2)
    if slots < np:
        capped = bound is not None and bound < np
        each = f" ({per_task} ranks in each, one per GPU: spark.task.resource.gpu.amount={per_task})" if per_task > 1 else ""
        raise RuntimeError(
            f"np={ranks} needs {np} task slots{each} but the cluster has {slots} ({sc.master}"
            f"{f', at most {bound} by its configuration' if capped else ''}); "
            f"use np<={max(bound if capped else slots, 1) * per_task}, add executors or cores, or use np=-{ranks} to "
            "run on the driver.")
    problem = running.refusal(np, slots, sc.master, running.held(application(sc)), per_task)
    if problem is not None:
        raise RuntimeError(problem)


def _slots_detail(sc) -> str:
    try:
        cores = f", cores {sum(cores for _, _, cores, _ in executor_resources(sc))}"
    except Exception:  # noqa: BLE001 - a Spark without this private API
        cores = ""
    return f"{sc.master}{cores}, {sc.getConf().get('spark.task.cpus', '1')} per task"




def check_gpus(sc, np: int, per_task: int = 1, gpus_per_task: int | None = None) -> None:
    """Where each task asks for GPUs (spark.executor.resource.gpu.amount; ``gpus_per_task`` of them, for its
    ``per_task`` ranks: ``ranks_per_task``), fail in seconds when the executors have none, or fewer GPU slots than np
    ranks need: the barrier stage would wait for them forever."""
    amount = _gpu_amount(sc)
    if amount <= 0:
        return
    task_cpus = max(1, int(sc.getConf().get("spark.task.cpus", "1") or 1))
    problem = gpu_problem(np, amount, executor_resources(sc), task_cpus, sc.master, per_task, gpus_per_task)
    if problem is not None:
        raise RuntimeError(problem)


def gpu_problem(np: int, amount: float, executors: list, task_cpus: int, master: str, per_task: int = 1,
                gpus_per_task: int | None = None) -> str | None:
    """The sentence ``check_gpus`` raises for these executors (``(id, host, cores, gpus)``), or None; ``per_task``:
    the ranks of each task, ``gpus_per_task`` its GPUs (default: one per rank)."""
    k = per_task if gpus_per_task is None else gpus_per_task
    if amount <= 0:
        return None
    count = len(executors)
    if not any(gpus for _, _, _, gpus in executors):
        return (f"np={np} asks each task for one GPU, as spark.executor.resource.gpu.amount={amount:g} says, but none "
                f"of Spark's {count} executor{'s' if count != 1 else ''} ({master}) has a GPU resource; give the "
                "executors GPUs (spark.executor.resource.gpu.discoveryScript, and spark.worker.resource.gpu.* on a "
                "standalone cluster), or unset spark.executor.resource.gpu.amount to run on CPUs.")
    slots = sum(min(gpus // k, cores // task_cpus) for _, _, cores, gpus in executors)
    if slots < np // per_task:
        each = ", ".join(f"executor {i} on {host}: {gpus} GPU{'s' if gpus != 1 else ''}, {cores} cores"
                         for i, host, cores, gpus in executors)
        tasks = "one per task" if k == 1 else f"{k} per task (spark.task.resource.gpu.amount={k})"
        return (f"np={np} needs {np // per_task * k} GPUs, {tasks}, but Spark's executors can run {slots} GPU task"
                f"{'s' if slots != 1 else ''} at once ({each}; spark.task.cpus={task_cpus}); use "
                f"np<={max(slots, 1) * per_task}, or add executors with GPUs.")
    return None


def slots_for_restart(sc, want: int, least: int | None, timeout: float, *, verbose: bool = True,
                      run_id: str | None = None) -> int:
    """How many ranks a restart can have: ``want`` as soon as Spark has that many task slots again; with
    ``least`` (HorovodRunner's min_np), at once what there is, if at least ``least``, as Horovod elastic goes
    on with its survivors (the run grows back at a commit when Spark returns the slots); otherwise, after
    ``timeout`` seconds, RuntimeError (a lost executor is replaced within seconds on a standalone cluster).
    ``verbose``: say once what it waits for. Slots that other sparkhvd runs of this driver than ``run_id``
    hold (``running``) are not there."""
    deadline = time.monotonic() + timeout
    note = WaitNote(verbose)
    while True:
        slots = running.free(task_slots(sc), running.held(application(sc), other_than=run_id))
        if slots >= want:
            return want
        if least is not None and slots >= least:
            return slots
        if time.monotonic() >= deadline:
            raise RuntimeError(
                f"after the failure Spark had {slots} task slot{'s' if slots != 1 else ''} free for the restart within "
                f"start_timeout={timeout:g} s, not the {want} it needs"
                + (f" nor min_np={least}" if least is not None else "")
                + f"; pass min_np=<n> (n <= {max(slots, 1)}) to go on with fewer ranks, raise start_timeout, or add "
                "executors")
        note.progress(slots, lambda: f"waiting for {want} task slots for the restart: Spark has {slots} "
                                     f"({_slots_detail(sc)}); will wait up to {timeout:g} s (start_timeout)"
                                     + (f", then go on with min_np={least} or more" if least is not None else ""))
        time.sleep(0.5)


def gpu_task_profile(task_cpus: int, gpus: int = 1):
    """A resource profile asking ``gpus`` GPUs, and ``task_cpus`` CPUs, for each task."""
    from pyspark.resource import ResourceProfileBuilder, TaskResourceRequests

    return ResourceProfileBuilder().require(TaskResourceRequests().cpus(task_cpus).resource("gpu", float(gpus))).build


def replace_executors(sc, hosts: set) -> list:
    """Ask Spark to kill and replace the executors on ``hosts`` (addresses or hostnames); returns their ids.

    Ranks there went silent: their host is cut off. Spark would count those executors' slots, and place
    a restart's tasks on them, until it gives up on them itself (``spark.network.timeout``).
    The replacements come where the cluster manager has room (on the same host once it is back).
    """
    summaries = sc._jsc.sc().statusStore().executorList(True).iterator()
    ids = []
    while summaries.hasNext():
        summary = summaries.next()
        if summary.id() != "driver" and summary.hostPort().rsplit(":", 1)[0] in hosts:
            ids.append(summary.id())
    for executor_id in ids:
        sc._jsc.sc().killAndReplaceExecutor(executor_id)  # private[spark] in Scala, public to py4j
    return ids


def max_slots(master: str, conf) -> int | None:
    """The most task slots the configuration allows, where it says (local-cluster, spark.cores.max)."""
    task_cpus = max(1, int(conf.get("spark.task.cpus", "1") or 1))
    match = re.fullmatch(r"local-cluster\[\s*(\d+)\s*,\s*(\d+)\s*,\s*\d+\s*\]", master)
    if match:
        return int(match.group(1)) * (int(match.group(2)) // task_cpus)
    cores_max = conf.get("spark.cores.max")
    if master.startswith("spark://") and cores_max and cores_max.isdigit():
        return int(cores_max) // task_cpus
    return None


class SparkLauncher(JobLauncher):
    """Runs the task agents as one Spark barrier stage, in a job group of its own.

    ``replaced``: the ids of the executors that the run asked Spark to replace (shared by its attempts): their
    removal, which lands whenever Spark gets to it, is never a later attempt's cause. ``status``: Spark's
    status store (``SparkStatus``), or a stand-in for it. ``gpus``: whether each task asks for a GPU where the
    cluster has them (False: the TorchDistributor drop-in's ``use_gpu=False``).
    """

    def __init__(self, sc, np: int, *, replaced: set | None = None, status: "SparkStatus | None" = None,
                 gpus: bool = True, per_task: int = 1, gpus_per_task: int | None = None, dataframe=None):
        super().__init__()
        self.sc = sc
        self.np = np
        self.gpus = gpus
        self.per_task = per_task  # ranks in each Spark task: ranks_per_task, or 1 (one_rank_per_task)
        self.gpus_per_task = per_task if gpus_per_task is None else gpus_per_task  # what each task asks for
        self.tasks = np // per_task
        self.dataframe = dataframe  # task i hands its ranks partition i's rows (np // per_task partitions)
        self.description = f"a Spark barrier stage on {sc.master}"
        self.status = status if status is not None else SparkStatus(sc)
        self.replaced = replaced if replaced is not None else set()
        self._group = None
        self._executors: dict = {}  # (stage id, task id) -> the executor it ran on, as found

    def start(self, spec: TaskSpec) -> None:
        """Submit the barrier stage, holding its slots in ``running`` until its job ends.

        Raises:
            RuntimeError: (a run's first stage) other runs of this driver took the slots since its pre-flight.
        """
        self._group = f"sparkhvd-{spec.run_id}-{spec.attempt}"
        spec = dataclasses.replace(spec, per_task=self.per_task)
        app = application(self.sc)  # "": stopped, which the job itself reports
        first = spec.attempt == 0 and bool(app)  # a restart's slots were waited for (slots_for_restart): no second check
        running.hold(running.Stage(app, spec.run_id, self._group, self.tasks, self.per_task),
                     slots=task_slots(self.sc) if first else None, master=self.sc.master)
        try:
            self._submit(spec, "sparkhvd-job")
        except BaseException:
            running.release(self._group)
            raise

    def _job(self, spec: TaskSpec) -> None:
        try:
            self._run_stage(spec)
        finally:
            running.release(self._group)  # the stage's tasks have ended: its slots are free

    def _run_stage(self, spec: TaskSpec) -> None:
        sc = self.sc
        try:
            attempt = f", restart {spec.attempt}" if spec.attempt else ""
            sc.setJobGroup(self._group, f"sparkhvd run {spec.run_id} (np={self.np}{attempt})", interruptOnCancel=True)
            profile = None
            if self.gpus and _gpu_amount(sc) > 0:
                profile = gpu_task_profile(int(sc.getConf().get("spark.task.cpus", "1")), self.gpus_per_task)
            if self.dataframe is not None:  # a task per partition, as pyspark's _train_on_dataframe runs them
                schema = json.dumps(self.dataframe.schema.jsonValue())
                self.dataframe.mapInArrow(functools.partial(_partition_task, spec, self.per_task, schema),
                                          "chunk binary", barrier=True, profile=profile).collect()
                return
            rdd = sc.parallelize(range(self.tasks), self.tasks).barrier().mapPartitions(
                functools.partial(_barrier_task, spec, self.per_task))
            if profile is not None:
                rdd = rdd.withResources(profile)
            rdd.collect()  # the outcome arrives through the driver service
        except Exception as exc:  # noqa: BLE001 - reported through failure()
            if _stopped(sc) or _says_stopped(exc):
                self.fatal = True
                self._error = ("the SparkContext was stopped while the run was going (spark.stop(), or the "
                               "session ended); start a new SparkSession to run again")
            elif not self._stopped:
                self._error = f"the Spark job failed: {spark_reason(exc)}"

    def waiting_for(self) -> str:
        """Spark's word on the barrier stage while ranks have not registered: submitted, and how many tasks run."""
        try:
            tracker, active, total = self.sc.statusTracker(), 0, 0
            for job in tracker.getJobIdsForGroup(self._group):
                info = tracker.getJobInfo(job)
                for stage in (info.stageIds if info is not None else []):
                    stage_info = tracker.getStageInfo(stage)
                    if stage_info is not None:
                        active, total = active + stage_info.numActiveTasks, total + stage_info.numTasks
        except Exception:  # noqa: BLE001 - the context is going away: say nothing more
            return ""
        if not total:
            return " (Spark has not submitted the barrier stage yet)"
        return f" (Spark runs {active} of the barrier stage's {total} tasks{'' if active else ': none has started'})"

    def lost(self, unfinished: list) -> str | None:
        """The executors that Spark removed while these ranks (``(rank, Registration)``) ran on them, and why.

        Matched by executor id, through the Spark task each rank's agent ran in, never by host: a removal that
        lands late, of an executor this attempt did not use (one the run asked Spark to replace, say), or of
        another executor on the same host, is not this attempt's cause.
        """
        try:
            removed, ran = self._removed(unfinished)
        except Exception:  # noqa: BLE001 - a Spark without this private API, or one stopping: no executor detail
            return None
        found = [f"{_ranks_clause(ranks)} ran on executor {executor_id} on host {reg.host} ({reg.peer}), which Spark "
                 f"lost: {removed[executor_id]}" for executor_id, (reg, ranks) in ran.items()]
        return "; ".join(found) or None

    def lost_ranks(self, unfinished: list) -> set:
        """The ranks of ``lost``'s executors: a stopped or cut-off host's agents may keep their connections open."""
        try:
            _, ran = self._removed(unfinished)
        except Exception:  # noqa: BLE001 - as in lost()
            return set()
        return {rank for _, ranks in ran.values() for rank in ranks}

    def _removed(self, unfinished: list) -> tuple[dict, dict]:
        """``(executor id -> why Spark removed it, executor id -> (a registration there, its ranks))`` for the
        executors Spark removed (not those the run asked it to replace) and the ranks of ``unfinished`` on them."""
        removed = {executor_id: reason for executor_id, _, reason in self.status.removed_executors()
                   if executor_id not in self.replaced}
        return removed, (self._ranks_on(unfinished, removed) if removed else {})

    def preempted(self, unfinished: list) -> str | None:
        """The executors of these ranks that Spark is decommissioning (``spark.decommission.enabled``: SIGPWR to
        the executor or its worker, a Kubernetes pod's preStop, a spot notice a cluster manager forwards)."""
        try:
            self._executors_of(unfinished)
            ids = {self._executors[reg.spark_task] for _, reg in unfinished if reg.spark_task in self._executors}
            taken = self.status.decommissioned(ids) if ids else {}
            ran = self._ranks_on(unfinished, taken) if taken else {}
        except Exception:  # noqa: BLE001 - a Spark without this private API, or one stopping: no notice
            return None
        found = [f"executor {executor_id} on host {reg.host} ({reg.peer}), which runs {_ranks_clause(ranks)}, is "
                 f"being decommissioned by Spark{taken[executor_id]}" for executor_id, (reg, ranks) in ran.items()]
        return "; ".join(found) or None

    def _executors_of(self, unfinished: list) -> bool:
        """Look up the executor of each of these ranks' Spark tasks not yet known; whether any is known."""
        tasks = {reg.spark_task for _, reg in unfinished if reg.spark_task is not None}
        if tasks - set(self._executors):
            self._executors.update(self.status.task_executors(tasks - set(self._executors)))
        return bool(tasks & set(self._executors))

    def _ranks_on(self, unfinished: list, executors) -> dict:
        """``executor id -> (a registration there, its ranks)`` for those of ``executors`` these ranks ran on,
        in rank order."""
        if not self._executors_of(unfinished):
            return {}
        ran: dict[str, tuple] = {}
        for rank, reg in unfinished:
            executor_id = self._executors.get(reg.spark_task)
            if executor_id in executors:
                ran.setdefault(executor_id, (reg, []))[1].append(rank)
        return dict(sorted(ran.items(), key=lambda item: min(item[1][1])))

    def stop(self) -> None:
        self._stopped = True
        if self._group is not None and self.sc._jsc is not None:
            try:
                self.sc.cancelJobGroup(self._group)
            except Exception:  # spark.stop() came first: there is no job left to cancel
                if not _stopped(self.sc):
                    raise



def _ranks_clause(ranks: list) -> str:
    return f"rank{'s' if len(ranks) > 1 else ''} {','.join(map(str, sorted(ranks)))}"


def application(sc) -> str:
    """The SparkContext's application id, which keys its stages in ``running``; "" once it is stopped."""
    try:
        return sc.applicationId
    except Exception:  # noqa: BLE001 - stopped: its gateway object is gone
        return ""


def _barrier_task(spec: TaskSpec, per_task: int, _partition):
    """Runs inside the barrier task on an executor: the agents of its ``per_task`` ranks (tasks ``partition *
    per_task + j``), each with the task's ``j``-th GPU where it holds ``per_task`` of them."""
    yield from _task_agents(spec, per_task)


def _task_agents(spec: TaskSpec, per_task: int, env: dict | None = None) -> list:
    """The status rows of this barrier task's agents, run to their end: ``run_task`` alone, or ``run_tasks``'
    ``per_task`` side by side; ``env``: variables of the task's own for its ranks."""
    from pyspark import BarrierTaskContext

    ctx = BarrierTaskContext.get()
    gpu = ctx.resources().get("gpu")
    addresses = list(gpu.addresses) if gpu is not None else []
    spark_task = (ctx.stageId(), ctx.taskAttemptId())
    first = ctx.partitionId() * per_task
    if per_task == 1:
        return [run_task(spec, first, gpus=addresses, spark_task=spark_task, env=env)]
    return run_tasks(spec, [(first + j, addresses[j:j + 1]) for j in range(per_task)], spark_task=spark_task,
                     env=env)


#: The variables naming a task's partition and the DataFrame's schema, which pyspark's
#: ``pyspark.ml.torch.distributor._get_spark_partition_data_loader`` reads in a rank (pyspark's names).
PARTITION_FILE, SCHEMA_FILE = "SPARK_PARTITION_ARROW_DATA_FILE", "SPARK_DATAFRAME_SCHEMA_FILE"


def _partition_task(spec: TaskSpec, per_task: int, schema: str, batches):
    """A barrier task over a DataFrame's partition: its rows as an Arrow stream in a file of the task's (under
    Spark's working folder for the application, as pyspark's), named to its ranks by pyspark's variables, then
    ``_barrier_task``'s agents. Removed when they end."""
    import tempfile

    import pyarrow as pa
    from pyspark import BarrierTaskContext, SparkFiles

    folder = tempfile.mkdtemp(prefix="sparkhvd-partition-", dir=SparkFiles.getRootDirectory())
    try:
        data, schema_file = os.path.join(folder, "data.arrow"), os.path.join(folder, "schema.json")
        writer = None
        with open(data, "wb") as f:
            for batch in batches:
                if writer is None:
                    writer = pa.ipc.new_stream(f, batch.schema)
                writer.write_batch(batch)
            if writer is not None:
                writer.close()
        if writer is None:  # pyspark's sentence, then the partition and the fix
            raise ValueError(f"Empty Spark partition is not allowed in TorchDistributor.train_on_dataframe: partition "
                             f"{BarrierTaskContext.get().partitionId()} has no rows; repartition the DataFrame so that "
                             "every one of its partitions has rows (df.repartition(n) with n at most its rows).")
        with open(schema_file, "w", encoding="utf-8") as f:
            f.write(schema)
        _task_agents(spec, per_task, env={PARTITION_FILE: data, SCHEMA_FILE: schema_file})
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    yield from ()


def _says_stopped(exc: BaseException) -> bool:
    """Whether a failed job's exception says the SparkContext was stopped under it (Spark gives no type for it)."""
    return says(read_text(type(exc).__name__, str(exc)), SPARK_STOPPED) is not None


def _stopped(sc) -> bool:
    try:
        return sc._jsc is None or sc._jsc.sc().isStopped()
    except Exception:  # noqa: BLE001 - the gateway is gone too
        return True


class SparkStatus:
    """What Spark's status store (``SparkContext.statusStore``, private to Spark, reached through py4j) says
    of the application's executors and tasks. Each call may raise where the API differs or the context stops."""

    def __init__(self, sc):
        self.sc = sc

    def removed_executors(self) -> list:
        """``(id, host, reason)`` for each executor Spark has removed from this application."""
        it = self.sc._jsc.sc().statusStore().executorList(False).iterator()
        removed = []
        while it.hasNext():
            summary = it.next()
            if summary.isActive() or summary.id() == "driver":
                continue
            reason = summary.removeReason()
            reason = reason.get() if reason.isDefined() else "no reason given"
            removed.append((summary.id(), summary.hostPort().rsplit(":", 1)[0], reason))
        return removed

    def decommissioned(self, executor_ids: set) -> dict:
        """``executor id -> ""`` (or ``", with its worker on <host>"``) for those of ``executor_ids`` that
        Spark's scheduler is decommissioning or has removed by decommissioning."""
        scheduler = self.sc._jsc.sc().taskScheduler()
        found = {}
        for executor_id in executor_ids:
            state = scheduler.getExecutorDecommissionState(executor_id)
            if state.isDefined():
                worker = state.get().workerHost()
                found[executor_id] = f", with its worker on {worker.get()}" if worker.isDefined() else ""
        return found

    def task_executors(self, tasks: set) -> dict:
        """``(stage id, task id) -> executor id`` of those of ``tasks`` that the store has seen start."""
        store, tracker = self.sc._jsc.sc().statusStore(), self.sc.statusTracker()
        wanted = {task for _, task in tasks}
        found = {}
        for stage in {stage for stage, _ in tasks}:
            info = tracker.getStageInfo(stage)
            for attempt in range((info.currentAttemptId if info is not None else 0) + 1):
                it = store.taskList(stage, attempt, 1 << 30).iterator()
                while it.hasNext():
                    task = it.next()
                    if task.taskId() in wanted:
                        found[(stage, task.taskId())] = task.executorId()
        return found


class SparkBackend(Backend):
    """A Spark barrier stage per attempt on the active SparkContext (or an embedded ``local[np]`` session, started
    by ``prepare``). ``warn_unencrypted``: say once where Spark encrypts its own traffic and the ranks' is not
    (False: a drop-in checked that itself)."""

    name = "spark"

    def __init__(self, *, warn_unencrypted: bool = True, one_rank_per_task: bool = False, dataframe=None):
        self.sc = None  # set by prepare
        self.dataframe = dataframe  # whose partitions the tasks hand their ranks (RunnerConfig's), or None
        self.one_rank_per_task = one_rank_per_task  # a task of k GPUs runs one rank with all k (RunnerConfig's)
        self.gpus_per_task = 1
        self.run_id, self.verbose = "", True
        self.warn_unencrypted = warn_unencrypted
        self.replaced: set[str] = set()  # executors this run asked Spark to replace: never a later attempt's cause

    def prepare(self, np: int, *, run_id: str, verbose: bool, gpus: bool) -> str:
        self.run_id, self.verbose = run_id, verbose
        self.sc = spark_context(np)
        self.gpus_per_task = ranks_per_task(self.sc, gpus)
        self.per_task = 1 if self.one_rank_per_task else self.gpus_per_task
        preflight(self.sc, np, verbose=verbose, gpus=gpus, one_rank_per_task=self.one_rank_per_task)  # slots, GPUs, Python
        if self.warn_unencrypted:
            warn_unencrypted(self.sc, run_id, stacklevel=5)  # the user's run() call
        return driver_bind_host(self.sc)

    def launcher(self, n: int, *, gpus: bool) -> Launcher:
        return SparkLauncher(self.sc, n, replaced=self.replaced, gpus=gpus, per_task=self.per_task,
                             gpus_per_task=self.gpus_per_task, dataframe=self.dataframe)

    def free_slots(self) -> int:
        """Free task slots, in ranks: ``per_task`` in each."""
        return free_slots(self.sc) * self.per_task

    def slots_for_restart(self, want: int, least: int | None, timeout: float) -> int:
        """``slots_for_restart``, in ranks (np, min_np and the answer are multiples of ``per_task``)."""
        k = self.per_task
        tasks = slots_for_restart(self.sc, want // k, None if least is None else -(-least // k), timeout,
                                  verbose=self.verbose, run_id=self.run_id)
        return tasks * k

    def replace_hosts(self, hosts: frozenset) -> None:
        self.replaced.update(_replace_executors(self.sc, set(hosts), self.run_id))


def backend_for(config) -> SparkBackend:
    """For ``np > 0`` where no Spark Connect session is active (registry.py asks it after connect's)."""
    return SparkBackend(warn_unencrypted=config.warn_unencrypted, one_rank_per_task=config.one_rank_per_task,
                        dataframe=config.dataframe)


def free_slots(sc) -> int:
    """Task slots no running task of this application holds (Spark's slot count includes busy ones), nor a
    barrier stage of this driver's sparkhvd runs that Spark has not started yet (``running``)."""
    tracker = sc.statusTracker()
    active = 0
    for stage in tracker.getActiveStageIds():
        info = tracker.getStageInfo(stage)
        active += info.numActiveTasks if info is not None else 0
    slots = task_slots(sc)
    return min(slots - active, running.free(slots, running.held(application(sc))))


def _replace_executors(sc, hosts: set, run_id: str) -> list:
    """Ask Spark to replace the executors on ``hosts``; returns their ids (none where Spark cannot be asked)."""
    try:
        ids = replace_executors(sc, hosts)
    except Exception as exc:  # noqa: BLE001 - a Spark without this API: Spark notices the lost host itself, later
        warnings.warn(f"sparkhvd run {run_id}: could not ask Spark to replace the executors on {sorted(hosts)}, whose "
                      f"ranks went silent ({type(exc).__name__}: {exc}); the restart waits until Spark gives up on "
                      "them (spark.network.timeout).", RuntimeWarning, stacklevel=3)
        return []
    if ids:
        print(f"[sparkhvd] run {run_id}: asked Spark to replace executor{'s' if len(ids) > 1 else ''} "
              f"{', '.join(ids)} on {', '.join(sorted(hosts))}, whose ranks went silent.", flush=True)
    return ids


def driver_bind_host(sc) -> str:
    """Loopback for local masters; otherwise the address executors use to reach the driver."""
    if sc.master.startswith("local"):
        return "127.0.0.1"
    return sc.getConf().get("spark.driver.host") or socket.gethostbyname(socket.gethostname())
