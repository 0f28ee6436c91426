"""np=4 on 2 namespace hosts with 2 (fake) GPU slots each: placement, pinning, collectives, training.

Real Spark standalone, real processes, real gloo over the hosts' veth links. Seconds are
printed, not asserted (run with -s to see them).
"""

from __future__ import annotations

import contextlib

import pytest
import torch

pytestmark = [pytest.mark.slow, pytest.mark.cluster]

NP = 4


def _print_seconds(what: str, outcome) -> None:
    print(f"\n[cluster] {what}: {outcome.seconds:.1f} s")


def _assert_ok(outcome):
    assert outcome.ok, f"the run failed: {outcome.error_type}: {outcome.error}\n{outcome.diagnosis()}"


def _device(cluster, host: str, address: str) -> str:
    """What Spark's GPU ``address`` on ``host`` is called in CUDA_VISIBLE_DEVICES: host B's executors have a list of
    their own, which Spark's addresses index; host A's name the GPUs themselves."""
    from .conftest import HOST_B_VISIBLE_DEVICES

    return HOST_B_VISIBLE_DEVICES.split(",")[int(address)] if host == cluster.hosts[1].hostname else address


def _check_gpu_lists(cluster, outcome) -> None:
    """Each rank lists this job's GPUs on its host, in local-rank order, and nothing else; its own is entry
    ``local_rank`` (Horovod's ``torch.cuda.set_device(hvd.local_rank())``)."""
    for r, value in enumerate(outcome.values):
        local_rank, host = value["hvd"]["local_rank"], outcome.hosts[r]
        peers = sorted((v["hvd"]["local_rank"], outcome.gpus[q]) for q, v in enumerate(outcome.values)
                       if outcome.hosts[q] == host)  # this job's ranks on the host and Spark's addresses for them
        assert value["cuda"].split(",") == [_device(cluster, host, g[0]) for _, g in peers], (r, value, outcome.gpus)
        assert value["own"] == [local_rank] and list(outcome.placements[r]["cuda_devices"]) == [local_rank]
        assert value["cuda"].split(",")[local_rank] == _device(cluster, host, outcome.gpus[r][0])


