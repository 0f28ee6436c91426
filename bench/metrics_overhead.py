"""Benchmark (not a test): what the per-rank metrics cost training (issue 40: goal >= 0.99 of the steps/s without).

One ``HorovodRunner(np=-2)`` run per job, of a function that imports torch, calls ``hvd.init()`` and trains with
``hvd.DistributedOptimizer``. Inside the ranks, blocks of ``--steps`` steps with the counters on and off alternate
(``--rounds`` of each, the order swapped every other round; off: ``metrics.ON`` false and torch's step hook removed,
what ``SPARKHVD_METRICS=0`` gives a rank), so that both sides share the processes and the machine's drift: separate
runs differ by +-10% here on their own. The heartbeat, every 5 s as users run, sends its snapshot in both. Two jobs:
a small MLP, whose fast steps feel a per-step cost most, and the ResNet-style conv net of bench/train_synthetic.py.
Prints rank 0's steps/s medians, the paired ratios, and one whole run's metrics rows.

    python bench/metrics_overhead.py [--rounds 15] [--steps 200] [--conv-steps 20]
"""
from __future__ import annotations

import argparse
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


def train(job: str, steps: int, rounds: int, warmup: int = 20) -> dict:
    """Rank's steps/s per block of ``steps`` steps of ``job`` ("mlp" or "conv"), with the counters on and off."""
    import torch

    import sparkhvd.collective.torch as hvd
    from sparkhvd._common import metrics
    from sparkhvd.runner._rank import steps as counted

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

    def counters(on: bool) -> None:
        metrics.ON = on
        if on and counted.hook is None:
            counted._register(torch)
        elif not on and counted.hook is not None:
            counted.hook.remove()
            counted.hook = None

    for _ in range(warmup):
        step()
    rates: dict = {True: [], False: []}
    for i in range(rounds):
        for on in ((True, False) if i % 2 == 0 else (False, True)):
            counters(on)
            hvd.barrier()  # both ranks switch together
            start = time.perf_counter()
            for _ in range(steps):
                step()
            rates[on].append(steps / (time.perf_counter() - start))
    counters(True)
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--conv-steps", type=int, default=20)
    args = parser.parse_args()
    from sparkhvd import HorovodRunner

    rows = []
    for job, steps in (("mlp", args.steps), ("conv", args.conv_steps)):
        result = HorovodRunner(np=-2, driver_log_verbosity="log_callback_only").run_all(
            train, job=job, steps=steps, rounds=args.rounds)
        rates = result.values[0]
        pairs = [a / b for a, b in zip(rates[True], rates[False])]
        rows.append((job, statistics.median(rates[True]), statistics.median(rates[False]), pairs,
                     sum(len(r) for r in result.metrics.values())))
    print("| job | steps/s on (median) | steps/s off (median) | on / off, medians | on / off, paired blocks "
          "(median, range) | blocks | metrics rows in the run |")
    print("|---|---|---|---|---|---|---|")
    for job, on, off, pairs, seen in rows:
        print(f"| {job} | {on:.1f} | {off:.1f} | {on / off:.3f} | {statistics.median(pairs):.3f} "
              f"({min(pairs):.3f}-{max(pairs):.3f}) | {len(pairs)} | {seen} |")
    worst = min(statistics.median(pairs) for _, _, _, pairs, _ in rows)
    print(f"\nworst paired on / off: {worst:.3f}   goal >= 0.99: {'met' if worst >= 0.99 else 'not met'}")


if __name__ == "__main__":
    main()
