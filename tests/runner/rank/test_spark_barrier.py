"""BarrierTaskContext's barrier() and allGather() in a rank (runner/_rank/spark_barrier.py), with Spark's semantics:
one thread per task, each with its own connection to a real DriverService on 127.0.0.1; and the context the rank
installs (runner/_rank/task_context.py) and the values the agent hands it (runner/_agent/task_context.py)."""

from __future__ import annotations

import json
import random
import re
import threading
import time

import pytest

from sparkhvd._common import progress
from sparkhvd._common.client import RunAborted, ServiceClient
from sparkhvd._common.protocol import new_secret
from sparkhvd._common.spark_task import SparkTask
from sparkhvd._common.topology import assign_ranks
from sparkhvd.runner._agent import task_context as agent_task
from sparkhvd.runner._agent.env import rank_env
from sparkhvd.runner._agent.spec import TaskSpec
from sparkhvd.runner._policy.stall_report import RankState, StallSettings, StallView, report
from sparkhvd.runner._rank import task_context as rank_task
from sparkhvd.runner._rank.spark_barrier import ALL_GATHER, BARRIER, LINK, BarrierSyncError, SparkBarrier
from sparkhvd.runner._service.service import DriverService

pytestmark = pytest.mark.unit


@pytest.fixture
def service():
    svc = DriverService(np=3, secret=new_secret(), payload=b"")
    yield svc
    svc.close()


def _barriers(service, n, timeout=30.0):
    return [SparkBarrier(lambda: ServiceClient(service.address, service._secret), stage=7, partition=p, tasks=n,
                         timeout=timeout) for p in range(n)]


