"""Benchmark (not a test): allreduce bandwidth, ours against raw torch.distributed on one gloo group.

Runs np=2 rank processes on this machine (HorovodRunner(np=-2)). For fp32 tensors from 4 KB to
256 MB it times, interleaved on the same process group:
  raw    dist.all_reduce(t)                          (in place, sum)
  ours_  hvd.allreduce_(t, op=hvd.Sum)               (in place, sum; negotiated by the engine)
  ours   hvd.allreduce(t)                            (out of place, average: Horovod's default)
  copy   u = t.clone(); dist.all_reduce(u); u /= n   (raw torch doing what ours does)
  turns_ hvd.allreduce_ through the engine's turns    (up to 1 MB: without the pair path in the calling thread,
                                                      ``Engine.pair_now``, i.e. as before it)
and prints the median time and bus bandwidth (2(n-1)/n * bytes / time) with ratios ours/raw
(target >= 0.95); the out-of-place op is also compared with ``copy``, which pays the same
fresh allocation (on Linux, glibc maps blocks over 32 MB afresh each time: page faults).
Then the gradient set of a ResNet-50 (161 tensors, ~100 MB, shapes only) reduced one allreduce
per tensor against one fused grouped_allreduce (target fused/unfused <= 0.5), and raw gloo's one
all_reduce per tensor for reference.

    python bench/allreduce.py [--max-mb 256] [--reps 5]
"""

from __future__ import annotations

import argparse
import statistics
import time


def resnet50_shapes() -> list:
    """The parameter shapes of torchvision's ResNet-50 (161 tensors), without torchvision."""
    shapes = [(64, 3, 7, 7), (64,), (64,)]
    inplanes = 64
    for planes, blocks in ((64, 3), (128, 4), (256, 6), (512, 3)):
        for b in range(blocks):
            shapes += [(planes, inplanes, 1, 1), (planes,), (planes,), (planes, planes, 3, 3), (planes,), (planes,),
                       (planes * 4, planes, 1, 1), (planes * 4,), (planes * 4,)]
            if b == 0:
                shapes += [(planes * 4, inplanes, 1, 1), (planes * 4,), (planes * 4,)]
            inplanes = planes * 4
    shapes += [(1000, 2048), (1000,)]
    return shapes


def measure(max_mb: int, reps: int):
    import torch
    import torch.distributed as dist

    import sparkhvd.collective.torch as hvd
    from sparkhvd.collective._engine import communicator as _engine

    hvd.init()
    torch.set_num_threads(1)
    engine = _engine.engine()

    def through_turns(t):
        engine.fast_path = False
        try:
            hvd.allreduce_(t, op=hvd.Sum)
        finally:
            engine.fast_path = True

    def raw_copy(t):
        u = t.clone()
        dist.all_reduce(u)
        return u.div_(hvd.size())

    def timed(fn):
        hvd.barrier()
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    rows = []
    size = 4096
    while size <= max_mb * 2 ** 20:
        t = torch.ones(size // 4)
        calls = {"raw": lambda: dist.all_reduce(t), "ours_": lambda: hvd.allreduce_(t, op=hvd.Sum),
                 "ours": lambda: hvd.allreduce(t), "copy": lambda: raw_copy(t)}
        if size <= 2 ** 20:
            calls["turns_"] = lambda: through_turns(t)
        runs = {k: [] for k in calls}
        inner = max(1, min(200, (64 * 2 ** 20) // size))  # repeat small sizes for timer resolution
        for k in list(calls):
            calls[k]()  # warm up
        for rep in range(reps):
            order = list(calls) if rep % 2 == 0 else list(reversed(calls))
            for k in order:
                runs[k].append(timed(lambda: [calls[k]() for _ in range(inner)]) / inner)
        rows.append((size, {k: statistics.median(v) for k, v in runs.items()}))
        size *= 4
    grads = [torch.ones(s) for s in resnet50_shapes()]
    nbytes = sum(g.numel() * 4 for g in grads)
    fusion = {"unfused": [], "fused": [], "raw": []}
    ways = {"unfused": lambda: [hvd.allreduce_(g, op=hvd.Sum) for g in grads],
            "fused": lambda: hvd.grouped_allreduce_(grads, op=hvd.Sum),
            "raw": lambda: [dist.all_reduce(g) for g in grads]}
    for rep in range(reps + 1):
        for k in (list(ways) if rep % 2 == 0 else list(reversed(ways))):
            took = timed(ways[k])
            if rep:  # the first round warms up
                fusion[k].append(took)
    return {"rows": rows, "fusion": {k: statistics.median(v) for k, v in fusion.items()}, "n": hvd.size(),
            "tensors": len(grads), "bytes": nbytes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-mb", type=int, default=256)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    import os

    import torch

    from sparkhvd import HorovodRunner

    result = HorovodRunner(np=-2, driver_log_verbosity="log_callback_only").run(measure, max_mb=args.max_mb,
                                                                                 reps=args.reps)
    n = result["n"]

    def busbw(nbytes, seconds):
        return 2 * (n - 1) / n * nbytes / seconds / 1e9

    print(f"\n## allreduce of fp32 at np={n} on one gloo group (loopback), median of {args.reps}\n")
    print("| size | raw all_reduce GB/s | ours allreduce_ (Sum) | ratio | raw us | ours_ us | ours_ through the turns us "
          "| turns_ / ours_ | ours allreduce (Average, new tensor) | ratio | raw clone+all_reduce+div | ours/that |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for size, t in result["rows"]:
        label = f"{size // 1024} KB" if size < 2 ** 20 else f"{size // 2 ** 20} MB"
        raw, inplace, ours, copy = (busbw(size, t[k]) for k in ("raw", "ours_", "ours", "copy"))
        turns = (f"{t['turns_'] * 1e6:.0f} | {t['turns_'] / t['ours_']:.2f}" if "turns_" in t else "- | -")
        print(f"| {label} | {raw:.3f} | {inplace:.3f} | {inplace / raw:.2f} | {t['raw'] * 1e6:.0f} | "
              f"{t['ours_'] * 1e6:.0f} | {turns} "
              f"| {ours:.3f} | {ours / raw:.2f} | {copy:.3f} | {ours / copy:.2f} |")
    f = result["fusion"]
    print(f"\n## ResNet-50 gradient set ({result['tensors']} tensors, {result['bytes'] / 1e6:.1f} MB), median of "
          f"{args.reps}\n")
    print("| one allreduce_ per tensor | grouped_allreduce_ (fused) | fused / unfused "
          "| raw dist.all_reduce per tensor | fused / that |")
    print("|---|---|---|---|---|")
    print(f"| {f['unfused'] * 1e3:.1f} ms | {f['fused'] * 1e3:.1f} ms | {f['fused'] / f['unfused']:.2f} "
          f"| {f['raw'] * 1e3:.1f} ms | {f['fused'] / f['raw']:.2f} |")
    print(f"\nmachine: {os.cpu_count()} CPUs, torch {torch.__version__}; targets: ratio >= 0.95, fused/unfused <= 0.5")


if __name__ == "__main__":
    main()
