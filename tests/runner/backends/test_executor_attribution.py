"""Which executor loss an attempt's failure names, and which decommission notice is the attempt's: the executors its
own tasks ran on, by id, never by host.

``SparkLauncher.lost`` reads Spark's status store through ``SparkStatus``; a fake store stands in for it
here (the real one is exercised by tests/cluster: a killed executor, and an executor replaced before a
later fault).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from sparkhvd.runner._backends.spark import SparkLauncher
from sparkhvd.runner._service.tasks import Registration, _spark_task

pytestmark = pytest.mark.unit

STAGE = 7


class FakeStatus:
    """Spark's status store as ``SparkStatus`` reads it: removed executors, and the executor of each task."""

    def __init__(self, tasks: dict, removed=(), decommissioning=None):
        self.tasks = tasks  # task id -> executor id
        self.removed = list(removed)  # (executor id, host, reason)
        self.decommissioning = dict(decommissioning or {})  # executor id -> "" or ", with its worker on <host>"
        self.asked: list[set] = []

    def decommissioned(self, executor_ids: set) -> dict:
        return {e: self.decommissioning[e] for e in executor_ids if e in self.decommissioning}

    def removed_executors(self) -> list:
        return list(self.removed)

    def task_executors(self, tasks: set) -> dict:
        self.asked.append(set(tasks))
        return {(stage, task): self.tasks[task] for stage, task in tasks if stage == STAGE and task in self.tasks}


def launcher(status: FakeStatus, replaced=()) -> SparkLauncher:
    return SparkLauncher(SimpleNamespace(master="spark://m:7077"), 4, replaced=set(replaced), status=status)


def ranks(*rows) -> list:
    """``(rank, Registration)`` rows from ``(rank, spark task id, hostname, address)``."""
    return [(rank, Registration(task=rank, host=host, pid=100 + rank, gpus=[], peer=address,
                                spark_task=(STAGE, task) if task is not None else None))
            for rank, task, host, address in rows]


# ranks 0,1 on host a (tasks 10, 11 on executor 4), ranks 2,3 on host d (tasks 12, 13 on executor 1)
FOUR = ranks((0, 10, "a", "10.0.0.1"), (1, 11, "a", "10.0.0.1"), (2, 12, "d", "10.0.0.4"), (3, 13, "d", "10.0.0.4"))


def test_an_executor_this_attempt_ran_on_is_named_with_its_ranks():
    status = FakeStatus({10: "4", 11: "4", 12: "1", 13: "1"}, [("1", "10.0.0.4", "Command exited with code 137")])
    assert launcher(status).lost(FOUR) == ("ranks 2,3 ran on executor 1 on host d (10.0.0.4), which Spark lost: "
                                           "Command exited with code 137")


def test_a_removal_that_lands_after_the_start_of_an_executor_the_attempt_did_not_use_is_ignored():
    # executor 3 was on host a before this attempt; its removal reaches the store only now
    status = FakeStatus({10: "4", 11: "4", 12: "1", 13: "1"}, [("3", "10.0.0.1", "Remote RPC client disassociated")])
    assert launcher(status).lost(FOUR) is None
    status.removed.append(("1", "10.0.0.4", "Command exited with code 137"))
    assert launcher(status).lost(FOUR) == ("ranks 2,3 ran on executor 1 on host d (10.0.0.4), which Spark lost: "
                                           "Command exited with code 137")


def test_an_executor_the_run_asked_spark_to_replace_is_never_a_later_attempts_cause():
    # the case: executor 4 on host a was replaced after a freeze; the attempt's ranks 0,1 ran on its
    # replacement, executor 5, and a later fault killed executor 1 on host d
    status = FakeStatus({10: "5", 11: "5", 12: "1", 13: "1"},
                        [("4", "10.0.0.1", "Remote RPC client disassociated"), ("1", "10.0.0.4", "Command exited with code 137")])
    assert launcher(status, replaced={"4"}).lost(FOUR) == ("ranks 2,3 ran on executor 1 on host d (10.0.0.4), which "
                                                           "Spark lost: Command exited with code 137")
    # even where the store still says a task ran there, a replaced executor is the run's own doing
    status = FakeStatus({10: "4", 11: "4", 12: "1", 13: "1"}, [("4", "10.0.0.1", "Remote RPC client disassociated")])
    assert launcher(status, replaced={"4"}).lost(FOUR) is None