def _each(barriers, work):
    """Run ``work(partition, barrier)`` on a thread per task; each task's return value or exception, by partition."""
    out: list = [None] * len(barriers)

    def run(p):
        try:
            out[p] = work(p, barriers[p])
        except Exception as exc:  # noqa: BLE001 - the test asserts on it
            out[p] = exc

    threads = [threading.Thread(target=run, args=(p,), daemon=True) for p in range(len(barriers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return out


def test_syncs_in_a_row_keep_apart_and_gather_in_partition_order(service):
    def work(p, barrier):
        seen = []
        for step in range(4):
            time.sleep(random.random() * 0.02)  # the tasks arrive in any order
            barrier.sync(BARRIER)
            seen.append(barrier.sync(ALL_GATHER, f"{step}:{p}"))
        return seen

    out = _each(_barriers(service, 3), work)
    expected = [[f"{step}:{p}" for p in range(3)] for step in range(4)]
    assert out == [expected] * 3
    # each sync's entries are gone once gathered, and the sync before it once every task has reached this one
    assert sorted(service.store.snapshot()) == ["spark.barrier/7/7/count", "spark.barrier/7/7/done"]


def test_a_stage_of_one_task_syncs_at_once(service):
    (barrier,) = _barriers(service, 1)
    barrier.sync(BARRIER)
    assert barrier.sync(ALL_GATHER, "alone") == ["alone"]


def test_barrier_in_one_task_and_allgather_in_another_fail_every_task(service):
    def work(p, barrier):
        barrier.sync(ALL_GATHER, "first")  # sync 0: alike
        return barrier.sync(BARRIER) if p == 1 else barrier.sync(ALL_GATHER, str(p))

    out = _each(_barriers(service, 3), work)
    assert all(isinstance(e, BarrierSyncError) for e in out), out
    assert {str(e) for e in out} == {
        "Different barrier sync types found for sync 1 (the 2nd barrier() or allGather() call) of Stage 7: partitions "
        "0,2 called allGather() and partition 1 called barrier(). Please use the same barrier sync type within a "
        "single sync: every task of a barrier stage must make the same barrier() and allGather() calls, in the same "
        "order."}


def test_a_task_that_never_comes_times_the_sync_out_naming_the_partitions(service):
    barriers = _barriers(service, 3, timeout=0.5)
    out = _each(barriers[:2], lambda p, barrier: barrier.sync(BARRIER))
    assert all(isinstance(e, BarrierSyncError) for e in out), out
    assert str(out[0]) == (
        "The coordinator didn't get all barrier sync requests for sync 0 (the 1st barrier() or allGather() call) of "
        "Stage 7 within 0.5 second(s): partitions 0,1 reached it, partition 2 did not. Every task of a barrier stage "
        "must call barrier() and allGather() the same number of times; partition 0 called barrier() here.")


def test_a_waiting_sync_is_in_the_stall_report_and_ends_when_the_run_is_aborted(service):
    barriers = _barriers(service, 2)
    done: dict = {}
    thread = threading.Thread(target=lambda: done.setdefault("error", _raised(barriers[0].sync, BARRIER)),
                              daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not [op for op in progress.snapshot()["ops"] if op["link"] == LINK]:
        assert time.monotonic() < deadline, "the sync never showed as a collective in flight"
        time.sleep(0.01)
    (op,) = [op for op in progress.snapshot()["ops"] if op["link"] == LINK]
    assert op["kind"] == "BarrierTaskContext.barrier()" and op["set"] is None and op["phase"] == "check"
    view = StallView(np=2, stalled_for=61.0, ranks=(RankState(0, "running", ops=(op | {"age": 61.0},), heard_ago=0.1),
                                                     RankState(1, "running", heard_ago=0.1)))
    headline, lines = report(view, StallSettings())
    assert headline.startswith("no collective has completed for 61 s while ranks wait in one")
    assert lines[0] == ("- BarrierTaskContext.barrier() on all ranks: rank 0 has waited in it for 61 s; rank 1 has "
                        "not reached it: it is running user code (it has not called a collective yet).")
    service.abort("rank 1 failed")
    thread.join(10)
    assert isinstance(done["error"], RunAborted) and "rank 1 failed" in str(done["error"])
    assert not [op for op in progress.snapshot()["ops"] if op["link"] == LINK]


def _raised(call, *args):
    try:
        call(*args)
    except Exception as exc:  # noqa: BLE001 - the test asserts on it
        return exc
    return None


# ---- the context in the rank ---------------------------------------------------------------------------------

TASK = SparkTask(stage_id=4, partition_id=1, attempt_number=0, task_attempt_id=9, cpus=2, cpu_amount="1.5",
                 resources={"gpu": ["1"]}, local_properties={"addresses": "10.0.0.1:4040, 10.0.0.2:4040", "k": "v"})


def test_the_context_answers_with_the_tasks_values_and_allgather_wants_a_string():
    taskcontext = pytest.importorskip("pyspark.taskcontext")
    placement = assign_ranks(["a", "b"])[1]
    ctx = rank_task._context_of(taskcontext, TASK, placement)
    assert isinstance(ctx, taskcontext.BarrierTaskContext)
    assert (ctx.stageId(), ctx.partitionId(), ctx.attemptNumber(), ctx.taskAttemptId(), ctx.cpus()) == (4, 1, 0, 9, 2)
    assert str(ctx.cpuAmount()) == "1.5" and ctx.getLocalProperty("k") == "v"
    assert {k: (v.name, v.addresses) for k, v in ctx.resources().items()} == {"gpu": ("gpu", ["1"])}
    assert [i.address for i in ctx.getTaskInfos()] == ["10.0.0.1:4040", "10.0.0.2:4040"]
    with pytest.raises(TypeError, match=re.escape(
            "Argument `message` must be of type `str`, but partition 1 passed int 3; pass a string, e.g. "
            "json.dumps(value), and json.loads each of the messages allGather() returns.")):
        ctx.allGather(3)
    plain = rank_task._context_of(taskcontext, SparkTask(**{**TASK.__dict__, "barrier": False}), placement)
    assert isinstance(plain, taskcontext.TaskContext) and not isinstance(plain, taskcontext.BarrierTaskContext)
    with pytest.raises(RuntimeError, match=re.escape(
            "BarrierTaskContext.barrier() and allGather() work once the rank has joined its run, inside the training "
            "function; call them there.")):
        ctx.barrier()  # this process has joined no run


def test_with_k_ranks_in_each_task_every_rank_takes_part_in_a_sync_by_rank():
    """Two Spark tasks of two GPUs, four ranks: the four sync (the tasks' partitions alone would count each twice)."""
    taskcontext = pytest.importorskip("pyspark.taskcontext")
    placements = assign_ranks(["a", "a", "b", "b"])
    one = rank_task._context_of(taskcontext, TASK, assign_ranks(["a", "b"])[1])
    assert (one._sparkhvd_sync.partition, one._sparkhvd_sync.tasks) == (1, 2)  # a rank per task: by partition
    shared = rank_task._context_of(taskcontext, TASK, placements[3])  # partition 1's second rank
    assert (shared._sparkhvd_sync.partition, shared._sparkhvd_sync.tasks) == (3, 4)
    assert shared.partitionId() == 1


def test_on_the_driver_barriertaskcontext_get_says_what_to_call_instead(monkeypatch):
    taskcontext = pytest.importorskip("pyspark.taskcontext")
    monkeypatch.setattr(taskcontext.BarrierTaskContext, "get", taskcontext.BarrierTaskContext.__dict__["get"])
    monkeypatch.setattr(taskcontext.TaskContext, "_taskContext", None)
    rank_task._explain_no_stage(taskcontext, assign_ranks(["a", "a"])[1])
    with pytest.raises(taskcontext.PySparkRuntimeError) as info:
        taskcontext.BarrierTaskContext.get()
    assert info.value.getCondition() == "NOT_IN_BARRIER_STAGE"
    assert str(info.value) == (
        "[NOT_IN_BARRIER_STAGE] It is not in a barrier stage: rank 1 of this run runs on the driver (np=-2), not in a "
        "Spark task; call hvd.rank(), hvd.barrier() and hvd.allgather_object() instead, which work on the driver and "
        "in Spark alike, or run with np=2 to run each rank in a Spark barrier task.")


# ---- what the agent hands the rank --------------------------------------------------------------------------

def test_the_rank_sees_its_tasks_gpus_as_indices_into_its_own_cuda_visible_devices(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setenv("SPARKHVD_TASK_CONTEXT", "{}")  # a parent rank's: never this rank's
    one = assign_ranks(["a", "a"])[1].as_dict() | {"cuda_devices": [1]}
    task = SparkTask(**{**TASK.__dict__, "resources": {"gpu": ["6"], "fpga": ["f0"]}})
    spec = TaskSpec(address=("127.0.0.1", 1), secret=b"s", run_id="r")

    def seen(spec, host_gpus, task=task):
        env = rank_env(spec, one, host_gpus, task=task)
        return json.loads(env["SPARKHVD_TASK_CONTEXT"])["resources"] if "SPARKHVD_TASK_CONTEXT" in env else None

    assert seen(spec, ["5", "6"]) == {"gpu": ["1"], "fpga": ["f0"]}  # CUDA_VISIBLE_DEVICES=5,6: its own is 1
    assert seen(TaskSpec(address=("127.0.0.1", 1), secret=b"s", run_id="r", layout="node_per_task"),
                ["5", "6"]) == {"gpu": ["0"], "fpga": ["f0"]}  # it sees its own alone
    assert seen(TaskSpec(address=("127.0.0.1", 1), secret=b"s", run_id="r", use_gpu=False),
                []) == {"fpga": ["f0"]}  # use_gpu=False: it uses none
    assert seen(spec, [], task=None) is None  # on the driver (np<0): no task


def test_the_agent_reads_no_task_outside_one_and_keeps_only_sparks_properties_past_the_limit(monkeypatch):
    assert agent_task.read() is None  # this process runs no Spark task (pyspark imported or not)
    taskcontext = pytest.importorskip("pyspark.taskcontext")
    big = {"addresses": "h:1,h:2", "spark.jobGroup.id": "g", "mine": "x" * agent_task.MAX_PROPERTIES_CHARS}
    ctx = rank_task._context_of(taskcontext, SparkTask(**{**TASK.__dict__, "local_properties": big}),
                                assign_ranks(["a", "b"])[1])
    monkeypatch.setattr(taskcontext.TaskContext, "_taskContext", ctx)
    task = agent_task.read()
    assert task.local_properties == {"addresses": "h:1,h:2", "spark.jobGroup.id": "g"}
    assert (task.stage_id, task.partition_id, task.task_attempt_id, task.cpu_amount, task.barrier) == (
        4, 1, 9, "1.5", True)
    assert SparkTask.from_json(task.to_json()) == task