def test_ranks_are_grouped_by_host_and_see_their_hosts_gpus_in_local_rank_order(cluster, no_leftover_ranks):
    outcome = cluster.driver.run("whoami", NP)
    _print_seconds("whoami np=4", outcome)
    _assert_ok(outcome)
    values, hosts = outcome.values, outcome.hosts
    names = {h.hostname for h in cluster.hosts}
    # Ranks 0,1 on one host, 2,3 on the other: contiguous per host, as Horovod places them.
    assert hosts[0] == hosts[1] and hosts[2] == hosts[3] and hosts[0] != hosts[2], hosts
    assert set(hosts) == names
    assert [v["hostname"] for v in values] == hosts  # where the driver says each rank ran, it ran
    assert values[0]["netns"] == values[1]["netns"] != values[2]["netns"] == values[3]["netns"]
    expected = [{"rank": r, "size": NP, "local_rank": r % 2, "local_size": 2, "cross_rank": r // 2, "cross_size": 2}
                for r in range(NP)]
    assert [v["hvd"] for v in values] == expected
    assert [{k: p[k] for k in expected[0]} for p in outcome.placements] == expected
    # Spark gives each task one GPU, the two tasks on a host different ones; each rank lists both, in local-rank
    # order, so entry local_rank is its own.
    assert all(len(g) == 1 for g in outcome.gpus)
    for first in (0, 2):
        assert sorted(outcome.gpus[first] + outcome.gpus[first + 1]) == ["0", "1"], outcome.gpus
        assert values[first]["cuda"] == values[first + 1]["cuda"], values
    _check_gpu_lists(cluster, outcome)
    on_a = [r for r in range(NP) if hosts[r] == cluster.hosts[0].hostname]  # no list of its own: Spark's addresses
    assert [values[r]["cuda"].split(",")[values[r]["hvd"]["local_rank"]] for r in on_a] == \
        [outcome.gpus[r][0] for r in on_a]
    # A job with fewer ranks than the hosts have GPUs lists only its own GPUs: never one Spark may give another job.
    outcome = cluster.driver.run("whoami", 2)
    _print_seconds("whoami np=2", outcome)
    _assert_ok(outcome)
    _check_gpu_lists(cluster, outcome)
    for r, value in enumerate(outcome.values):
        assert len(value["cuda"].split(",")) == value["hvd"]["local_size"], outcome


def test_an_executors_own_cuda_visible_devices_is_respected(cluster, no_leftover_ranks):
    from .conftest import HOST_B_VISIBLE_DEVICES

    outcome = cluster.driver.run("whoami", NP)
    _print_seconds("whoami np=4 (host B's executor has CUDA_VISIBLE_DEVICES)", outcome)
    _assert_ok(outcome)
    visible = HOST_B_VISIBLE_DEVICES.split(",")
    on_b = sorted((r for r in range(NP) if outcome.hosts[r] == cluster.hosts[1].hostname),
                  key=lambda r: outcome.values[r]["hvd"]["local_rank"])
    assert [outcome.values[r]["hvd"]["local_rank"] for r in on_b] == [0, 1]
    # Spark's addresses index the executor's own list, as pyspark's TorchDistributor maps them; both ranks list
    # both of the host's GPUs (6 and 7 by the executor's list), in local-rank order.
    mine = [visible[int(outcome.gpus[r][0])] for r in on_b]
    assert sorted(mine) == sorted(visible)
    assert [outcome.values[r]["cuda"] for r in on_b] == [",".join(mine)] * 2
    assert [outcome.values[r]["cuda"].split(",")[outcome.values[r]["own"][0]] for r in on_b] == mine
    _check_gpu_lists(cluster, outcome)


def test_collectives_are_exact_across_hosts(cluster, no_leftover_ranks):
    n = 5
    outcome = cluster.driver.run("collectives", NP, n=n)
    _print_seconds("collectives np=4", outcome)
    _assert_ok(outcome)
    inputs = [[float(i + 1 + n * r) for i in range(n)] for r in range(NP)]
    total = [sum(col) for col in zip(*inputs)]
    gathered = [[float(r)] * 2 for r in range(NP) for _ in range(r + 1)]
    for rank, got in enumerate(outcome.values):
        assert got["sum"] == total, f"rank {rank}"
        assert got["average"] == [t / NP for t in total], f"rank {rank}"
        assert got["int_sum"] == [i * sum(r + 1 for r in range(NP)) for i in range(n)], f"rank {rank}"
        assert got["allgather"] == gathered, f"rank {rank}"
        assert got["broadcast"] == {root: inputs[root] for root in range(NP)}, f"rank {rank}"
        assert got["objects"] == [{"rank": r, "host": outcome.hosts[r]} for r in range(NP)], f"rank {rank}"


def _shards(steps=3, rows=4):
    g = torch.Generator().manual_seed(11)
    return [[(torch.randn(rows, 4, generator=g), torch.randn(rows, 1, generator=g)) for _ in range(steps)]
            for _ in range(NP)]


def _assert_single_process_weights(outcome, shards) -> None:
    """Every rank of a ``train`` run ends with rank 0's weights, those of one process on all the shards."""
    from . import _jobs

    together = _jobs.train_single([(torch.cat([s[k][0] for s in shards]), torch.cat([s[k][1] for s in shards]))
                                   for k in range(len(shards[0]))])
    first = outcome.values[0]
    for rank, weights in enumerate(outcome.values):
        for got, ref0, want in zip(weights, first, together):
            assert torch.equal(got, ref0), f"rank {rank}'s weights differ from rank 0's"
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_distributed_optimizer_gives_every_rank_the_single_process_weights(cluster, no_leftover_ranks):
    shards = _shards()
    outcome = cluster.driver.run("train", NP, shards=shards)
    _print_seconds("DistributedOptimizer np=4", outcome)
    _assert_ok(outcome)
    _assert_single_process_weights(outcome, shards)


def test_lightning_one_device_per_node_trains_on_an_uneven_placement(cluster, no_leftover_ranks):
    """np=3 on two hosts: two ranks on one, one on the other, which no devices=<ranks per host> can describe;
    Trainer(devices=1, num_nodes=3), as Databricks documents it, makes each rank a node (runner/_rank/lightning_nodes.py)."""
    outcome = cluster.driver.run("lightning_nodes", 3, devices=1, num_nodes=3)
    _print_seconds("Lightning devices=1 num_nodes=3 on 2+1 ranks", outcome)
    _assert_ok(outcome)
    assert sorted(outcome.hosts.count(h) for h in set(outcome.hosts)) == [1, 2], outcome.hosts
    assert [v["rank"] for v in outcome.values] == [(0, 0, 0), (1, 0, 1), (2, 0, 2)]  # (global, local, node)
    for value in outcome.values[1:]:
        assert all(torch.equal(a, b) for a, b in zip(value["weights"], outcome.values[0]["weights"]))


@contextlib.contextmanager
def _loopback_hostnames(cluster):
    try:
        for host in cluster.hosts:
            cluster.set_loopback_hostname(host, True)
        yield
    finally:
        for host in cluster.hosts:
            cluster.set_loopback_hostname(host, False)


def test_hosts_whose_hostname_resolves_to_loopback_still_work(cluster, no_leftover_ranks):
    with _loopback_hostnames(cluster):
        host = cluster.hosts[0]
        resolved = host.run("getent", "hosts", host.hostname).stdout.split()[0]
        assert resolved == "127.0.1.1"  # the testbed really is set up the Debian way
        outcome = cluster.driver.run("collectives", NP, n=3)
    _print_seconds("collectives np=4, hostnames resolving to 127.0.1.1", outcome)
    _assert_ok(outcome)
    assert outcome.values[3]["sum"] == [float(sum(i + 1 + 3 * r for r in range(NP))) for i in range(3)]


@contextlib.contextmanager
def _same_hostname(cluster, name):
    before = {h.name: h.hostname for h in cluster.hosts}
    try:
        for host in cluster.hosts:
            cluster.set_hostname(host, name)
        yield
    finally:
        for host in cluster.hosts:
            cluster.set_hostname(host, before[host.name])


def test_two_hosts_with_the_same_hostname_are_still_two_hosts(cluster, no_leftover_ranks):
    with _same_hostname(cluster, "node"):
        outcome = cluster.driver.run("whoami", NP)
    _print_seconds("whoami np=4, both hosts named 'node'", outcome)
    _assert_ok(outcome)
    assert [v["hostname"] for v in outcome.values] == ["node"] * NP
    assert [(v["hvd"]["local_rank"], v["hvd"]["local_size"], v["hvd"]["cross_rank"]) for v in outcome.values] \
        == [(0, 2, 0), (1, 2, 0), (0, 2, 1), (1, 2, 1)]
    assert _grouped_by_netns(outcome.values)


def _grouped_by_netns(values) -> bool:
    return values[0]["netns"] == values[1]["netns"] != values[2]["netns"] == values[3]["netns"]


def test_network_interface_setting_chooses_the_hosts_interface(cluster, no_leftover_ranks):
    with _loopback_hostnames(cluster):  # where the hostname alone would lead gloo to 127.0.1.1
        outcome = cluster.driver.run("collectives", NP, n=2, runner={"network_interface": "eth0"})
    _print_seconds("collectives np=4, network_interface='eth0'", outcome)
    _assert_ok(outcome)
    assert outcome.values[0]["sum"] == [float(sum(i + 1 + 2 * r for r in range(NP))) for i in range(2)]


def test_a_network_interface_missing_on_the_hosts_fails_with_what_they_have(cluster, no_leftover_ranks):
    outcome = cluster.driver.run("whoami", NP, runner={"network_interface": "nosuch0"})
    _print_seconds("whoami np=4, network_interface='nosuch0' (fails)", outcome)
    assert not outcome.ok
    assert "network_interface='nosuch0' has no IPv4 address on host" in outcome.error, outcome.error
    assert "eth0 198.18.0." in outcome.error, outcome.error  # the interfaces the host does have
    assert cluster.driver.run("whoami", NP).ok  # and the next run works
