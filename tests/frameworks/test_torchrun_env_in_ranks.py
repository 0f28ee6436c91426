"""Every rank runs with torchrun's environment, so ``dist.init_process_group()`` works as under torchrun; with
``hvd.init()`` in either order; and the runner's promises hold for such a function: the true cause of a rank's
exception or death first, and ``max_restarts`` relaunching it as torchrun's ``--max-restarts`` does."""

from __future__ import annotations

import os
import signal

import pytest

from sparkhvd import HorovodRunError, HorovodRunner

TORCHRUN_NAMES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                  "NODE_RANK", "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT",
                  "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS",
                  "TORCHELASTIC_USE_AGENT_STORE", "TF_CONFIG")


def _group_then_hvd():
    import json
    import os

    import torch
    import torch.distributed as dist

    import sparkhvd.collective.torch as hvd

    dist.init_process_group("gloo")  # env://, as under torchrun
    t = torch.ones(2) * (dist.get_rank() + 1)
    dist.all_reduce(t)
    hvd.init()  # uses the group the function built
    summed = hvd.allreduce(torch.ones(1) * (hvd.rank() + 1), op=hvd.Sum)
    env = {k: os.environ.get(k) for k in TORCHRUN_NAMES}
    env["TF_CONFIG"] = json.loads(env["TF_CONFIG"])
    return env, t.tolist(), summed.item(), (hvd.rank(), hvd.size(), hvd.local_rank())


def test_init_process_group_works_in_a_spark_barrier_stage_and_hvd_init_reuses_its_group(spark):
    values = HorovodRunner(np=2).run_all(_group_then_hvd).values
    for rank, (env, reduced, summed, hvd_place) in enumerate(values):
        assert reduced == [3.0, 3.0] and summed == 3.0 and hvd_place == (rank, 2, rank)
        assert {k: env[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                                    "GROUP_WORLD_SIZE", "NODE_RANK", "TORCHELASTIC_RESTART_COUNT",
                                    "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_USE_AGENT_STORE")} == {
            "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": "2",  # one host
            "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1", "NODE_RANK": "0", "TORCHELASTIC_RESTART_COUNT": "0",
            "TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_USE_AGENT_STORE": "False"}
        assert env["TF_CONFIG"]["task"] == {"type": "worker", "index": rank}
    first, second = values[0][0], values[1][0]
    assert first["MASTER_ADDR"] == second["MASTER_ADDR"] and first["MASTER_PORT"] == second["MASTER_PORT"]
    assert first["TORCHELASTIC_RUN_ID"] == second["TORCHELASTIC_RUN_ID"]
    assert first["TF_CONFIG"]["cluster"] == second["TF_CONFIG"]["cluster"]
    workers = first["TF_CONFIG"]["cluster"]["worker"]
    assert len(set(workers)) == 2 and f"{first['MASTER_ADDR']}:{first['MASTER_PORT']}" not in workers


def _hvd_then_group():
    import torch.distributed as dist

    import sparkhvd.collective.torch as hvd

    hvd.init()
    dist.init_process_group("gloo")


def test_init_process_group_after_hvd_init_fails_at_once_saying_which_to_call():
    with pytest.raises(HorovodRunError) as failure:
        HorovodRunner(np=-2).run(_hvd_then_group)
    assert ("hvd.init() already built this rank's default process group; call dist.init_process_group() before "
            "hvd.init() (which then uses that group), or only when not dist.is_initialized().") in str(failure.value)


def _ddp_steps(fault: str = "", steps: int = 4):
    import os
    import signal

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    restarts = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    for step in range(steps):
        if step == 2 and dist.get_rank() == 1:
            if fault == "raise":
                raise ValueError("bad batch at step 2")
            if fault == "kill" or (fault == "kill once" and restarts == 0):
                os.kill(os.getpid(), signal.SIGKILL)
        opt.zero_grad()
        model(torch.randn(8, 4)).pow(2).mean().backward()
        opt.step()
    return restarts, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("fault", ["raise", "kill"])
