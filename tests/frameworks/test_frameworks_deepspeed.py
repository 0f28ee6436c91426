"""DeepSpeed's engine trains under HorovodRunner on CPU, from the torchrun environment every rank gets: the same
weights on every rank. In hvd.elastic.TorchState, a ZeRO-2 and a ZeRO-3 engine's commits hold every rank's
partition, and a rank killed mid-run resumes from them bit for bit."""

from __future__ import annotations

import pytest
import torch
from _installed import needs

from sparkhvd import HorovodRunner

pytestmark = needs("deepspeed")

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


# ---- DeepSpeed engines in hvd.elastic.TorchState: their ZeRO partitions in every commit ------------------------

ELASTIC_STEPS, KILL_AT = 5, 3


def _engine(stage: int):
    import deepspeed
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    config = {"train_micro_batch_size_per_gpu": BATCH, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}},
              "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


def _step(engine, step: int) -> None:
    import torch

    x = torch.randn(BATCH, 4, generator=torch.Generator().manual_seed(10 * step + engine.global_rank))
    engine.backward((engine(x) - x.sum(1, keepdim=True)).pow(2).mean())
    engine.step()


def _weights(engine) -> list:
    """The engine's whole parameters (ZeRO-3 holds a partition of each on every rank: gathered for the copy)."""
    import deepspeed

    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params):
        return [p.detach().clone() for p in params]


def _zero_elastic(marks: str):
    import os
    import signal

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    import deepspeed.ops

    import sparkhvd.collective.torch as hvd
    from sparkhvd._common import commits
    from sparkhvd.collective.torch import _sharded

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo")
    hvd.init()
    refused, resumed, reference = [], [], []
    for stage in (2, 3):  # one state each, one after the other: rank 1 is killed in each at step 3, once
        engine = _engine(stage)
        if stage == 2:
            for bad in (lambda: hvd.elastic.TorchState(model=engine, optimizer=engine.optimizer),
                        lambda: _sharded.read_deepspeed({"path": "/x"}, {}, made_with=3)):
                try:
                    bad()
                except (TypeError, ValueError) as exc:
                    refused.append(str(exc))
        state = hvd.elastic.TorchState(model=engine, step=0)
        killed = os.path.join(marks, f"killed-zero{stage}")

        @hvd.elastic.run
        def loop(state):
            while state.step < ELASTIC_STEPS:
                if state.step == KILL_AT:
                    commits.flush(60)
                    hvd.barrier()
                    if hvd.rank() == 1 and not os.path.exists(killed):
                        open(killed, "w").close()
                        os.kill(os.getpid(), signal.SIGKILL)
                _step(state.model, state.step)
                state.step += 1
                state.commit()
            return _weights(state.model)

        resumed.append(loop(state))
        uninterrupted = _engine(stage)  # the same steps in the same process, never interrupted
        for step in range(ELASTIC_STEPS):
            _step(uninterrupted, step)
        reference.append(_weights(uninterrupted))
    return resumed, reference, refused


@pytest.mark.timeout(300)
def test_zero2_and_zero3_engines_in_elastic_states_resume_from_every_ranks_partition_bit_for_bit(tmp_path):
    import os

    storage = str(tmp_path / "storage")
    runner = HorovodRunner(np=-2, max_restarts=2, run_id="ds", storage=storage, keep_commits=1)
    (resumed, reference, refused), _ = runner.run_all(_zero_elastic, marks=str(tmp_path)).values
    assert (tmp_path / "killed-zero2").exists() and (tmp_path / "killed-zero3").exists()
    assert len(runner.last_result.restarts) == 2
    for stage, ours, uninterrupted in zip((2, 3), resumed, reference):  # the momentum partitions resumed too
        assert all(torch.equal(a, b) for a, b in zip(ours, uninterrupted)), f"ZeRO-{stage}"
    kept = runner.last_result.commits
    assert len(kept) == 2
    for meta in kept:
        shards = meta["shards"]
        assert shards["deepspeed"] == ["model"] and shards["path"].endswith(".ds")
        assert all(os.path.exists(os.path.join(shards["path"], name)) for name in shards["sha256"])
    written = sorted((sorted(n for n in meta["shards"]["sha256"] if n.endswith(".pt")) for meta in kept), key=len)
    assert written == [
        # ZeRO-2: rank 0's model, each rank's partition of the optimizer
        ["model/mp_rank_00_model_states.pt", "model/zero_pp_rank_0_mp_rank_00_optim_states.pt",
         "model/zero_pp_rank_1_mp_rank_00_optim_states.pt"],
        # ZeRO-3: each rank's partition of the model too
        ["model/zero_pp_rank_0_mp_rank_00_model_states.pt", "model/zero_pp_rank_0_mp_rank_00_optim_states.pt",
         "model/zero_pp_rank_1_mp_rank_00_model_states.pt", "model/zero_pp_rank_1_mp_rank_00_optim_states.pt"]]
    assert refused == [
        "hvd.elastic.TorchState: optimizer= is DeepSpeed's DeepSpeedZeroOptimizer, which its engine's checkpoint "
        "holds; pass the engine alone, as TorchState(model=engine), and leave optimizer= out.",
        "the DeepSpeed commit /x was written by 3 ranks and this run has 2: DeepSpeed loads its ZeRO partitions at the "
        "number of ranks that wrote them; run with np=3, or convert the checkpoint with DeepSpeed's ds_to_universal "
        "and load it yourself."]
