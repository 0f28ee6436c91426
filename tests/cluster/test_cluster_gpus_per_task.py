"""Several GPUs per Spark task: spark.task.resource.gpu.amount=2 on hosts of 2 (fake) GPUs, np=4.

Each host's executor then runs one barrier task holding both of its GPUs, and that task runs 2 ranks, one on
each GPU (pyspark 4.3's TorchDistributor runs k processes in such a task). The ranks' places, visible devices and
a training job's weights are those of the one-GPU-per-task layout the other cluster tests check. The test starts
a driver with that setting (a new Spark application) and gives the other tests theirs back after it.
"""

from __future__ import annotations

import json

import pytest

from .test_cluster_correctness import (
    NP,
    _assert_ok,
    _assert_single_process_weights,
    _check_gpu_lists,
    _print_seconds,
    _shards,
)

pytestmark = [pytest.mark.slow, pytest.mark.cluster]


@pytest.fixture
def two_gpus_per_task(cluster):
    """The cluster's driver with spark.task.resource.gpu.amount=2; the usual one again afterwards."""
    from .conftest import FAULT_SETTINGS

    cluster.restart_driver(conf={"spark.task.resource.gpu.amount": "2"}, executor_env=FAULT_SETTINGS,
                           slots=len(cluster.hosts))  # a task of 2 GPUs on each host
    try:
        yield cluster
    finally:
        cluster.restart_driver(executor_env=FAULT_SETTINGS)


def test_two_ranks_run_in_each_task_of_two_gpus_with_the_hosts_layout(two_gpus_per_task, no_leftover_ranks):
    cluster = two_gpus_per_task
    outcome = cluster.driver.run("whoami", NP)
    _print_seconds("whoami np=4, 2 GPUs per task", outcome)
    _assert_ok(outcome)
    values, hosts = outcome.values, outcome.hosts
    assert hosts[0] == hosts[1] != hosts[2] == hosts[3], hosts
    assert len({v["pid"] for v in values}) == NP  # a process per rank...
    assert [v["partition"] for v in values] == [0, 0, 1, 1]  # ...two in each of the stage's two tasks
    # TaskContext.get().resources() in a rank names its own GPU, as an index into its CUDA_VISIBLE_DEVICES
    assert [v["task_gpus"] for v in values] == [[str(v["own"][0])] for v in values], values
    expected = [{"rank": r, "size": NP, "local_rank": r % 2, "local_size": 2, "cross_rank": r // 2, "cross_size": 2}
                for r in range(NP)]
    assert [v["hvd"] for v in values] == expected
    assert all(len(g) == 1 for g in outcome.gpus)  # each rank one of its task's two GPUs...
    for first in (0, 2):
        assert sorted(outcome.gpus[first] + outcome.gpus[first + 1]) == ["0", "1"], outcome.gpus  # ...both of them
    _check_gpu_lists(cluster, outcome)  # each rank lists its host's, in local-rank order: as with one per task
    # np=3 cannot be made of tasks of 2: refused before anything starts, with the numbers
    refused = cluster.driver.run("whoami", 3)
    assert not refused.ok and refused.error == (
        "np=3 is not a multiple of spark.task.resource.gpu.amount=2: each Spark task holds 2 GPUs and runs one rank "
        "on each; use np=2 or np=4, or set spark.task.resource.gpu.amount=1 for one rank per task."), refused.error
    # BarrierTaskContext's barrier() and allGather() with two ranks in each task: every rank takes part, by rank
    gathered = cluster.driver.run("barrier_gather", NP)
    _assert_ok(gathered)
    assert gathered.values == [[str(r) for r in range(NP)]] * NP, gathered.values
    # training gives the weights of one process on all the data, as in the one-GPU-per-task layout
    shards = _shards()
    trained = cluster.driver.run("train", NP, shards=shards)
    _print_seconds("DistributedOptimizer np=4, 2 GPUs per task", trained)
    _assert_ok(trained)
    _assert_single_process_weights(trained, shards)
    # pyspark 4.3's TorchDistributor in such tasks: num_processes/k tasks, each a torchrun node of k processes
    # (LOCAL_RANK 0..k-1, indexing the task's GPUs), which the drop-in's processes see as it
    nodes = cluster.driver.run("torchrun_env", NP, runner="TorchDistributor")
    _print_seconds("TorchDistributor num_processes=4, 2 GPUs per task", nodes)
    _assert_ok(nodes)
    (everyone,) = nodes.values
    assert [(e["RANK"], e["LOCAL_RANK"], e["NODE_RANK"]) for e in everyone] == \
        [(str(r), str(r % 2), str(r // 2)) for r in range(NP)], everyone
    assert {(e["WORLD_SIZE"], e["LOCAL_WORLD_SIZE"], e["GROUP_WORLD_SIZE"]) for e in everyone} == {("4", "2", "2")}
    for first in (0, 2):  # a node's processes run on one host and see the same two GPUs: their task's
        pair = everyone[first:first + 2]
        assert pair[0]["hostname"] == pair[1]["hostname"] and pair[0]["CUDA_VISIBLE_DEVICES"] == \
            pair[1]["CUDA_VISIBLE_DEVICES"] and len(pair[0]["CUDA_VISIBLE_DEVICES"].split(",")) == 2, everyone
    # spark-tensorflow-distributor's MirroredStrategyRunner packs num_slots GPUs into ceil(num_slots / k) workers,
    # one per task, each with its task's GPUs
    workers = cluster.driver.run("torchrun_env", NP, runner="MirroredStrategyRunner")
    _print_seconds("MirroredStrategyRunner num_slots=4, 2 GPUs per task", workers)
    _assert_ok(workers)
    (everyone,) = workers.values
    assert [json.loads(e["TF_CONFIG"])["task"] for e in everyone] == [{"type": "worker", "index": i} for i in (0, 1)]
    assert everyone[0]["hostname"] != everyone[1]["hostname"], everyone  # one worker per host: its task
    assert [len(e["CUDA_VISIBLE_DEVICES"].split(",")) for e in everyone] == [2, 2], everyone
