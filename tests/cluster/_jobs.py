"""Training functions the cluster driver runs (by name). Pickled by value: hosts never import tests/."""

from __future__ import annotations

import os
import socket


def _model():
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def whoami():
    """Where this rank runs, as the rank itself and Horovod's API see it."""
    from pyspark import TaskContext

    import sparkhvd.collective.torch as hvd
    from sparkhvd.collective._engine import communicator as _engine

    hvd.init()
    task = TaskContext.get()  # the Spark task the rank's agent runs in
    gpus = task.resources().get("gpu") if task is not None else None
    return {"hostname": socket.gethostname(), "pid": os.getpid(), "netns": os.readlink("/proc/self/ns/net"),
            "partition": task.partitionId() if task is not None else None,
            "task_gpus": sorted(gpus.addresses) if gpus is not None else [],
            "cuda": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "own": list(_engine.topology().cuda_devices),  # the entries of "cuda" that are this rank's own GPUs
            "hvd": {"rank": hvd.rank(), "size": hvd.size(), "local_rank": hvd.local_rank(),
                    "local_size": hvd.local_size(), "cross_rank": hvd.cross_rank(), "cross_size": hvd.cross_size()}}


def barrier_gather():
    """pyspark's BarrierTaskContext in the rank: a barrier(), then allGather() of the rank's own number."""
    from pyspark import BarrierTaskContext

    import sparkhvd.collective.torch as hvd

    hvd.init()
    ctx = BarrierTaskContext.get()
    ctx.barrier()
    return ctx.allGather(str(hvd.rank()))


def torchrun_env():
    """Every process's torchrun variables and GPUs, gathered through its own env:// process group (rank 0's)."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    mine = {name: os.environ.get(name) for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                                                    "NODE_RANK", "GROUP_WORLD_SIZE", "CUDA_VISIBLE_DEVICES",
                                                    "TF_CONFIG")}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, {**mine, "hostname": socket.gethostname()})
    dist.destroy_process_group()
    return everyone


def collectives(n: int = 5):
    """allreduce (sum, average), allgather and broadcast of tensors built from the rank."""
    import torch

    import sparkhvd.collective.torch as hvd

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    x = torch.arange(n, dtype=torch.float64) + 1 + n * rank
    gathered = hvd.allgather(torch.full((rank + 1, 2), float(rank)))  # uneven first dimensions
    return {
        "sum": hvd.allreduce(x, op=hvd.Sum, name="sum").tolist(),
        "average": hvd.allreduce(x, op=hvd.Average, name="average").tolist(),
        "int_sum": hvd.allreduce(torch.arange(n, dtype=torch.int64) * (rank + 1), op=hvd.Sum, name="ints").tolist(),
        "allgather": gathered.tolist(),
        "broadcast": {root: hvd.broadcast(x.clone(), root_rank=root, name=f"bcast.{root}").tolist()
                      for root in range(size)},
        "objects": hvd.allgather_object({"rank": rank, "host": socket.gethostname()}),
    }


def train(shards, lr: float = 0.1):
    """DistributedOptimizer on this rank's shard; returns the final weights."""
    import torch

    import sparkhvd.collective.torch as hvd

    hvd.init()
    model = _model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9),
                                   named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    for x, y in shards[hvd.rank()]:
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def train_single(batches, lr: float = 0.1):
    """The reference: one process, plain SGD on the concatenated batches."""
    import torch

    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    for x, y in batches:
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def straggler(slow_rank: int, steps: int = 60, sleep: float = 0.1):
    """Training where ``slow_rank`` sleeps ``sleep`` s in each step (the straggler line's test); returns where each
    rank ran."""
    import time

    import torch

    import sparkhvd.collective.torch as hvd

    hvd.init()
    model = _model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                   named_parameters=model.named_parameters())
    for _ in range(steps):
        if hvd.rank() == slow_rank:
            time.sleep(sleep)
        opt.zero_grad()
        model(torch.randn(4, 4)).sum().backward()
        opt.step()
    return {"rank": hvd.rank(), "host": socket.gethostname()}


def allreduce_loop(steps: int = 1_000_000, numel: int = 1 << 16):
    """Fault probes: allreduce until stopped; prints each rank's pid first."""
    import torch

    import sparkhvd.collective.torch as hvd

    hvd.init()
    print(f"rank {hvd.rank()} pid {os.getpid()} on {socket.gethostname()}", flush=True)
    x = torch.ones(numel)
    for i in range(steps):
        hvd.allreduce(x, name=f"loop.{i % 8}")
    return steps


