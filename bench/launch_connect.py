"""Benchmark (not a test): the warm launch under a Spark Connect session, ours against TorchDistributor.

One real Spark Connect server (the pip pyspark's ``SparkConnectServer`` on ``local[2]``, bound to 127.0.0.1:
tests/_connect_server.py) and one client session on it; this process holds no SparkContext. In the same run:

- ours:  ``HorovodRunner(np=2, driver_log_verbosity="log_callback_only").run(fn)``
         (runner/_backends/connect.py: ``mapInArrow(..., barrier=True)``, ranks forked from the warm process)
- peer:  ``TorchDistributor(num_processes=2, local_mode=False, use_gpu=False).run(fn)``, which pyspark runs
         under Connect the same way (SPARK-42993)
- floor: a bare barrier stage, ``spark.range(0, 2, 1, 2).mapInArrow(fn, "x long", barrier=True).collect()``

``fn`` forms a gloo group, as bench/launch.py's ``--fn init``: ours ``hvd.init()``, the peer
``init_process_group("gloo")``. One warm-up run of each, then ``--reps`` runs interleaved (the order
reversed every other round). Prints median, min and max seconds and ours/TorchDistributor on the medians
(target <= 0.10). About two minutes on 2 CPUs, nearly all of it TorchDistributor. Needs pandas (the
``bench`` extra) and pyspark[connect]'s client (the ``test`` extra).

    python bench/launch_connect.py [--reps 5]
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(ROOT, "bench"), os.path.join(ROOT, "tests")]

import cloudpickle  # noqa: E402
import launch  # noqa: E402 - bench/launch.py: the same functions and the TorchDistributor peer
from _connect_server import connect_server  # noqa: E402 - tests/_connect_server.py
from pyspark import cloudpickle as spark_cloudpickle  # noqa: E402 - TorchDistributor pickles with pyspark's copy

for _pickler in (cloudpickle, spark_cloudpickle):  # its functions run on executors, which cannot import bench/
    _pickler.register_pickle_by_value(launch)


def floor_of(spark):
    def fn(batches):
        import pyarrow as pa

        for _ in batches:
            pass
        yield pa.RecordBatch.from_pydict({"x": [1]})

    def floor():
        rows = spark.range(0, launch.NP, 1, launch.NP).mapInArrow(fn, "x long", barrier=True).collect()
        assert len(rows) == launch.NP, rows

    return floor


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=5, help="timed runs of each (default 5)")
    args = parser.parse_args()
    pandas = launch.require_pandas()
    from pyspark.sql import SparkSession

    wall = time.perf_counter()
    with connect_server() as url:
        spark = SparkSession.builder.remote(url).getOrCreate()
        try:
            launches = {"ours": launch.make_ours(), "TorchDistributor": launch.make_peer(), "floor": floor_of(spark)}
            times: dict[str, list[float]] = {name: [] for name in launches}
            first = {name: launch.timed(fn) for name, fn in launches.items()}
            for rep in range(args.reps):
                order = list(launches) if rep % 2 == 0 else list(reversed(launches))
                for name in order:
                    times[name].append(launch.timed(launches[name]))
                print(f"rep {rep + 1}/{args.reps}: " + ", ".join(f"{n} {times[n][-1]:.2f} s" for n in launches),
                      file=sys.stderr, flush=True)
        finally:
            spark.stop()
    for folder in launch.LOG_DIRS:
        shutil.rmtree(folder, ignore_errors=True)
    import pyspark
    import torch

    print(f"\n## Warm launch under Spark Connect (server on local[2], np={launch.NP}, fn: form a gloo group): "
          f"seconds, median (min-max) of {args.reps}\n")
    rows = [[name, f"{first[name]:.2f}", f"{statistics.median(t):.2f} ({min(t):.2f}-{max(t):.2f})"]
            for name, t in times.items()]
    print(launch.table(["launch", "first run", "warm"], rows))
    ratio = statistics.median(times["ours"]) / statistics.median(times["TorchDistributor"])
    print(f"\nours / TorchDistributor (warm medians): {ratio:.3f} (target <= {launch.TARGET_RATIO:.2f})")
    print(f"\nmachine: {os.cpu_count()} CPUs ({platform.machine()}), python {platform.python_version()}, torch "
          f"{torch.__version__}, pyspark {pyspark.__version__}, {pandas}; whole benchmark "
          f"{time.perf_counter() - wall:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
