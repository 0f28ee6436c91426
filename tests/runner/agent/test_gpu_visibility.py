"""What GPUs a rank sees: this job's GPUs on its host, in local-rank order (_common/topology.py: host_gpus).

Pure logic in milliseconds, then the driver service's answer and two real rank processes started by the
task agent (no Spark: run_task is given the GPU addresses Spark would give). The Spark paths run in
tests/runner/backends/test_gpu_pinning.py (local-cluster) and tests/cluster (two hosts, an executor with its own
CUDA_VISIBLE_DEVICES).
"""

from __future__ import annotations

import json
import os
import sys
import threading

import pytest

from sparkhvd._common.topology import Placement, assign_ranks, host_gpus
from sparkhvd.runner._agent.agent import visible_gpus


def _pinned(hosts, devices):
    return host_gpus(assign_ranks(hosts), hosts, devices)


@pytest.mark.unit
def test_each_rank_sees_its_hosts_gpus_in_local_rank_order():
    # Spark's tasks come in any order over the hosts; a host's GPUs in any order over its tasks.
    hosts = ["a", "b", "a", "b", "a"]
    placements, lists = _pinned(hosts, [["3"], ["0"], ["1"], ["1"], ["0"]])
    assert [(p.rank, p.local_rank) for p in placements] == [(0, 0), (3, 0), (1, 1), (4, 1), (2, 2)]
    assert lists == [["3", "1", "0"], ["0", "1"], ["3", "1", "0"], ["0", "1"], ["3", "1", "0"]]
    for p, visible, own in zip(placements, lists, [["3"], ["0"], ["1"], ["1"], ["0"]]):
        assert p.cuda_devices == (p.local_rank,)  # torch.cuda.set_device(hvd.local_rank()) is its own GPU
        assert visible[p.local_rank] == own[0]


@pytest.mark.unit
def test_a_task_with_several_gpus_keeps_them_together_and_its_first_is_its_device():
    hosts = ["a", "a", "b", "b"]
    placements, lists = _pinned(hosts, [["2", "3"], ["0", "1"], ["5", "4"], ["7", "6"]])
    assert lists == [["2", "3", "0", "1"]] * 2 + [["5", "4", "7", "6"]] * 2
    assert [p.cuda_devices for p in placements] == [(0, 1), (2, 3), (0, 1), (2, 3)]  # local_rank*2, local_rank*2+1


@pytest.mark.unit
def test_executors_on_one_host_with_their_own_cuda_visible_devices_agree_on_the_list():
    # Two executors on host "a", each with its own CUDA_VISIBLE_DEVICES, Spark's address indexing it: each
    # task maps its own before it registers, so both ranks get the same list of the host's devices.
    devices = [visible_gpus(["1"], "6,7"), visible_gpus(["0"], "2,3"), visible_gpus(["0"], None)]
    placements, lists = _pinned(["a", "a", "b"], devices)
    assert lists == [["7", "2"], ["7", "2"], ["0"]]
    assert [p.cuda_devices for p in placements] == [(0,), (1,), (0,)]


@pytest.mark.unit
def test_tasks_without_gpus_keep_the_executors_environment():
    placements, lists = _pinned(["a", "a"], [[], []])
    assert lists == [[], []] and [p.cuda_devices for p in placements] == [(), ()]
    assert placements == assign_ranks(["a", "a"])


@pytest.mark.unit
def test_the_placement_crosses_json_typed():
    placements, _ = _pinned(["a", "a"], [["0"], ["1"]])
    back = Placement(**json.loads(json.dumps(placements[1].as_dict())))  # as the rank process reads it
    assert back == placements[1] and back.cuda_devices == (1,)


@pytest.mark.unit
def test_a_gpu_spark_shares_between_two_ranks_is_each_ranks_own_alone():
    placements, lists = _pinned(["a", "a", "b"], [["0"], ["0"], ["0"]])
    assert lists == [["0"], ["0"], ["0"]] and [p.cuda_devices for p in placements] == [(0,), (0,), (0,)]


class _Config:
    """Stands in for ``tf.config`` (this machine has no GPU for TensorFlow to list)."""

    def __init__(self, physical, visible=None, initialized=False):
        self.physical, self.visible, self.initialized = list(physical), list(visible or physical), initialized

    def list_physical_devices(self, kind):
        return list(self.physical)

    def get_visible_devices(self, kind):
        return list(self.visible)

    def set_visible_devices(self, devices, kind):
        devices = devices if isinstance(devices, list) else [devices]
        if devices != self.visible and self.initialized:
            raise RuntimeError("Visible devices cannot be modified after being initialized")
        self.visible = devices


