"""Benchmark (not a test): what the per-rank metrics cost training (issue 40: goal >= 0.99 of the steps/s without).

Each run is ``HorovodRunner(np=-2)`` of a function that imports torch, calls ``hvd.init()`` and trains with
``hvd.DistributedOptimizer`` for ``--steps`` timed steps after a warm-up; its steps/s is rank 0's. Runs with metrics
on (the default) and off (``SPARKHVD_METRICS=0``: nothing counted, nothing sent) alternate, ``--rounds`` of each,
for two jobs: a small MLP, whose fast steps feel a per-step cost most, and the ResNet-style conv net of
bench/train_synthetic.py. Heartbeats at their default 5 s, as users run. Prints the medians and their ratio.

    python bench/metrics_overhead.py [--rounds 5] [--steps 300]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time


def _mlp():
    import torch.nn as nn

    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10))


def _conv():
    import torch.nn as nn

    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.Conv2d(64, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(64 * 8 * 8, 256), nn.ReLU(), nn.Linear(256, 10))


def train(job: str, steps: int, warmup: int = 20) -> float:
    """Rank's steps/s over ``steps`` steps of ``job`` ("mlp" or "conv")."""
    import torch

    import sparkhvd.collective.torch as hvd

    hvd.init()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = _mlp() if job == "mlp" else _conv()
    data = torch.randn(32, 64) if job == "mlp" else torch.randn(16, 3, 32, 32)
    target = torch.randint(0, 10, (data.shape[0],))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                   named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)

    def step():
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(data), target).backward()
        opt.step()

    for _ in range(warmup):
        step()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    return steps / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--conv-steps", type=int, default=40)
    args = parser.parse_args()
    from sparkhvd import HorovodRunner

    rates: dict = {}
    rows_seen: dict = {}
    pairs: dict = {}  # each round's on / off: the two runs next to each other
    for job, steps in (("mlp", args.steps), ("conv", args.conv_steps)):
        for i in range(args.rounds):
            for on in ((True, False) if i % 2 == 0 else (False, True)):  # the order swapped every other round
                os.environ["SPARKHVD_METRICS"] = "1" if on else "0"
                result = HorovodRunner(np=-2, driver_log_verbosity="log_callback_only").run_all(train, job=job,
                                                                                              steps=steps)
                rates.setdefault((job, on), []).append(result.values[0])
                rows_seen.setdefault((job, on), []).append(sum(len(r) for r in result.metrics.values()))
            pairs.setdefault(job, []).append(rates[(job, True)][-1] / rates[(job, False)][-1])
    os.environ.pop("SPARKHVD_METRICS", None)
    print("| job | metrics | steps/s (median) | runs | metrics rows per run | on / off, medians | on / off, paired "
          "rounds (median, range) |")
    print("|---|---|---|---|---|---|---|")
    for job in ("mlp", "conv"):
        on, off = statistics.median(rates[(job, True)]), statistics.median(rates[(job, False)])
        for flag, rate in ((True, on), (False, off)):
            ratio = f"{on / off:.3f}" if flag else ""
            paired = (f"{statistics.median(pairs[job]):.3f} ({min(pairs[job]):.3f}-{max(pairs[job]):.3f})"
                      if flag else "")
            print(f"| {job} | {'on' if flag else 'off'} | {rate:.1f} | {len(rates[(job, flag)])} | "
                  f"{statistics.median(rows_seen[(job, flag)]):g} | {ratio} | {paired} |")
    worst = min(statistics.median(pairs[j]) for j in ("mlp", "conv"))
    print(f"\nworst paired on / off: {worst:.3f}   goal >= 0.99: {'met' if worst >= 0.99 else 'not met'}")


if __name__ == "__main__":
    main()