def test_of_two_executors_on_one_host_only_the_one_that_died_is_named():
    status = FakeStatus({10: "2", 11: "6", 12: "1", 13: "1"}, [("6", "10.0.0.1", "Command exited with code 137")])
    assert launcher(status).lost(FOUR) == ("rank 1 ran on executor 6 on host a (10.0.0.1), which Spark lost: "
                                           "Command exited with code 137")


def test_spark_naming_hosts_by_hostname_changes_nothing():
    # YARN and Kubernetes name an executor's host by hostname; the match is by executor id all the same
    status = FakeStatus({10: "4", 11: "4", 12: "1", 13: "1"},
                        [("1", "node-d.cluster.local", "Container killed by YARN for exceeding memory limits")])
    assert launcher(status).lost(FOUR) == ("ranks 2,3 ran on executor 1 on host d (10.0.0.4), which Spark lost: "
                                           "Container killed by YARN for exceeding memory limits")


def test_ranks_without_a_spark_task_or_unknown_to_the_store_are_not_attributed():
    status = FakeStatus({12: "1"}, [("1", "10.0.0.4", "Command exited with code 137")])
    rows = ranks((0, None, "a", "10.0.0.1"), (2, 12, "d", "10.0.0.4"), (3, 13, "d", "10.0.0.4"))
    assert launcher(status).lost(rows) == ("rank 2 ran on executor 1 on host d (10.0.0.4), which Spark lost: "
                                           "Command exited with code 137")


def test_the_ranks_of_a_lost_executor_are_the_ones_a_stop_does_not_wait_for():
    # ranks 2,3 ran on executor 1, which Spark removed; executor 3 (replaced by the run) is no loss
    status = FakeStatus({10: "4", 11: "4", 12: "1", 13: "1"},
                        [("1", "10.0.0.4", "Command exited with code 137"), ("4", "10.0.0.1", "replaced")])
    assert launcher(status, replaced={"4"}).lost_ranks(FOUR) == {2, 3}
    assert launcher(FakeStatus({10: "4", 11: "4", 12: "1", 13: "1"})).lost_ranks(FOUR) == set()

    class Broken(FakeStatus):
        def removed_executors(self):
            raise RuntimeError("py4j: the SparkContext was stopped")

    assert launcher(Broken({})).lost_ranks(FOUR) == set()


def test_each_task_is_looked_up_once_and_a_failing_store_says_nothing():
    status = FakeStatus({10: "4", 11: "4", 12: "1", 13: "1"}, [("9", "10.0.0.9", "gone")])
    spark = launcher(status)
    assert spark.lost(FOUR) is None and spark.lost(FOUR) is None
    assert status.asked == [{(STAGE, 10), (STAGE, 11), (STAGE, 12), (STAGE, 13)}]

    class Broken(FakeStatus):
        def removed_executors(self):
            raise RuntimeError("py4j: the SparkContext was stopped")

    assert launcher(Broken({})).lost(FOUR) is None


def test_an_executor_spark_decommissions_is_named_with_its_ranks_and_host():
    status = FakeStatus({10: "4", 11: "4", 12: "1", 13: "1"}, decommissioning={"1": ""})
    assert launcher(status).preempted(FOUR) == ("executor 1 on host d (10.0.0.4), which runs ranks 2,3, is being "
                                                "decommissioned by Spark")
    status.decommissioning = {"4": ", with its worker on 10.0.0.1", "1": "", "9": ""}  # 9: not this attempt's
    assert launcher(status).preempted(FOUR) == (
        "executor 4 on host a (10.0.0.1), which runs ranks 0,1, is being decommissioned by Spark, with its worker on "
        "10.0.0.1; executor 1 on host d (10.0.0.4), which runs ranks 2,3, is being decommissioned by Spark")


def test_no_decommission_or_no_api_is_no_notice():
    assert launcher(FakeStatus({10: "4", 11: "4", 12: "1", 13: "1"}, decommissioning={"7": ""})).preempted(FOUR) is None

    class Old(FakeStatus):  # a Spark without the scheduler's decommission state
        def decommissioned(self, executor_ids):
            raise AttributeError("getExecutorDecommissionState")

    assert launcher(Old({10: "4"})).preempted(FOUR) is None


@pytest.mark.parametrize("value, expected", [([3, 41], (3, 41)), ((3, 41), (3, 41)), (None, None), ([3], None),
                                             (["3", 41], None), ([True, 41], None), ("3:41", None)])
def test_a_register_frames_spark_task_is_two_ints_or_nothing(value, expected):
    assert _spark_task(value) == expected
