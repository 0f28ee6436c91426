"""DeepSpeed's engine trains under HorovodRunner on CPU, from the torchrun environment every rank gets: the same
weights on every rank. pyspark's DeepspeedTorchDistributor, sparkhvd's drop-in, trains a function and a script that
reads its configuration from --deepspeed_config. In hvd.elastic.TorchState, a ZeRO-2 and a ZeRO-3 engine's commits
hold every rank's partition, and a rank killed mid-run resumes from them bit for bit."""

from __future__ import annotations

import json
import os

import pytest
import torch
from _installed import needs

from sparkhvd import DeepspeedTorchDistributor, HorovodRunner

pytestmark = needs("deepspeed")

STEPS, BATCH, LR = 3, 4, 0.1
# gradient_clipping: DeepSpeed's default clips the gradients' norm at 1.0; off, the oracles below are plain SGD
CONFIG = {"train_micro_batch_size_per_gpu": BATCH, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
          "optimizer": {"type": "SGD", "params": {"lr": LR}}, "zero_optimization": {"stage": 0}}


def _batches(rank: int) -> list:
    g = torch.Generator().manual_seed(100 + rank)
    return [torch.randn(BATCH, 4, generator=g) for _ in range(STEPS)]


def _deepspeed_steps(config: dict | None = None):
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
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config or CONFIG)
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


# ---- pyspark's DeepspeedTorchDistributor, sparkhvd's drop-in ---------------------------------------------------

def _sgd_on_both_ranks_batches() -> list:
    """The oracle: the same steps in this process, each with the mean of the two ranks' gradients."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    for step in range(STEPS):
        grads = []
        for rank in (0, 1):
            model.zero_grad()
            model(_batches(rank)[step]).pow(2).mean().backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        with torch.no_grad():
            for p, g0, g1 in zip(model.parameters(), *grads):
                p -= LR * (g0 + g1) / 2
    return [p.detach() for p in model.parameters()]


def _argv_and_steps(micro_batch: int):
    """A function that reads its configuration as pyspark's users can: from the arguments DeepSpeed parses."""
    import argparse
    import json
    import os
    import sys

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed

    args = deepspeed.add_config_arguments(argparse.ArgumentParser()).parse_args()
    with open(args.deepspeed_config, encoding="utf-8") as f:
        config = json.load(f)
    assert config["train_micro_batch_size_per_gpu"] == micro_batch
    return sys.argv[1:], _deepspeed_steps(config)


def test_the_dropin_runs_a_function_on_numgpus_processes_and_returns_rank_zeros_weights(tmp_path):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(CONFIG))
    distributor = DeepspeedTorchDistributor(numGpus=2, nnodes=1, localMode=True, useGpu=False,
                                            deepspeedConfig=str(path))
    argv, (size, weights) = distributor.run(_argv_and_steps, BATCH)
    assert argv == ["--deepspeed", "--deepspeed_config", str(path)]  # as pyspark's generated script is given
    assert size == 2
    for ours, oracle in zip(weights, _sgd_on_both_ranks_batches(), strict=True):
        assert torch.allclose(ours, oracle, rtol=0, atol=1e-6), (ours, oracle)


_SCRIPT = """\
import argparse, json, os, sys
os.environ.setdefault("DS_ACCELERATOR", "cpu")
import deepspeed, deepspeed.ops, torch
deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
args = deepspeed.add_config_arguments(parser).parse_args()
with open(args.deepspeed_config, encoding="utf-8") as f:
    config = json.load(f)
deepspeed.init_distributed(dist_backend="gloo")
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
engine, *_ = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters())
engine.backward(engine(torch.ones(4, 4) * (1 + engine.global_rank)).pow(2).mean())
engine.step()
with open(os.path.join(args.out, f"rank{engine.global_rank}.json"), "w", encoding="utf-8") as f:
    json.dump({"argv": sys.argv[1:], "deepspeed": args.deepspeed, "config": config,
               "weight": model.weight.tolist()}, f)
"""


def test_the_dropin_runs_a_script_with_its_dict_config_in_a_file_removed_afterwards(tmp_path):
    script, out = tmp_path / "train.py", tmp_path / "out"
    script.write_text(_SCRIPT)
    out.mkdir()
    config = {**CONFIG, "optimizer": {"type": "SGD", "params": {"lr": 0.5}}}
    distributor = DeepspeedTorchDistributor(numGpus=2, useGpu=False, deepspeedConfig=config)
    assert distributor.run(str(script), "--out", str(out)) is None
    said = [json.loads((out / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    paths = [s["argv"][4] for s in said]
    for s, path in zip(said, paths):
        assert s["argv"] == ["--out", str(out), "--deepspeed", "--deepspeed_config", path]
        assert s["deepspeed"] is True and s["config"] == config
        folder = os.path.dirname(path)
        assert os.path.basename(folder).startswith("sparkhvd-deepspeed-") and not os.path.exists(folder)
    assert paths[0] != paths[1]  # a file per process
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    start = model.weight.detach().clone()
    grads = []
    for rank in (0, 1):
        model.zero_grad()
        model(torch.ones(4, 4) * (1 + rank)).pow(2).mean().backward()
        grads.append(model.weight.grad.clone())
    oracle = start - 0.5 * (grads[0] + grads[1]) / 2  # one step at the configuration's lr, not the default 0.1
    assert said[0]["weight"] == said[1]["weight"] and not torch.equal(oracle, start)
    assert torch.allclose(torch.tensor(said[0]["weight"]), oracle, rtol=0, atol=1e-6)


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