def test_tensorflow_init_shows_only_the_ranks_own_gpus():
    pytest.importorskip("tensorflow")
    from sparkhvd.collective.tensorflow._devices import show_own_gpus

    gpus = ["GPU:0", "GPU:1", "GPU:2", "GPU:3"]
    config = _Config(gpus)
    assert show_own_gpus(config, Placement(1, 4, 1, 4, 0, 1, cuda_devices=(1,))) and config.visible == ["GPU:1"]
    config.set_visible_devices(config.physical[1], "GPU")  # Horovod's idiom after init() still works
    config = _Config(gpus)
    assert show_own_gpus(config, Placement(1, 2, 1, 2, 0, 1, cuda_devices=(2, 3))) and config.visible == gpus[2:]
    config = _Config(gpus)  # np<0: the runner pinned nothing; as torch, the local_rank-th modulo their number
    assert show_own_gpus(config, Placement(5, 6, 5, 6, 0, 1)) and config.visible == ["GPU:1"]
    config = _Config(gpus, visible=["GPU:3"])  # the script chose before init(): left as it is
    assert not show_own_gpus(config, Placement(0, 4, 0, 4, 0, 1, cuda_devices=(0,))) and config.visible == ["GPU:3"]
    config = _Config(gpus, initialized=True)  # TensorFlow already uses them all
    assert not show_own_gpus(config, Placement(0, 4, 0, 4, 0, 1, cuda_devices=(0,))) and config.visible == gpus
    config = _Config(["GPU:0"])
    assert not show_own_gpus(config, Placement(0, 1, 0, 1, 0, 1, cuda_devices=(0,)))
    assert not show_own_gpus(_Config([]), Placement(0, 1, 0, 1, 0, 1))


# ---- the driver service and the task agent, with two real rank processes --------------------------------------


def _view():
    from sparkhvd._common import context as _context

    return {"cuda": os.environ.get("CUDA_VISIBLE_DEVICES"), "placement": _context.current().placement}


def _run_two_tasks(monkeypatch, gpus, executor_visible):
    from sparkhvd._common.protocol import new_secret
    from sparkhvd._common.settings import WARM
    from sparkhvd.runner._agent.agent import TaskSpec, run_task
    from sparkhvd.runner._payload import payload as _payload
    from sparkhvd.runner._service.service import DriverService

    monkeypatch.setenv(WARM.name, "0")  # fresh rank processes: nothing left behind
    if executor_visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", executor_visible)
    import cloudpickle

    secret = new_secret()
    module = sys.modules[__name__]
    cloudpickle.register_pickle_by_value(module)  # the rank processes cannot import this test file
    try:
        payload = _payload.dumps((_view, {}))
    finally:
        cloudpickle.unregister_pickle_by_value(module)
    service = DriverService(np=len(gpus), secret=secret, payload=payload)
    spec = TaskSpec(address=service.address, secret=secret, run_id="gpu-visibility")
    rows = {}
    threads = [threading.Thread(target=lambda t=t: rows.update({t: run_task(spec, t, host="hostA", gpus=gpus[t])}))
               for t in range(len(gpus))]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        return service, rows, {r: cloudpickle.loads(blob) for r, blob in service.results.items()}
    finally:
        service.close()


@pytest.mark.timeout(120)
def test_the_agent_sets_each_ranks_list_and_the_rank_reads_its_placement(monkeypatch):
    service, rows, values = _run_two_tasks(monkeypatch, [["1"], ["0"]], "6,7")
    assert [rows[t]["exit"] for t in (0, 1)] == [0, 0], rows
    # Task 0 (rank 0) has Spark's address 1, the executor's device 7; task 1 has address 0, device 6.
    assert [service.registrations[t].devices for t in (0, 1)] == [["7"], ["6"]]
    assert [service.registrations[t].gpus for t in (0, 1)] == [["1"], ["0"]]  # RunResult.gpus: Spark's addresses
    assert [values[r]["cuda"] for r in (0, 1)] == ["7,6", "7,6"]
    assert [values[r]["placement"].cuda_devices for r in (0, 1)] == [(0,), (1,)]
    assert [values[r]["placement"].local_rank for r in (0, 1)] == [0, 1]


@pytest.mark.timeout(120)
def test_two_ranks_given_one_gpu_each_see_it_alone(monkeypatch):
    service, rows, values = _run_two_tasks(monkeypatch, [["0"], ["0"]], None)
    assert [rows[t]["exit"] for t in (0, 1)] == [0, 0], rows
    assert [values[r]["cuda"] for r in (0, 1)] == ["0", "0"]
    assert [values[r]["placement"].cuda_devices for r in (0, 1)] == [(0,), (0,)]


@pytest.mark.timeout(120)
def test_an_address_the_executors_list_cannot_index_fails_that_rank_only(monkeypatch):
    service, rows, values = _run_two_tasks(monkeypatch, [["3"], ["0"]], "4,5")
    assert [rows[t]["exit"] for t in (0, 1)] == [1, 0], rows
    (failure,) = service.failures
    assert (failure.rank, failure.type) == (0, "ValueError")
    assert failure.message.startswith("Spark gave this task GPU address 3, but the executor's "
                                      "CUDA_VISIBLE_DEVICES='4,5' lists only 2 devices")
    assert values[1]["cuda"] == "4" and values[1]["placement"].cuda_devices == (0,)  # its host's only listed GPU
