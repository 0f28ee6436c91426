"""HorovodRunner with np>0: a real Spark barrier stage on a real local[2] session."""

from __future__ import annotations

import os
import time

import pytest

from sparkhvd import HorovodRunError, HorovodRunner
from sparkhvd.runner import StartTimeoutError
from sparkhvd.runner._runner_config import RunnerConfig

OFFSET = 100  # a module global the training function closes over


def _whoami(scale=1):
    from pyspark import TaskContext  # a rank sees its Spark task's context (runner/_rank/task_context.py)

    from sparkhvd._common import context as _context

    p = _context.current().placement
    print(f"rank {p.rank} reporting")
    return {"value": p.rank * scale + OFFSET, "pid": os.getpid(), "ppid": os.getppid(),
            "local_rank": p.local_rank, "cross_size": p.cross_size, "task_context": TaskContext.get() is not None,
            "cuda": os.environ.get("CUDA_VISIBLE_DEVICES")}


def test_np_two_runs_a_barrier_stage_with_kwargs_and_closure(spark, capsys):
    result = HorovodRunner(np=2).run_all(_whoami, scale=7)
    assert [v["value"] for v in result.values] == [100, 107]
    assert [v["local_rank"] for v in result.values] == [0, 1]
    assert [v["cross_size"] for v in result.values] == [1, 1]
    assert all(v["task_context"] for v in result.values)
    assert result.gpus == [[], []] and all(v["cuda"] is None for v in result.values)
    out = capsys.readouterr().out
    assert "[0] rank 0 reporting" in out and "[1] rank 1 reporting" in out
    assert "a Spark barrier stage on local[2]" in out


def test_rank_processes_are_fresh_when_spark_reuses_python_workers(spark):
    first = HorovodRunner(np=2).run_all(_whoami).values
    second = HorovodRunner(np=2).run_all(_whoami).values
    assert {v["pid"] for v in first}.isdisjoint({v["pid"] for v in second})


def test_np_above_the_slots_fails_in_seconds_with_both_numbers(spark):
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=r"np=3 needs 3 task slots but the cluster has 2 \(local\[2\]\); "
                                           r"use np<=2, add executors or cores, or use np=-3"):
        HorovodRunner(np=3).run(_whoami)
    assert time.monotonic() - started < 30


@pytest.mark.timeout(120)
def test_failure_while_peer_blocks_in_allreduce_then_the_context_is_reusable(spark, rank_processes):
    def train():
        import torch

        import sparkhvd.collective.torch as hvd

        hvd.init()
        if hvd.rank() == 0:
            raise ZeroDivisionError("rank 0 divided by zero")
        hvd.allreduce(torch.ones(3))
        return "unreachable"

    with pytest.raises(HorovodRunError, match="rank 0: ZeroDivisionError: rank 0 divided by zero") as info:
        HorovodRunner(np=2).run(train)
    assert 'raise ZeroDivisionError("rank 0 divided by zero")' in str(info.value)
    assert rank_processes() == []
    assert spark.sparkContext.statusTracker().getActiveJobsIds() == []
    assert [v["value"] for v in HorovodRunner(np=2).run_all(_whoami).values] == [100, 101]


@pytest.mark.timeout(120)
def test_a_task_that_never_registers_fails_at_start_timeout(spark):
    runner = HorovodRunner._from_config(RunnerConfig(np=2, start_timeout=2, stall_tasks=frozenset({0})))
    with pytest.raises(StartTimeoutError, match=r"1 of 2 ranks \(task 0\) did not register with the driver on "
                                                r"a Spark barrier stage on local\[2\] within 2 s; raise start_timeout"):
        runner.run(_whoami)
    assert [v["value"] for v in HorovodRunner(np=2).run_all(_whoami).values] == [100, 101]


def test_dynamic_allocation_is_refused_with_the_fix(spark):
    from pyspark import SparkConf

    from sparkhvd.runner._backends.spark import check_barrier_conf

    check_barrier_conf(spark.sparkContext.getConf())  # the test session is fine
    with pytest.raises(RuntimeError, match="does not work with dynamic allocation; set "
                                           "spark.dynamicAllocation.enabled=false"):
        check_barrier_conf(SparkConf(loadDefaults=False).set("spark.dynamicAllocation.enabled", "true"))