def test_a_ddp_rank_that_raises_or_dies_is_the_errors_headline(fault):
    with pytest.raises(HorovodRunError) as failure:
        HorovodRunner(np=-2).run(_ddp_steps, fault=fault)
    headline = str(failure.value).splitlines()[0]
    if fault == "raise":
        assert "rank 1" in headline and "ValueError: bad batch at step 2" in headline, headline
    else:
        assert f"rank 1's process was killed by signal {int(signal.SIGKILL)}" in headline, headline
    assert "Connection closed by peer" not in headline and "rank 0" not in headline


def test_max_restarts_relaunches_a_ddp_function_whose_rank_died_as_torchrun_does():
    runner = HorovodRunner(np=-2, max_restarts=1)
    restarts, weights = runner.run(_ddp_steps, fault="kill once")
    assert restarts == 1 and len(runner.last_result.restarts) == 1
    assert os.environ.get("TORCHELASTIC_RESTART_COUNT") is None  # the driver's own environment is left alone
    assert all(w.isfinite().all() for w in weights)


@pytest.mark.unit
def test_hvd_init_says_why_it_cannot_use_the_functions_group():
    from sparkhvd.collective._engine.communicator import reuse_problem

    assert reuse_problem((1, 2), (1, 2), "gloo") is None
    assert reuse_problem((0, 2), (0, 2), "cpu:gloo,cuda:nccl") is None
    assert reuse_problem((0, 1), (1, 2), "gloo") == (
        "hvd.init() found a default process group in which this process is rank 0 of 1, but HorovodRunner placed it "
        "as rank 1 of 2; build the group from the environment the runner set (dist.init_process_group() with no "
        "init_method, rank or world_size), or call hvd.init() alone.")
    assert reuse_problem((0, 2), (0, 2), "nccl") == (
        "hvd.init() found a default process group on backend 'nccl', which carries no CPU tensors, and Horovod's API "
        "needs them (broadcast_object, elastic state, CPU tensors); build it with "
        "dist.init_process_group('cpu:gloo,cuda:nccl'), or call hvd.init() alone.")


@pytest.mark.unit
def test_env_rendezvous_in_a_rank_of_the_run_goes_through_the_drivers_store(monkeypatch):
    import datetime
    import importlib

    from sparkhvd._common import context
    from sparkhvd._common.topology import Placement
    from sparkhvd.collective._engine import env_rendezvous
    from sparkhvd.collective._engine.store import DriverStore

    handlers = importlib.import_module("torch.distributed.rendezvous")._rendezvous_handlers
    assert handlers["env"] is env_rendezvous._env_handler  # installed when the engine is imported
    seen = []
    monkeypatch.setattr(env_rendezvous, "_original", lambda url, **kw: seen.append(url) or iter(["torch's"]))
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert next(env_rendezvous._env_handler("env://")) == "torch's"  # outside a run: torch's own
    ctx = context.WorkerContext(placement=Placement(1, 2, 1, 2, 0, 1), run_id="r", address=("127.0.0.1", 1),
                                secret=b"s", client=None, torchrun_master=("10.0.0.1", "29500"))
    monkeypatch.setattr(ctx, "new_client", lambda: "a client of the driver")
    monkeypatch.setattr(context, "_current", ctx)
    store, rank, size = next(env_rendezvous._env_handler("env://", timeout=datetime.timedelta(seconds=7)))
    assert isinstance(store, DriverStore) and (rank, size) == (1, 2) and store.timeout.total_seconds() == 7
    assert store._client == "a client of the driver" and store._prefix.startswith("sparkhvd/env/")
    assert next(env_rendezvous._env_handler("env://?rank=0&world_size=3"))[1:] == (0, 3)  # init's arguments win
    monkeypatch.setenv("MASTER_PORT", "29501")  # the function pointed env:// elsewhere: torch's own
    assert next(env_rendezvous._env_handler("env://")) == "torch's" and seen == ["env://", "env://"]
