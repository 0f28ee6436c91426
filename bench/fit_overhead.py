"""Benchmark (not a test): the time ``TorchEstimator.fit`` adds over a hand-written HorovodRunner loop on the same data.

One ``local[2]`` SparkSession and a cached DataFrame of ``--rows`` rows (a 32-float ML vector and a label). The
peer is what a user writes without the estimator: ``make_spark_converter(df)`` once, then
``HorovodRunner(np=2).run(train)`` where ``train`` builds the same MLP and SGD optimizer, wraps it in
``hvd.DistributedOptimizer``, reads its shard with ``make_batch_reader`` (``batch_size``, a shuffled pass per
epoch) and returns rank 0's weights. Ours is ``TorchEstimator(num_proc=2, ...).fit(df)`` with the same model,
batch size and epochs, after a first fit of the same DataFrame (so its Parquet is written already: the fit
must write none, which the script checks by listing the store's data folder before and after). Both run
``--reps`` times, alternating, after one warm-up each; the table gives the best and median seconds and
ours / the peer's. What the estimator adds: the checks and the dry run on the driver, the model file in the
store, the last epoch's checkpoint (one per epoch only where a ``run_id`` or ``max_restarts`` may resume from it), the
fitted model written and loaded back.

    python bench/fit_overhead.py                  # 20k rows, 3 epochs, 3 reps: about a minute on 2 cores
    python bench/fit_overhead.py --rows 100000 --epochs 5
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time

DIM = 32


def make_net():
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(DIM, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))


def hand_written(url: str, epochs: int, batch_size: int, make):
    import torch

    import sparkhvd.collective.torch as hvd
    from sparkhvd.data import make_batch_reader

    hvd.init()
    model = make()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01 * hvd.size()),
                                   named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    for epoch in range(epochs):
        with make_batch_reader(url, num_epochs=1, seed=epoch, batch_size=batch_size, shuffle_rows=True,
                               workers_count=2) as reader:
            for batch in reader:
                x = torch.from_numpy(batch.features.copy())
                y = torch.from_numpy(batch.y.copy()).reshape(-1, 1)
                opt.zero_grad()
                torch.nn.functional.mse_loss(model(x), y).backward()
                opt.step()
    return model.state_dict() if hvd.rank() == 0 else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=20_000)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)

    import numpy as np
    import torch
    from pyspark.ml.linalg import Vectors
    from pyspark.sql import SparkSession

    from sparkhvd import HorovodRunner
    from sparkhvd.data import make_spark_converter
    from sparkhvd.ml import Store, TorchEstimator

    root = tempfile.mkdtemp(prefix="sparkhvd-bench-fit-")
    spark = (SparkSession.builder.master("local[2]").config("spark.ui.enabled", "false")
             .config("spark.ui.showConsoleProgress", "false").getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    try:
        rng = np.random.default_rng(0)
        x = rng.normal(size=(args.rows, DIM))
        y = x @ rng.normal(size=DIM)
        df = spark.createDataFrame([(Vectors.dense(x[i]), float(y[i])) for i in range(args.rows)], ["features", "y"])
        df = df.cache()
        df.count()
        store = Store.create(os.path.join(root, "store"))
        converter = make_spark_converter(df, parent_cache_dir_url=f"file://{root}/peer")

        def peer() -> None:
            HorovodRunner(np=2, driver_log_verbosity="log_callback_only").run(
                hand_written, url=converter.cache_dir_url, epochs=args.epochs, batch_size=args.batch_size,
                make=make_net)

        def ours() -> None:
            net = make_net()
            TorchEstimator(num_proc=2, store=store, model=net, optimizer=torch.optim.SGD(net.parameters(), lr=0.01),
                           loss=torch.nn.functional.mse_loss, feature_cols=["features"], label_cols=["y"],
                           batch_size=args.batch_size, epochs=args.epochs, verbose=0).fit(df)

        data = os.path.join(root, "store", "intermediate_train_data")
        peer()
        ours()  # the warm-ups; this first fit writes the Parquet
        written = sorted(os.listdir(data))
        times: dict[str, list[float]] = {"hand-written HorovodRunner loop": [], "TorchEstimator.fit": []}
        for _ in range(args.reps):
            for name, run in (("hand-written HorovodRunner loop", peer), ("TorchEstimator.fit", ours)):
                start = time.perf_counter()
                run()
                times[name].append(time.perf_counter() - start)
        again = sorted(os.listdir(data))
    finally:
        spark.stop()
        shutil.rmtree(root, ignore_errors=True)

    peer_times, our_times = times["hand-written HorovodRunner loop"], times["TorchEstimator.fit"]
    print(f"fit overhead: {args.rows} rows, {args.epochs} epochs, batch {args.batch_size}, np=2 on local[2]; "
          f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}; best and median of {args.reps}")
    print(f"{'':34} | {'best s':>7} | {'median s':>8} | ours / peer (best, median)")
    for name, values in times.items():
        ratio = ""
        if values is our_times:
            ratio = (f"{min(our_times) / min(peer_times):.2f}, "
                     f"{statistics.median(our_times) / statistics.median(peer_times):.2f}")
        print(f"{name:34} | {min(values):7.2f} | {statistics.median(values):8.2f} | {ratio}")
    same = written == again
    print(f"Parquet written by the later fits of the same DataFrame: {'none' if same else sorted(set(again) - set(written))}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
