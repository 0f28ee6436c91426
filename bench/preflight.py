"""Benchmark (not a test): what the executor pre-flight costs before each Spark launch.

One ``local[n]`` SparkSession (``spark.ui.enabled=false``, ``PYSPARK_PYTHON`` = this interpreter) runs,
in the same process:

- first:  ``check_executors`` right after the session starts (it starts Spark's Python workers,
  which the barrier stage would otherwise start)
- warm:   ``check_executors`` with its cache cleared (a new executor set), median of ``--reps``
- cached: ``check_executors`` again (what every later ``run()`` on the same executors pays)
- peer:   ``sc.parallelize(range(n), n).count()`` on the warm session, the floor of any Spark job

Prints median, min and max seconds and the ratio of each median to the peer's (the first pre-flight's to the
peer's first job in another new session of the same process).

    python bench/preflight.py
    python bench/preflight.py --np 2 --reps 15
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time


def timed(fn, reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--np", type=int, default=2)
    parser.add_argument("--reps", type=int, default=11)
    args = parser.parse_args()
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    from pyspark.sql import SparkSession

    from sparkhvd.runner._backends import preflight as _preflight

    def session():
        spark = (SparkSession.builder.master(f"local[{args.np}]").appName("sparkhvd-bench-preflight")
                 .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false").getOrCreate())
        spark.sparkContext.setLogLevel("ERROR")
        return spark

    n = args.np
    spark = session()  # the peer's first job in a new session, for the first pre-flight's row
    try:
        first_count = timed(lambda: spark.sparkContext.parallelize(range(n), n).count(), 1)
    finally:
        spark.stop()
    spark = session()
    sc = spark.sparkContext
    try:
        check = lambda: _preflight.check_executors(sc, n, n)  # noqa: E731

        def uncached():
            _preflight._checked.clear()
            check()

        rows = {"pre-flight, first in a new session": timed(uncached, 1)}
        rows["pre-flight, warm (cache cleared)"] = timed(uncached, args.reps)
        rows["pre-flight, cached (a later run())"] = timed(check, args.reps)
        rows[f"peer: sc.parallelize(range({n}), {n}).count()"] = timed(lambda: sc.parallelize(range(n), n).count(),
                                                                       args.reps)
    finally:
        spark.stop()
    peer = statistics.median(list(rows.values())[-1])
    rows["peer: the same count, first in a new session"] = first_count
    width = max(map(len, rows))
    print(f"{'':{width}}  {'median s':>9} {'min s':>8} {'max s':>8} {'vs peer':>8}")
    for i, (name, times) in enumerate(rows.items()):
        med = statistics.median(times)
        against = first_count[0] if i == 0 else peer  # first against first, warm against warm
        print(f"{name:{width}}  {med:9.4f} {min(times):8.4f} {max(times):8.4f} {med / against:7.2f}x")
    print(f"# {args.reps} reps, local[{n}], Python {platform.python_version()}, {os.cpu_count()} CPUs, "
          f"{platform.machine()} {platform.system()}")


if __name__ == "__main__":
    main()
