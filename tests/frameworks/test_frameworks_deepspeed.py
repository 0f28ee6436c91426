"""DeepSpeed's engine trains under HorovodRunner on CPU, from the torchrun environment every rank gets: the same
weights on every rank."""

from __future__ import annotations

import pytest
import torch

from sparkhvd import HorovodRunner

pytest.importorskip("deepspeed")

STEPS, BATCH = 3, 4


def _batches(rank: int) -> list:
    g = torch.Generator().manual_seed(100 + rank)
    return [torch.randn(BATCH, 4, generator=g) for _ in range(STEPS)]


def _deepspeed_steps():
    import os

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    import deepspeed.ops
    import torch

    # DeepSpeed's CPU backend would otherwise compile its shared-memory allreduce (a C++ op, over a minute, into
    # ~/.cache/torch_extensions) before the first step; gloo carries its collectives without it.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo")  # env://: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    config = {"train_micro_batch_size_per_gpu": BATCH, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "zero_optimization": {"stage": 0}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    for x in _batches(engine.global_rank):
        engine.backward(engine(x).pow(2).mean())
        engine.step()
    return engine.world_size, [p.detach().clone() for p in engine.module.parameters()]


def test_deepspeed_trains_alike_on_every_rank():
    values = HorovodRunner(np=-2).run_all(_deepspeed_steps).values
    assert [size for size, _ in values] == [2, 2]
    for a, b in zip(values[0][1], values[1][1]):
        assert torch.equal(a, b)
    torch.manual_seed(0)
    start = list(torch.nn.Linear(4, 1).parameters())
    assert not all(torch.equal(a, b.detach()) for a, b in zip(values[0][1], start))  # it trained
