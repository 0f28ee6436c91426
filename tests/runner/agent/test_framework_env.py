"""Each rank's torchrun variables and TF_CONFIG (runner/_shared/framework_env.py), for any layout of tasks on hosts."""

from __future__ import annotations

import json
import socket

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sparkhvd.runner import assign_ranks
from sparkhvd.runner._agent.env import rank_env
from sparkhvd.runner._agent.spec import TaskSpec
from sparkhvd.runner._shared.framework_env import (
    NODE_PER_TASK,
    TORCHRUN,
    Endpoint,
    framework_env,
    node_of,
    reserve_ports,
)

pytestmark = pytest.mark.unit

hosts_lists = st.lists(st.sampled_from(["a", "b", "c"]), min_size=1, max_size=12)


def _endpoints(n):
    return [Endpoint(f"10.0.0.{r}", 20000 + r, 30000 + r) for r in range(n)]


def _envs(hosts, layout):
    placements = assign_ranks(hosts)
    ends = _endpoints(len(hosts))
    return [(p, framework_env(p.as_dict(), layout=layout, endpoints=ends, node=node_of(placements, t), run_id="r1",
                              attempt=2, max_restarts=3)) for t, p in enumerate(placements)]


@settings(max_examples=100, deadline=None)
@given(hosts_lists)
def test_torchrun_layout_is_what_torchrun_sets_with_one_node_per_host(hosts):
    envs = _envs(hosts, TORCHRUN)
    host_order = list(dict.fromkeys(h for (p, _), h in sorted(zip(envs, hosts), key=lambda x: x[0][0].rank)))
    for (p, env), host in zip(envs, hosts):
        assert (env["RANK"], env["WORLD_SIZE"]) == (str(p.rank), str(len(hosts)))
        assert (env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"]) == (str(p.local_rank), str(hosts.count(host)))
        assert env["GROUP_RANK"] == env["NODE_RANK"] == str(host_order.index(host))
        assert env["GROUP_WORLD_SIZE"] == str(len(set(hosts)))
        assert (env["ROLE_RANK"], env["ROLE_WORLD_SIZE"], env["ROLE_NAME"]) == (str(p.rank), str(len(hosts)), "default")
        assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("10.0.0.0", "20000")  # rank 0's store
        assert env["TORCHELASTIC_USE_AGENT_STORE"] == "False"  # rank 0's init_process_group starts the store
        assert (env["TORCHELASTIC_RUN_ID"], env["TORCHELASTIC_RESTART_COUNT"], env["TORCHELASTIC_MAX_RESTARTS"]) == \
            ("r1", "2", "3")
        tf = json.loads(env["TF_CONFIG"])
        assert tf == {"cluster": {"worker": [f"10.0.0.{r}:{30000 + r}" for r in range(len(hosts))]},
                      "task": {"type": "worker", "index": p.rank}}


@settings(max_examples=50, deadline=None)
@given(hosts_lists)
def test_node_per_task_layout_makes_every_rank_a_node_as_pysparks_torchdistributor(hosts):
    for p, env in _envs(hosts, NODE_PER_TASK):
        assert (env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"]) == ("0", "1")
        assert env["GROUP_RANK"] == env["NODE_RANK"] == env["RANK"] == str(p.rank)
        assert env["GROUP_WORLD_SIZE"] == env["WORLD_SIZE"] == str(len(hosts))


@settings(max_examples=50, deadline=None)
@given(st.lists(st.sampled_from(["a", "b", "c"]), min_size=1, max_size=6), st.sampled_from([2, 4]))
def test_node_per_task_with_k_gpus_per_task_makes_each_task_a_node_of_k_as_pysparks_torchrun(task_hosts, k):
    """pyspark 4.3 runs ``torchrun --nnodes=<np/k> --nproc_per_node=k`` in each task holding k GPUs: the k ranks of
    one Spark task (agents ``partition * k + j``, on one host) are a node, LOCAL_RANK j."""
    hosts = [h for h in task_hosts for _ in range(k)]  # agent t runs in Spark task t // k
    placements = assign_ranks(hosts)
    ends = _endpoints(len(hosts))
    envs = [framework_env(p.as_dict(), layout=NODE_PER_TASK, endpoints=ends, node=node_of(placements, t),
                          run_id="r", attempt=0, max_restarts=0, per_task=k) for t, p in enumerate(placements)]
    for t, env in enumerate(envs):
        assert (env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"]) == (str(t % k), str(k))
        assert int(env["RANK"]) == int(env["NODE_RANK"]) * k + t % k  # torchrun's RANK from its node and local rank
        assert env["GROUP_WORLD_SIZE"] == str(len(task_hosts))
    nodes = {}
    for t, env in enumerate(envs):
        nodes.setdefault(env["NODE_RANK"], set()).add(t // k)
    assert all(len(tasks) == 1 for tasks in nodes.values())  # a node is one Spark task


def test_node_per_task_with_k_gpus_per_task_shows_each_rank_its_tasks_gpus():
    placements = assign_ranks(["a"] * 4)  # two Spark tasks on host a, two GPUs each: agents 0,1 and 2,3
    spec = TaskSpec(address=("127.0.0.1", 1), secret=b"s", run_id="r", layout=NODE_PER_TASK, per_task=2)
    host = ["4", "5", "6", "7"]  # the job's GPUs on the host, in local-rank order (each agent registered one)
    for t, p in enumerate(placements):
        env = rank_env(spec, p.as_dict() | {"cuda_devices": [p.local_rank]}, host, endpoints=_endpoints(4),
                       node=(0, 1))
        assert env["CUDA_VISIBLE_DEVICES"] == ",".join(host[t // 2 * 2:t // 2 * 2 + 2])
        assert env["LOCAL_RANK"] == str(t % 2) and env["NODE_RANK"] == str(t // 2)
        assert json.loads(env["SPARKHVD_PLACEMENT"])["cuda_devices"] == [t % 2]  # LOCAL_RANK indexes the list


def test_a_rank_without_an_endpoint_costs_tf_config_rank_zeros_costs_master_and_a_bad_layout_is_refused():
    p = assign_ranks(["a", "a"])[0].as_dict()
    one, two = _endpoints(2)
    env = framework_env(p, layout=TORCHRUN, endpoints=[one, None], node=(0, 1), run_id="r", attempt=0,
                        max_restarts=0)
    assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("10.0.0.0", "20000") and "TF_CONFIG" not in env
    env = framework_env(p, layout=TORCHRUN, endpoints=[None, two], node=(0, 1), run_id="r", attempt=0,
                        max_restarts=0)
    assert "MASTER_ADDR" not in env and "MASTER_PORT" not in env and "TF_CONFIG" not in env
    assert env["RANK"] == "0"
    six = [Endpoint("fd00::1", 1, 2), Endpoint("fd00::2", 3, 4)]
    env = framework_env(p, layout=TORCHRUN, endpoints=six, node=(0, 1), run_id="r", attempt=0, max_restarts=0)
    assert json.loads(env["TF_CONFIG"])["cluster"]["worker"] == ["[fd00::1]:2", "[fd00::2]:4"]
    with pytest.raises(ValueError, match=r"^layout='mpi' is not one of 'torchrun', 'node_per_task'\.$"):
        framework_env(p, layout="mpi", endpoints=[], node=(0, 1), run_id="r", attempt=0, max_restarts=0)


def test_reserved_ports_are_held_apart_until_registration_is_over_and_free_after():
    reserved = [reserve_ports("127.0.0.1") for _ in range(8)]  # eight tasks on one host register together
    ports = [p for e, _ in reserved for p in (e.torch_port, e.tf_port)]
    assert len(set(ports)) == 16  # none given twice while they are held
    for _, held in reserved:
        for sock in held:
            sock.close()
    e = reserved[0][0]
    assert e.address == "127.0.0.1"
    for port in (e.torch_port, e.tf_port):  # nothing listens: the rank can bind them
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
    assert Endpoint.parse([e.address, e.torch_port, e.tf_port]) == e
    assert Endpoint.parse(["h", 0, 1]) is None and Endpoint.parse("h:1") is None and Endpoint.parse(None) is None


def test_rank_env_replaces_another_jobs_variables_and_pins_own_gpus_per_node(monkeypatch):
    monkeypatch.setenv("MASTER_PORT", "1")  # an executor's leftovers from another job
    monkeypatch.setenv("TF_CONFIG", "{}")
    monkeypatch.setenv("NODE_RANK", "7")
    placements = assign_ranks(["a", "a"])
    ends = _endpoints(2)
    spec = TaskSpec(address=("127.0.0.1", 1), secret=b"s", run_id="r")
    one = placements[1].as_dict() | {"cuda_devices": [1]}
    env = rank_env(spec, one, ["5", "6"], endpoints=ends, node=(0, 1))
    assert env["MASTER_PORT"] == "20000" and env["NODE_RANK"] == "0" and env["LOCAL_RANK"] == "1"
    assert json.loads(env["TF_CONFIG"])["task"]["index"] == 1
    assert env["CUDA_VISIBLE_DEVICES"] == "5,6"  # torchrun layout: the host's list, LOCAL_RANK indexes it
    assert json.loads(env["SPARKHVD_PLACEMENT"])["cuda_devices"] == [1]
    per_node = TaskSpec(address=("127.0.0.1", 1), secret=b"s", run_id="r", layout=NODE_PER_TASK)
    env = rank_env(per_node, one, ["5", "6"], endpoints=ends, node=(0, 1))
    assert env["CUDA_VISIBLE_DEVICES"] == "6" and env["LOCAL_RANK"] == "0" and env["NODE_RANK"] == "1"
    assert json.loads(env["SPARKHVD_PLACEMENT"])["cuda_devices"] == [0]  # hvd.init() selects it too


def test_node_per_task_on_a_host_spark_gave_no_gpu_addresses_pins_the_ith_rank_to_the_ith_gpu(monkeypatch):
    """A local master: pyspark's TorchDistributor pins task i to the driver's GPU i."""
    placements = assign_ranks(["a", "a", "a"])
    spec = TaskSpec(address=("127.0.0.1", 1), secret=b"s", run_id="r", layout=NODE_PER_TASK)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    env = rank_env(spec, placements[2].as_dict(), [], endpoints=_endpoints(3), node=(0, 1))
    assert env["CUDA_VISIBLE_DEVICES"] == "2" and json.loads(env["SPARKHVD_PLACEMENT"])["cuda_devices"] == [0]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6")
    env = rank_env(spec, placements[1].as_dict(), [], endpoints=_endpoints(3), node=(0, 1))
    assert env["CUDA_VISIBLE_DEVICES"] == "5"
    no_gpu = TaskSpec(address=("127.0.0.1", 1), secret=b"s", run_id="r", layout=NODE_PER_TASK, use_gpu=False,
                      env=(("CUDA_VISIBLE_DEVICES", ""),))
    assert rank_env(no_gpu, placements[1].as_dict(), [], endpoints=_endpoints(3), node=(0, 1))[
        "CUDA_VISIBLE_DEVICES"] == ""  # use_gpu=False: none, as pyspark's


def test_the_runner_refuses_an_unknown_layout():
    from sparkhvd.runner._runner_config import RunnerConfig

    with pytest.raises(ValueError, match=r"^layout='mpi' is not one of 'torchrun', 'node_per_task'\.$"):
        RunnerConfig(np=2, layout="mpi")
