"""Benchmark (not a test): op=hvd.Adasum against op=hvd.Sum on the same tensor, np=2 and np=4, gloo.

Each np runs its ranks on this machine (HorovodRunner(np=-n)), one thread each. Rank 0 times, interleaved, the
median over ``--reps`` of one in-place ``hvd.allreduce_`` of a float32 tensor of ``--elements`` elements with:

  sum        op=hvd.Sum: one gloo allreduce (ring)
  adasum     op=hvd.Adasum: Horovod's vector halving, distance doubling (``halving_doubling``)
  reference  op=hvd.Adasum as before it: every rank allgathers the buffer and works out the whole tree
             (``HALVING_MIN_ELEMENTS`` raised past the tensor, in the same run)

and prints each with its ratio to sum (the issue's goal: adasum <= 2.5x sum at 4M elements).

    python bench/adasum.py [--elements 4194304] [--reps 5] [--np 2 4]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time


def measure(elements: int, reps: int) -> dict:
    import torch

    import sparkhvd.collective.torch as hvd
    from sparkhvd.collective._core import _adasum

    hvd.init()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(hvd.rank())
    base = torch.randn(elements, generator=g)
    halving_from = _adasum.HALVING_MIN_ELEMENTS

    def sum_():
        hvd.allreduce_(base.clone(), op=hvd.Sum)

    def adasum():
        _adasum.HALVING_MIN_ELEMENTS = halving_from
        hvd.allreduce_(base.clone(), op=hvd.Adasum)

    def reference():
        _adasum.HALVING_MIN_ELEMENTS = elements + 1  # every rank alike: the allgather and the whole tree
        hvd.allreduce_(base.clone(), op=hvd.Adasum)

    ways = {"sum": sum_, "adasum": adasum, "reference": reference}
    runs: dict = {k: [] for k in ways}
    for rep in range(reps + 1):
        for name in (list(ways) if rep % 2 == 0 else list(reversed(ways))):
            hvd.barrier()
            start = time.perf_counter()
            ways[name]()
            if rep:  # the first round warms up
                runs[name].append(time.perf_counter() - start)
    _adasum.HALVING_MIN_ELEMENTS = halving_from
    return {k: statistics.median(v) for k, v in runs.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--elements", type=int, default=4 * 2 ** 20)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--np", type=int, nargs="+", default=[2, 4])
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    from sparkhvd import HorovodRunner

    print(f"\n## Adasum against Sum, fp32, {args.elements} elements, gloo on one machine, median of {args.reps}\n")
    print("| np | sum ms | adasum ms | adasum / sum | reference (allgather + tree) ms | reference / sum |")
    print("|---|---|---|---|---|---|")
    for n in args.np:
        t = HorovodRunner(np=-n, driver_log_verbosity="log_callback_only").run(measure, elements=args.elements,
                                                                               reps=args.reps)
        print(f"| {n} | {t['sum'] * 1e3:.1f} | {t['adasum'] * 1e3:.1f} | {t['adasum'] / t['sum']:.2f} "
              f"| {t['reference'] * 1e3:.1f} | {t['reference'] / t['sum']:.2f} |")
    print(f"\nmachine: {os.cpu_count()} CPUs, torch {torch.__version__}; goal: adasum / sum <= 2.5")


if __name__ == "__main__":
    main()
