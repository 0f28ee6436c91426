"""Benchmark (not a test): Horovod's synthetic training protocol on a CPU-sized conv net.

A fixed random batch, warm-up batches, then ``--iters`` timed iterations of
``--batches-per-iter`` batches; img/s per iteration, reported as mean +- 1.96 sigma (as
Horovod's pytorch_synthetic_benchmark.py does). In one run, on this machine:

  plain   torch alone, one process
  ours-1  HorovodRunner(np=-1) + hvd.DistributedOptimizer
  ddp-2   HorovodRunner(np=-2) + torch DDP on the same gloo process group hvd.init() built
  ours-2  HorovodRunner(np=-2) + hvd.DistributedOptimizer

Targets: ours-2 / ddp-2 >= 1.0 (total img/s), ours-1 overhead against plain <= 3%.

    python bench/train_synthetic.py [--iters 5] [--batches-per-iter 5] [--batch-size 32]
"""

from __future__ import annotations

import argparse
import statistics
import time


def _net():
    import torch.nn as nn

    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.Conv2d(64, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(64 * 8 * 8, 256), nn.ReLU(), nn.Linear(256, 10))


def run(mode: str, iters: int, batches_per_iter: int, batch_size: int, warmup: int = 3):
    """One process's img/s per timed iteration."""
    import torch

    torch.manual_seed(0)
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    if mode in ("ours", "ddp"):
        import sparkhvd.collective.torch as hvd

        hvd.init()
        torch.set_num_threads(max(1, torch.get_num_threads() // hvd.local_size()))
        if mode == "ours":
            opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
            hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        else:
            model = torch.nn.parallel.DistributedDataParallel(model)
    data = torch.randn(batch_size, 3, 32, 32)
    target = torch.randint(0, 10, (batch_size,))

    def step():
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(data), target).backward()
        opt.step()

    for _ in range(warmup):
        step()
    rates = []
    for _ in range(iters):
        start = time.perf_counter()
        for _ in range(batches_per_iter):
            step()
        rates.append(batch_size * batches_per_iter / (time.perf_counter() - start))
    return rates


def _stats(rates):
    mean = statistics.mean(rates)
    return mean, 1.96 * (statistics.stdev(rates) if len(rates) > 1 else 0.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--batches-per-iter", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2, help="alternate the configurations this many times")
    args = parser.parse_args()
    import os

    import torch

    from sparkhvd import HorovodRunner

    kw = dict(iters=args.iters, batches_per_iter=args.batches_per_iter, batch_size=args.batch_size)
    totals: dict = {"plain": [], "ours-1": [], "ddp-2": [], "ours-2": []}
    for _ in range(args.rounds):  # interleaved so drift on a shared machine hits all alike
        totals["plain"] += HorovodRunner(np=-1, driver_log_verbosity="log_callback_only").run(run, mode="plain", **kw)
        totals["ours-1"] += HorovodRunner(np=-1, driver_log_verbosity="log_callback_only").run(run, mode="ours", **kw)
        for name, mode in (("ddp-2", "ddp"), ("ours-2", "ours")):
            per_rank = HorovodRunner(np=-2, driver_log_verbosity="log_callback_only").run_all(run, mode=mode, **kw)
            totals[name] += [sum(r) for r in zip(*per_rank.values)]  # both ranks' img/s, iteration by iteration
    print(f"\n## synthetic training, conv net on 3x32x32, batch {args.batch_size} per rank, "
          f"{args.rounds}x{args.iters} iterations of {args.batches_per_iter} batches\n")
    print("| configuration | total img/s (mean +- 1.96 sigma) |")
    print("|---|---|")
    means = {}
    for name, rates in totals.items():
        means[name], ci = _stats(rates)
        print(f"| {name} | {means[name]:.1f} +- {ci:.1f} |")
    print(f"\nours-2 / ddp-2 = {means['ours-2'] / means['ddp-2']:.3f} (target >= 1.0); "
          f"ours-1 overhead against plain = {100 * (1 - means['ours-1'] / means['plain']):.1f}% (target <= 3%); "
          f"scaling ours-2 / ours-1 = {means['ours-2'] / means['ours-1']:.2f}")
    print(f"machine: {os.cpu_count()} CPUs, torch {torch.__version__}, threads per process split by local_size")


if __name__ == "__main__":
    main()
