"""Benchmark (not a test): control traffic of the engine per op, as the job grows.

For np = 2, 4, 8 (HorovodRunner(np=-n); more ranks than this machine's cores is fine: the
table says so) every rank runs ``--ops`` blocking 4 KB allreduces, and reports the control
frames it sent (``PeerChannel.frames_sent``), their JSON bytes without the data
(``PeerChannel.meta_bytes_sent``), and the time per op. The engine's links are a star (each member
talks only to its set's coordinator), so a job of n ranks should send 2(n-1) frames per op, where
an all-to-all check (every rank telling every other) would send n(n-1). The table projects both to
64 and 1024 ranks. The
JSON bytes are measured twice: with the request cache (the default) and with
``HOROVOD_CACHE_CAPACITY=0`` (every request whole).

    python bench/control_scale.py [--ops 500] [--sizes 2,4,8]
"""

from __future__ import annotations

import argparse
import os


def measure(ops: int):
    import time

    import torch

    import sparkhvd.collective.torch as hvd
    from sparkhvd.collective._engine.channel import PeerChannel

    hvd.init()
    torch.set_num_threads(1)
    t = torch.ones(1024)
    for _ in range(20):
        hvd.allreduce_(t)
    hvd.barrier()
    before, meta_before = PeerChannel.frames_sent, PeerChannel.meta_bytes_sent
    started = time.perf_counter()
    for _ in range(ops):
        hvd.allreduce_(t)
    seconds = time.perf_counter() - started
    return PeerChannel.frames_sent - before, seconds, PeerChannel.meta_bytes_sent - meta_before


def run(n: int, ops: int, cache: bool) -> list:
    from sparkhvd import HorovodRunner

    if not cache:
        os.environ["HOROVOD_CACHE_CAPACITY"] = "0"  # the ranks started on the driver inherit it
    try:
        return HorovodRunner(np=-n).run_all(measure, ops=ops).values
    finally:
        os.environ.pop("HOROVOD_CACHE_CAPACITY", None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ops", type=int, default=500)
    parser.add_argument("--sizes", default="2,4,8")
    args = parser.parse_args()

    cores = os.cpu_count()
    print(f"\n## control frames per blocking 4 KB allreduce, {args.ops} ops, on {cores} cores\n")
    print("| np | frames per op (whole job) | 2(n-1) star | n(n-1) all-to-all | JSON bytes per op: cached / "
          "whole | ms per op (median rank) | ranks per core |")
    print("|---|---|---|---|---|---|---|")
    for n in (int(x) for x in args.sizes.split(",")):
        results = run(n, args.ops, cache=True)
        whole = run(n, args.ops, cache=False)
        frames = sum(r[0] for r in results) / args.ops
        per_op = sorted(r[1] for r in results)[n // 2] / args.ops * 1e3
        cached_bytes, whole_bytes = (sum(r[2] for r in rs) / args.ops for rs in (results, whole))
        print(f"| {n} | {frames:.2f} | {2 * (n - 1)} | {n * (n - 1)} | {cached_bytes:.0f} / {whole_bytes:.0f} | "
              f"{per_op:.3f} | {n / cores:.1f} |")
    print("\nprojected frames per op: " + ", ".join(f"np={n}: star {2 * (n - 1)}, all-to-all {n * (n - 1)}"
                                               for n in (64, 1024)))


if __name__ == "__main__":
    main()
