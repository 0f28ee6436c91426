"""Sharded commits (``collective/torch/_sharded.py``): an FSDP2 model in ``hvd.elastic.TorchState`` commits each
rank's shard to the run's folder with torch.distributed.checkpoint, the driver carrying only their names and
digests. A rank killed mid-run resumes from the shards and ends with the uninterrupted run's weights and momentum,
bit for bit; a new driver with one rank resumes the same commit resharded; a shard changed behind the run's back
is refused with a sentence; without a folder the run says its sharded state cannot be resumed."""

from __future__ import annotations

import os

import pytest

from sparkhvd import HorovodRunner
from sparkhvd.runner import HorovodRunError

STEPS, KILL_AT = 6, 3


def _train(marks: str, kill_at: int = -1):
    import signal

    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    import sparkhvd.collective.torch as hvd
    from sparkhvd._common import commits

    dist.init_process_group("gloo")  # before hvd.init(), which then uses this group (as FSDP2 does)
    hvd.init()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    for layer in (model[0], model[2]):
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    try:
        hvd.elastic.TorchState(optimizer=opt)
        refused = None
    except TypeError as exc:
        refused = str(exc)
    state = hvd.elastic.TorchState(model=model, optimizer=opt, step=0)

    @hvd.elastic.run
    def loop(state):
        while state.step < STEPS:
            if state.step == kill_at:
                commits.flush(60)  # the commit of step kill_at has reached the driver: it is the one resumed
                hvd.barrier()
                mark = os.path.join(marks, "killed")
                if hvd.rank() == 1 and not os.path.exists(mark):
                    open(mark, "w").close()
                    os.kill(os.getpid(), signal.SIGKILL)
            g = torch.Generator().manual_seed(100 * state.step + hvd.rank())
            x = torch.randn(8, 4, generator=g)
            state.optimizer.zero_grad()
            torch.nn.functional.mse_loss(state.model(x), x.sum(1, keepdim=True).sin()).backward()
            state.optimizer.step()
            state.step += 1
            state.commit()
        params = list(state.model.parameters())
        weights = [p.full_tensor().tolist() for p in params]
        momentum = [state.optimizer.state[p]["momentum_buffer"].full_tensor().tolist() for p in params]
        return weights, momentum

    result = loop(state)
    del model, opt, state  # the model's collectives' state goes before its group (docs/performance.md)
    dist.destroy_process_group()
    return result, refused


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    runner = HorovodRunner(np=-2)
    ranks = runner.run_all(_train, marks=str(tmp_path_factory.mktemp("marks")))
    return runner, ranks


def test_without_a_folder_a_sharded_state_trains_and_says_it_cannot_be_resumed(uninterrupted):
    runner, ranks = uninterrupted
    (result0, refused), (result1, _) = ranks.values
    assert result0 == result1  # each rank gathered the same full tensors
    assert refused == ("hvd.elastic.TorchState: the optimizer optimizer= steps sharded (DTensor) parameters, but no "
                       "module of the state holds them, and its state is kept by parameter name; pass the sharded "
                       "model too, as TorchState(model=model, optimizer=optimizer).")
    with open(runner.last_result.log_paths[0]) as f:
        said = [line for line in f if "sharded model" in line]
    assert said == ["sparkhvd: TorchState-0 holds a sharded model, whose shards cannot go to the driver; its commits "
                    "stay in the ranks' memory only, so a restart starts it over. Give HorovodRunner a folder every "
                    "rank reaches (commit_dir=, or run_id= with storage=) to resume it.\n"]  # once, not per commit


@pytest.mark.timeout(300)
def test_a_killed_rank_resumes_from_its_shards_and_a_new_driver_with_one_rank_reshards_them(uninterrupted, tmp_path):
    want = uninterrupted[1].values[0][0]
    storage = str(tmp_path / "storage")
    runner = HorovodRunner(np=-2, max_restarts=1, run_id="s1", storage=storage, keep_commits=1)
    got, _ = runner.run(_train, marks=str(tmp_path), kill_at=KILL_AT)
    assert (tmp_path / "killed").exists()
    assert got == want  # weights and momentum, bit for bit (JSON-able floats of the same float32 values)
    [kept] = runner.last_result.commits
    shards = kept["shards"]
    assert kept["seq"] == STEPS and shards["path"].startswith(f"{storage}/s1/") and shards["path"].endswith(".dcp")
    files = sorted(os.listdir(shards["path"]))
    assert files == sorted(shards["sha256"]) and ".metadata" in files and len(files) == 3  # one file per rank
    assert shards["bytes"] == sum(os.path.getsize(os.path.join(shards["path"], f)) for f in files)
    assert kept["bytes"] < 2000  # the pickled snapshot sent off the ranks holds the plain values, not the model
    assert [name for name in os.listdir(f"{storage}/s1") if name.endswith(".dcp")] == [os.path.basename(shards["path"])]

    (again, _), = HorovodRunner(np=-1, run_id="s1", storage=storage, keep_commits=1).run_all(
        _train, marks=str(tmp_path)).values
    assert again == want  # the two ranks' shards, loaded into one rank's whole tensors

    shard = next(os.path.join(shards["path"], f) for f in files if f.endswith(".distcp"))
    with open(shard, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 1]))
    with pytest.raises(HorovodRunError) as caught:
        HorovodRunner(np=-1, run_id="s1", storage=storage).run(_train, marks=str(tmp_path))
    assert (f"ValueError: the sharded commit {shards['path']} is not the one its ranks wrote: "
            f"{os.path.basename(shard)} (") in str(caught.value)
    assert ("do not match the SHA-256 the driver recorded; something else wrote to the run's folder. Give each run a "
            "folder only it writes to (or a new run_id). Nothing was loaded from it.") in str(caught.value)
