"""Benchmark (not a test): does backward wait on a slow peer?

np=2 (HorovodRunner(np=-2)). Each step, rank 1 sleeps ``--delay-ms`` before its backward pass
(a straggler: a slow data loader, a GC pause); rank 0 times its own ``loss.backward()``. With
sparkhvd's DistributedOptimizer the gradient hooks only submit their buckets to the engine, so
rank 0's backward should take as long as with no delay, and the wait moves to ``step()``.
The peer in the same processes is torch DDP on the same gloo group, whose backward ends by
waiting for its buckets' allreduces. Steps of the two alternate.

    python bench/overlap.py [--steps 20] [--delay-ms 50]
"""

from __future__ import annotations

import argparse
import statistics


def measure(steps: int, delay_ms: float):
    import copy
    import time

    import torch
    import torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel

    import sparkhvd.collective.torch as hvd

    hvd.init()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))
    ours = copy.deepcopy(base)
    ours_opt = hvd.DistributedOptimizer(torch.optim.SGD(ours.parameters(), lr=0.01),
                                        named_parameters=ours.named_parameters())
    ddp = DistributedDataParallel(copy.deepcopy(base))
    ddp_opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    x, y = torch.randn(64, 512), torch.randint(0, 10, (64,))
    times = {(kind, delay): [] for kind in ("ours", "ddp") for delay in (0.0, delay_ms)}
    for step in range(steps + 2):
        for delay in (0.0, delay_ms):
            for kind in (("ours", "ddp") if step % 2 else ("ddp", "ours")):
                model, opt = (ours, ours_opt) if kind == "ours" else (ddp, ddp_opt)
                opt.zero_grad()
                loss = nn.functional.cross_entropy(model(x), y)
                hvd.barrier()
                if hvd.rank() == 1:
                    time.sleep(delay / 1000)
                started = time.perf_counter()
                loss.backward()
                took = time.perf_counter() - started
                opt.step()
                if step >= 2:  # warm-up
                    times[kind, delay].append(took)
    return {f"{k[0]}|{k[1]}": v for k, v in times.items()} if hvd.rank() == 0 else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--delay-ms", type=float, default=50.0)
    args = parser.parse_args()

    from sparkhvd import HorovodRunner

    times = HorovodRunner(np=-2).run(measure, steps=args.steps, delay_ms=args.delay_ms)
    median = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    print(f"\n## rank 0's backward time while rank 1 sleeps {args.delay_ms:.0f} ms before its own, median of "
          f"{args.steps} steps (ms)\n")
    print("| | no delay | rank 1 delayed | delayed / not | ours / ddp (delayed) |")
    print("|---|---|---|---|---|")
    for kind in ("ours", "ddp"):
        plain, late = median[f"{kind}|0.0"], median[f"{kind}|{args.delay_ms}"]
        ratio = late / median[f"ddp|{args.delay_ms}"]
        print(f"| {kind} | {plain:.1f} | {late:.1f} | {late / plain:.2f} | {ratio:.2f} |")


if __name__ == "__main__":
    main()
