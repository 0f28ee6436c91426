"""pyspark's BarrierTaskContext inside a rank, end to end: a real local[2] session, real rank processes, and
spark-tensorflow-distributor's own way of using it (its ``wrapped_train_fn``: getTaskInfos, partitionId, allGather,
barrier). Every value is checked against what Spark itself says of the run's barrier stage."""

from __future__ import annotations

import re

import pytest

from sparkhvd import HorovodRunError, HorovodRunner


def _train_fn():
    """spark-tensorflow-distributor's set_tf_config, then a barrier and an allGather of hvd.rank()."""
    import json
    import os
    import socket
    import sys
    from contextlib import closing

    imported_before = "pyspark" in sys.modules  # the rank imports no pyspark of its own
    from pyspark import BarrierTaskContext, TaskContext

    import sparkhvd.collective.torch as hvd

    context = BarrierTaskContext.get()
    addrs = [e.address.split(":")[0] for e in context.getTaskInfos()]
    my_addr = addrs[context.partitionId()]
    with closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as my_sock:
        my_sock.bind(("", 0))
        _, my_port = my_sock.getsockname()
        my_endpoint = "{}:{}".format(my_addr, my_port)
        worker_endpoints = context.allGather(my_endpoint)
    os.environ["TF_CONFIG"] = json.dumps({"cluster": {"worker": worker_endpoints},
                                          "task": {"type": "worker", "index": context.partitionId()}})
    context.barrier()
    hvd.init()
    return {"imported_before": imported_before, "same": TaskContext.get() is context,
            "partition": context.partitionId(), "stage": context.stageId(), "attempt": context.attemptNumber(),
            "task_attempt": context.taskAttemptId(), "cpus": context.cpus(),
            "resources": {k: v.addresses for k, v in context.resources().items()},
            "infos": [i.address for i in context.getTaskInfos()], "endpoint": my_endpoint,
            "tf_config": json.loads(os.environ["TF_CONFIG"]), "rank": hvd.rank(),
            "ranks": context.allGather(str(hvd.rank())), "group": context.getLocalProperty("spark.jobGroup.id")}


@pytest.mark.timeout(180)
def test_a_ranks_barrier_task_context_is_its_spark_tasks(spark):
    values = HorovodRunner(np=2).run_all(_train_fn).values
    by_partition = sorted(values, key=lambda v: v["partition"])
    assert [v["partition"] for v in by_partition] == [0, 1]
    assert all(v["same"] and not v["imported_before"] for v in values)
    assert all(v["group"].startswith("sparkhvd-") for v in values)  # the run's own job
    # Spark's own record of the stage: each task's partition, task attempt id and attempt number
    (stage,) = {v["stage"] for v in values}
    tasks, spark_tasks = spark.sparkContext._jsc.sc().statusStore().taskList(stage, 0, 100).iterator(), set()
    while tasks.hasNext():
        task = tasks.next()
        spark_tasks.add((task.index(), task.taskId(), task.attempt()))
    assert spark_tasks == {(v["partition"], v["task_attempt"], v["attempt"]) for v in values}
    # what a plain barrier stage's tasks see in the same session
    def _plain_barrier_task(_):  # defined here, so that it is pickled by value: executors cannot import this module
        from pyspark import BarrierTaskContext

        ctx = BarrierTaskContext.get()
        yield {"infos": [i.address for i in ctx.getTaskInfos()], "cpus": ctx.cpus(),
               "resources": {k: v.addresses for k, v in ctx.resources().items()}}

    (plain, _) = spark.sparkContext.parallelize(range(2), 2).barrier().mapPartitions(_plain_barrier_task).collect()
    assert all((v["infos"], v["cpus"], v["resources"]) == (plain["infos"], plain["cpus"], plain["resources"])
               for v in values)
    # spark-tensorflow-distributor's TF_CONFIG, and allGather's messages in partition order
    endpoints = [v["endpoint"] for v in by_partition]
    assert [v["tf_config"] for v in by_partition] == [
        {"cluster": {"worker": endpoints}, "task": {"type": "worker", "index": p}} for p in range(2)]
    assert all(v["ranks"] == [str(w["rank"]) for w in by_partition] for v in values)


def _mixed():
    from pyspark import BarrierTaskContext

    ctx = BarrierTaskContext.get()
    ctx.barrier()
    return ctx.barrier() if ctx.partitionId() == 0 else ctx.allGather("1")


@pytest.mark.timeout(180)
def test_barrier_in_one_rank_and_allgather_in_the_other_fail_the_run_with_sparks_sentence(spark):
    with pytest.raises(HorovodRunError) as info:
        HorovodRunner(np=2).run(_mixed)
    assert re.search(r"BarrierSyncError: Different barrier sync types found for sync 1 \(the 2nd barrier\(\) or "
                     r"allGather\(\) call\) of Stage \d+: partition 0 called barrier\(\) and partition 1 called "
                     r"allGather\(\)\. Please use the same barrier sync type within a single sync", str(info.value))


def _on_the_driver():
    from pyspark import BarrierTaskContext, TaskContext

    try:
        BarrierTaskContext.get()
    except RuntimeError as exc:
        return {"task_context": TaskContext.get(), "error": str(exc)}


@pytest.mark.timeout(120)
def test_on_the_driver_there_is_no_task_context_and_the_error_says_what_to_call():
    value = HorovodRunner(np=-1).run(_on_the_driver)
    assert value["task_context"] is None  # as on Spark's driver
    assert value["error"].startswith("[NOT_IN_BARRIER_STAGE] It is not in a barrier stage: rank 0 of this run runs on "
                                     "the driver (np=-1), not in a Spark task; call hvd.rank(), hvd.barrier() and "
                                     "hvd.allgather_object() instead")
