"""Benchmark (not a test): Horovod's synthetic training protocol on a CPU-sized conv net.

A fixed random batch, warm-up batches, then ``--iters`` timed iterations of
``--batches-per-iter`` batches; img/s per iteration, reported as mean +- 1.96 sigma (as
Horovod's pytorch_synthetic_benchmark.py does). Configurations that are compared run in the
same processes, their timed iterations alternating (the order swapped every other
iteration), so that a shared machine's drift hits both alike and every iteration gives a
paired ratio:

  np=1  HorovodRunner(np=-1): plain torch  against  hvd.DistributedOptimizer, stepping one
        model object in turns (two copies of the model differ by about 5% on their own here,
        from where their memory lies)
  np=2  HorovodRunner(np=-2): torch DDP on the gloo process group hvd.init() built  against
        hvd.DistributedOptimizer, two copies of the model in each rank

Targets: ours / DDP >= 1.0 at np=2 (total img/s of both ranks), ours' overhead against plain
torch at np=1 <= 3%. The paired ratios are printed with a 95% confidence interval of their
mean; at np=1, where the noise between two identical models is about +-5% over 30 pairs here,
ours' own work in a step (``optimizer.synchronize()``) is also timed alone.

    python bench/train_synthetic.py [--iters 10] [--batches-per-iter 5] [--batch-size 32]
"""

from __future__ import annotations

import argparse
import math
import statistics
import time


def _net():
    import torch.nn as nn

    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.Conv2d(64, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(64 * 8 * 8, 256), nn.ReLU(), nn.Linear(256, 10))


def run(modes: tuple, iters: int, batches_per_iter: int, batch_size: int, warmup: int = 3) -> dict:
    """One process's img/s per timed iteration for each mode ("plain", "ddp", "ours"), alternating."""
    import torch

    import sparkhvd.collective.torch as hvd

    hvd.init()
    torch.set_num_threads(max(1, torch.get_num_threads() // hvd.local_size()))
    data = torch.randn(batch_size, 3, 32, 32)
    target = torch.randint(0, 10, (batch_size,))
    steps, optimizers = {}, {}
    torch.manual_seed(0)
    shared = _net()  # plain and ours train the same model object: two copies differ by ~5% here on their own
    for mode in modes:
        torch.manual_seed(0)
        model = _net() if mode == "ddp" else shared
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        if mode == "ours":
            opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
            hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        elif mode == "ddp":
            model = torch.nn.parallel.DistributedDataParallel(model)

        optimizers[mode] = opt

        def step(model=model, opt=opt):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(data), target).backward()
            opt.step()
        steps[mode] = step
    for step in steps.values():
        for _ in range(warmup):
            step()
    rates: dict = {mode: [] for mode in modes}
    for i in range(iters):
        for mode in (modes if i % 2 == 0 else modes[::-1]):
            start = time.perf_counter()
            for _ in range(batches_per_iter):
                steps[mode]()
            rates[mode].append(batch_size * batches_per_iter / (time.perf_counter() - start))
    if hvd.size() == 1 and "ours" in modes:  # ours' own work in a step, timed alone
        steps["ours"]()
        start = time.perf_counter()
        for _ in range(1000):
            optimizers["ours"].synchronize()
        rates["synchronize_us"] = (time.perf_counter() - start) * 1e3
    return rates


def _spread(values) -> tuple:
    """(mean, 1.96 sigma): Horovod's reporting."""
    mean = statistics.mean(values)
    return mean, 1.96 * (statistics.stdev(values) if len(values) > 1 else 0.0)


def _interval(values) -> tuple:
    """(mean, half-width of a 95% confidence interval of the mean)."""
    mean = statistics.mean(values)
    return mean, 1.96 * (statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else 0.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--batches-per-iter", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=32)
    args = parser.parse_args()
    import os

    import torch

    from sparkhvd import HorovodRunner

    kw = dict(iters=args.iters, batches_per_iter=args.batches_per_iter, batch_size=args.batch_size)
    one = HorovodRunner(np=-1, driver_log_verbosity="log_callback_only").run(run, modes=("plain", "ours"), **kw)
    per_rank = HorovodRunner(np=-2, driver_log_verbosity="log_callback_only").run_all(run, modes=("ddp", "ours"), **kw)
    two = {mode: [sum(r) for r in zip(*(ranks[mode] for ranks in per_rank.values))]  # both ranks, per iteration
           for mode in ("ddp", "ours")}
    rows = {"plain (np=1)": one["plain"], "ours (np=1)": one["ours"], "ddp (np=2)": two["ddp"],
            "ours (np=2)": two["ours"]}
    print(f"\n## synthetic training, conv net on 3x32x32, batch {args.batch_size} per rank, "
          f"{args.iters} iterations of {args.batches_per_iter} batches, paired configurations alternating\n")
    print("| configuration | total img/s (mean +- 1.96 sigma) |")
    print("|---|---|")
    for name, rates in rows.items():
        print("| {} | {:.1f} +- {:.1f} |".format(name, *_spread(rates)))
    vs_ddp = _interval([o / d for o, d in zip(two["ours"], two["ddp"])])
    overhead = _interval([100 * (1 - o / p) for o, p in zip(one["ours"], one["plain"])])
    scaling = statistics.mean(two["ours"]) / statistics.mean(one["ours"])
    print("\n| paired, per iteration | mean | 95% interval | target |")
    print("|---|---|---|---|")
    print("| ours / ddp at np=2 | {:.3f} | +- {:.3f} | >= 1.0 |".format(*vs_ddp))
    print("| ours' overhead against plain at np=1 | {:.1f}% | +- {:.1f}% | <= 3% |".format(*overhead))
    step_us = 1e6 * args.batch_size / statistics.mean(one["plain"])
    print(f"\nat np=1 ours' own work in a step (optimizer.synchronize(), timed alone): "
          f"{one['synchronize_us']:.1f} us, {100 * one['synchronize_us'] / step_us:.3f}% of a plain step")
    print(f"scaling ours np=2 / np=1 = {scaling:.2f}")
    print(f"machine: {os.cpu_count()} CPUs, torch {torch.__version__}, threads per process split by local_size")


if __name__ == "__main__":
    main()