def elastic_train(epochs: int = 3, batches: int = 40, commit_every: int = 5, step_seconds: float = 0.05,
                  say_steps: bool = False):
    """Deterministic training under ``hvd.elastic.run``, committing every few batches; slow enough for a fault
    to land mid-run. Returns the final weights and the steps counted in the committed state. ``say_steps``:
    rank 0 prints ``step N done`` after each step, so that a test counts the steps done twice across attempts."""
    import time

    import torch

    import sparkhvd.collective.torch as hvd
    from sparkhvd._common import commits as _commits

    hvd.init()
    print(f"rank {hvd.rank()} pid {os.getpid()} on {socket.gethostname()}", flush=True)
    model = _model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                   named_parameters=model.named_parameters())
    state = hvd.elastic.TorchState(model=model, optimizer=opt, epoch=0, batch=0, steps=0)

    @hvd.elastic.run
    def loop(state):
        while state.epoch < epochs:
            while state.batch < batches:
                g = torch.Generator().manual_seed(10_000 * state.epoch + 10 * state.batch + hvd.rank())
                x = torch.randn(16, 4, generator=g)
                opt.zero_grad()
                torch.nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True).sin()).backward()
                opt.step()
                time.sleep(step_seconds)
                state.batch += 1
                state.steps += 1
                if say_steps and hvd.rank() == 0:
                    print(f"step {state.steps} done", flush=True)
                if state.batch % commit_every == 0:
                    state.commit()
                    if state.steps == 2 * commit_every and hvd.rank() == 0:
                        _commits.flush(60)
                        print(f"commit of step {state.steps} is on the driver", flush=True)  # the tests' cue
            state.batch = 0
            state.epoch += 1
            state.commit()
        return [p.detach().clone() for p in model.parameters()], state.steps

    return loop(state)


def recovery_train(marks: str, steps: int = 200, commit_every: int = 5, step_seconds: float = 0.05):
    """bench/recovery.py's training under ``hvd.elastic.run``: ``elastic_train``'s loop, where rank 0 also writes
    ``time.monotonic()`` (every host shares this machine's clock) of its start-up steps to ``marks``: entered the
    function, ``hvd.init()`` returned, the first step done (and the step it resumed from)."""
    import json
    import time

    entered = time.monotonic()
    import torch

    import sparkhvd.collective.torch as hvd
    from sparkhvd._common import commits as _commits

    hvd.init()
    initialised = time.monotonic()
    print(f"rank {hvd.rank()} pid {os.getpid()} on {socket.gethostname()}", flush=True)
    model = _model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                   named_parameters=model.named_parameters())
    state = hvd.elastic.TorchState(model=model, optimizer=opt, steps=0)
    first = [True]

    @hvd.elastic.run
    def loop(state):
        while state.steps < steps:
            resumed_from = state.steps
            g = torch.Generator().manual_seed(state.steps * 10 + hvd.rank())
            x = torch.randn(16, 4, generator=g)
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True).sin()).backward()
            opt.step()
            state.steps += 1
            if first[0] and hvd.rank() == 0:
                first[0] = False
                with open(os.path.join(marks, f"rank0-{os.getpid()}.json"), "w") as f:
                    json.dump({"entered": entered, "init": initialised, "step": time.monotonic(),
                               "from": resumed_from}, f)
            time.sleep(step_seconds)
            if state.steps % commit_every == 0:
                state.commit()
                if state.steps == 2 * commit_every and hvd.rank() == 0:
                    _commits.flush(60)
                    print(f"commit of step {state.steps} is on the driver", flush=True)  # the benchmark's cue
        return state.steps

    return loop(state)


def lightning_nodes(devices: int, num_nodes: int):
    """Lightning's Trainer(strategy="ddp", devices=, num_nodes=) on CPU; this rank's (global, local, node) and weights."""
    import lightning as L
    import torch

    class Regression(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)

        def training_step(self, batch, index):
            x, y = batch
            return torch.nn.functional.mse_loss(self.layer(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    L.seed_everything(0, verbose=False)
    model = Regression()
    x = torch.randn(24, 4, generator=torch.Generator().manual_seed(0))
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4)
    trainer = L.Trainer(accelerator="cpu", strategy="ddp", devices=devices, num_nodes=num_nodes, max_epochs=1,
                        enable_progress_bar=False, logger=False, enable_checkpointing=False,
                        enable_model_summary=False, default_root_dir=os.environ.get("TMPDIR"))
    trainer.fit(model, data)
    return {"rank": (trainer.global_rank, trainer.local_rank, trainer.node_rank), "hostname": socket.gethostname(),
            "weights": [p.detach().clone() for p in model.parameters()]}
