"""Lightning's Trainer(devices=d, num_nodes=n) on any placement: the rank's torchrun variables as that Trainer's
nodes (runner/_rank/lightning_nodes.py: regroup). The runs themselves are in tests/frameworks/test_frameworks_torch.py."""

from __future__ import annotations

import pytest

from sparkhvd.runner._rank.lightning_nodes import regroup

pytestmark = pytest.mark.unit


def _host_layout(rank: int, local_rank: int, local_size: int, group: int, groups: int, size: int) -> dict:
    return {"RANK": str(rank), "WORLD_SIZE": str(size), "LOCAL_RANK": str(local_rank),
            "LOCAL_WORLD_SIZE": str(local_size), "GROUP_RANK": str(group), "NODE_RANK": str(group),
            "GROUP_WORLD_SIZE": str(groups)}


def test_one_device_per_node_makes_every_rank_a_node():
    env = _host_layout(rank=1, local_rank=1, local_size=2, group=0, groups=1, size=2)  # two ranks on one host
    assert regroup(1, 2, env)
    assert env == {**env, "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "GROUP_RANK": "1", "NODE_RANK": "1",
                   "GROUP_WORLD_SIZE": "2"}


def test_an_uneven_placement_becomes_even_nodes_of_the_trainers_devices():
    # 3 ranks on host a, 1 on host b (ranks 0-2 and 3); Trainer(devices=2, num_nodes=2)
    envs = [_host_layout(r, r if r < 3 else 0, 3 if r < 3 else 1, 0 if r < 3 else 1, 2, 4) for r in range(4)]
    assert all(regroup(2, 2, env) for env in envs)
    assert [(e["LOCAL_RANK"], e["NODE_RANK"], e["LOCAL_WORLD_SIZE"]) for e in envs] == \
        [("0", "0", "2"), ("1", "0", "2"), ("0", "1", "2"), ("1", "1", "2")]


def test_a_trainer_that_matches_the_layout_or_not_the_world_size_is_left_alone():
    matching = _host_layout(rank=3, local_rank=1, local_size=2, group=1, groups=2, size=4)
    assert not regroup(2, 2, dict(matching))  # devices = ranks per host: torchrun's layout already is that
    wrong = _host_layout(rank=1, local_rank=1, local_size=2, group=0, groups=1, size=2)
    before = dict(wrong)
    assert not regroup(1, 3, wrong) and wrong == before  # 1 * 3 != 2: Lightning's own ValueError says so
    assert not regroup(1, 2, {"RANK": "0"})  # not torchrun's variables: not a rank of a run


def test_a_regrouped_rank_keeps_its_own_gpu_pinned_or_not(monkeypatch):
    """The strategy's device after regrouping: the runner's pinned GPU, else (on the driver) LOCAL_RANK % GPUs as
    hvd.init() selects it; never cuda:<the Trainer's LOCAL_RANK>, another rank's on this host."""
    import torch

    from sparkhvd.runner._rank import lightning_nodes

    class Strategy:
        @property
        def root_device(self):
            return torch.device("cuda", 0)  # parallel_devices[LOCAL_RANK] after regroup(1, n): LOCAL_RANK 0

    lightning_nodes._wrap_root_device(Strategy)
    monkeypatch.setattr(lightning_nodes, "_regrouped", True)
    monkeypatch.setattr(lightning_nodes, "_own_gpu", 3)
    assert Strategy().root_device == torch.device("cuda", 3)
    monkeypatch.setattr(lightning_nodes, "_own_gpu", None)
    monkeypatch.setattr(lightning_nodes, "_local_rank", 3)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert Strategy().root_device == torch.device("cuda", 1)
    monkeypatch.setattr(lightning_nodes, "_regrouped", False)
    assert Strategy().root_device == torch.device("cuda", 0)  # the layout was the Trainer's: Lightning's own choice
