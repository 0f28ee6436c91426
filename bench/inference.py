"""Benchmark (not a test): ``TorchModel.transform`` against pyspark's ``predict_batch_udf`` and a pandas UDF.

One ``local[2]`` SparkSession (``spark.ui.enabled=false``, ``PYSPARK_PYTHON`` = this interpreter) builds a
DataFrame of ``--rows`` rows (default 200,000) holding 64 random floats per row twice, as ``array<float>``
(``features``) and as an ML vector (``vec``), caches and materializes it, then predicts with the same torch
MLP (64 -> ``--width`` -> ``--width`` -> 1, default width 256), on each column, three ways:

- ours:              ``TorchModel.transform(df)``; the model comes from a ``TorchEstimator(num_proc=-1)`` fit of
                     one step at ``lr=0`` (its weights stay the seeded initial ones), one fit per column kind
- predict_batch_udf: ``pyspark.ml.functions.predict_batch_udf(make_predict_fn, return_type=DoubleType(),
                     batch_size=1024, input_tensor_shapes=[[64]])``, ``make_predict_fn`` loading the model from
                     ``torch.save``d bytes in its closure, as pyspark's docs write it (a vector column goes through
                     ``vector_to_array(col, "float32")``, as ours does)
- pandas_udf:        Databricks' model-inference recipe: an ``Iterator[pd.Series] -> Iterator[pd.Series]``
                     ``pandas_udf`` that loads the model once per iterator, ``np.vstack``s each Series of arrays
                     and predicts in batches of 1024 under ``torch.no_grad()``

and, for reference, the floor: an Arrow UDF on the same input that returns zeros without running a model.
Each is timed over one action that computes every prediction (``select(sum(prediction))``): one warm-up,
then ``--reps`` runs (the cases interleaved, so that a shared machine's noise hits each alike); the table
gives the best rows/s and the median, and ours / the best peer's (best against best, median against
median). Before timing, the three predictions of a few rows are compared with each other and with the
model run on the driver (float32 tolerance), and the sums of all the predictions with each other; the exit
status is 1 where they disagree.

    python bench/inference.py                       # 200k rows, 3 reps: about 1.5 minutes on 2 cores
    python bench/inference.py --rows 20000 --reps 1
    python bench/inference.py --width 1024
"""

from __future__ import annotations

import argparse
import io
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from typing import Iterator

import numpy as np
import pandas as pd  # module-level: pandas_udf and arrow_udf resolve their type hints in this module's globals
import pyarrow as pa

DIM = 64
BATCH = 1024
CHECK_ROWS = 5
RTOL, ATOL = 1e-4, 1e-5  # float32 arithmetic in different chunkings (1024-row chunks vs Arrow batches)


def make_net(width: int):
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(DIM, width), torch.nn.ReLU(), torch.nn.Linear(width, width),
                               torch.nn.ReLU(), torch.nn.Linear(width, 1))


def fit_model(df, column: str, width: int, store_dir: str):
    """A TorchModel of ``make_net(width)`` on ``column``: one step at lr=0 on the driver (num_proc=-1)."""
    import torch

    from sparkhvd.ml import Store, TorchEstimator

    net = make_net(width)
    est = TorchEstimator(num_proc=-1, store=Store.create(store_dir), model=net,
                         optimizer=torch.optim.SGD(net.parameters(), lr=0.0), loss=torch.nn.functional.mse_loss,
                         feature_cols=[column], label_cols=["y"], batch_size=64, epochs=1, train_steps_per_epoch=1,
                         run_id=f"bench_{column}")
    return est.fit(df.select(column, "y").limit(4096))


def predict_batch_peer(model_bytes: bytes):
    """pyspark's predict_batch_udf, written as its docs show."""
    from pyspark.ml.functions import predict_batch_udf
    from pyspark.sql.types import DoubleType

    def make_predict_fn():
        # load/init happens once per python worker
        import io

        import torch

        model = torch.load(io.BytesIO(model_bytes), weights_only=False)
        model.eval()

        # predict on batches of tasks/partitions, using cached model
        def predict(inputs: np.ndarray) -> np.ndarray:
            # inputs.shape = [batch_size, 64], see input_tensor_shapes
            with torch.no_grad():
                return model(torch.from_numpy(inputs)).numpy()

        return predict

    return predict_batch_udf(make_predict_fn, return_type=DoubleType(), batch_size=BATCH,
                             input_tensor_shapes=[[DIM]])


def pandas_peer(model_bytes: bytes):
    """Databricks' recipe: an Iterator[pd.Series] -> Iterator[pd.Series] pandas UDF, the model loaded per iterator."""
    from pyspark.sql.functions import pandas_udf
    from pyspark.sql.types import DoubleType

    @pandas_udf(DoubleType())
    def predict_udf(batch_iter: Iterator[pd.Series]) -> Iterator[pd.Series]:
        import io

        import torch

        model = torch.load(io.BytesIO(model_bytes), weights_only=False)  # once per iterator
        model.eval()
        for series in batch_iter:
            inputs = np.vstack(series.to_numpy()).astype(np.float32)
            predictions = []
            with torch.no_grad():
                for start in range(0, len(inputs), BATCH):
                    predictions.append(model(torch.from_numpy(inputs[start:start + BATCH])).numpy())
            yield pd.Series(np.concatenate(predictions).reshape(-1).astype(np.float64))

    return predict_udf


def floor_udf():
    """The floor: an Arrow UDF on the same input that returns zeros without a model (Spark's transfer both ways)."""
    from pyspark.sql.functions import arrow_udf
    from pyspark.sql.types import DoubleType

    def zeros(batches: Iterator[pa.Array]) -> Iterator[pa.Array]:
        for batch in batches:
            yield pa.array(np.zeros(len(batch)))

    return arrow_udf(zeros, DoubleType())


def worker_threads(spark) -> int:
    """torch's intra-op threads in a Python worker (pyspark sets OMP_NUM_THREADS to spark.task.cpus there)."""
    def threads(_):
        import torch

        yield torch.get_num_threads()

    return max(spark.sparkContext.parallelize(range(2), 2).mapPartitions(threads).collect())


def fmt_row(cells, widths):
    return "| " + " | ".join(str(c).ljust(w) for c, w in zip(cells, widths)) + " |"


def table(header, rows) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = [fmt_row(header, widths), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    lines += [fmt_row(r, widths) for r in rows]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=200_000, help="rows of the DataFrame (default 200000)")
    parser.add_argument("--reps", type=int, default=3, help="timed runs of each case after one warm-up (default 3)")
    parser.add_argument("--width", type=int, default=256, help="the MLP's hidden width (default 256)")
    parser.add_argument("--partitions", type=int, default=2, help="partitions of the DataFrame (default 2)")
    parser.add_argument("--kinds", default="array,vector", help="feature columns to run: array, vector or both")
    args = parser.parse_args()
    if args.reps < 1 or args.rows < CHECK_ROWS:
        parser.error(f"--reps must be >= 1 and --rows >= {CHECK_ROWS}")
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    if not kinds or any(k not in ("array", "vector") for k in kinds):
        parser.error("--kinds takes array, vector or array,vector")
    wall = time.perf_counter()

    os.environ["PYSPARK_PYTHON"] = sys.executable
    import torch
    from pyspark.ml.functions import array_to_vector, vector_to_array
    from pyspark.sql import SparkSession
    from pyspark.sql import functions as F

    spark = (SparkSession.builder.master("local[2]").appName("sparkhvd-bench-inference")
             .config("spark.ui.enabled", "false")
             .config("spark.ui.showConsoleProgress", "false")
             .getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    tmp = tempfile.mkdtemp(prefix="sparkhvd-bench-inference-")
    try:
        features = F.array(*[F.rand(seed=i).cast("float") for i in range(DIM)])
        df = (spark.range(0, args.rows, 1, args.partitions)
              .select("id", features.alias("features"))
              .select("id", "features", array_to_vector("features").alias("vec"),
                      F.aggregate("features", F.lit(0.0), lambda acc, x: acc + x).alias("y")))
        df.cache()
        start = time.perf_counter()
        assert df.count() == args.rows
        print(f"DataFrame: {args.rows} rows x {DIM} floats (array<float> and vector), {args.partitions} partitions, "
              f"cached in {time.perf_counter() - start:.1f} s; MLP {DIM}->{args.width}->{args.width}->1 "
              f"({sum(p.numel() for p in make_net(args.width).parameters()):,} parameters)")

        # One model per column kind (its metadata says array or vector), all with make_net's seeded weights.
        cases = {}  # (kind, name) -> a function of df giving the DataFrame with the prediction column "pred"
        driver_nets = {}
        for kind in kinds:
            column = "features" if kind == "array" else "vec"
            start = time.perf_counter()
            model = fit_model(df, column, args.width, os.path.join(tmp, "store"))
            print(f"fit ({kind}): {time.perf_counter() - start:.1f} s")
            net = model.getModel()
            driver_nets[kind] = net
            buffer = io.BytesIO()
            torch.save(net, buffer)
            model_bytes = buffer.getvalue()
            out_col = model.getOutputCols()[0]
            feature = F.col(column) if kind == "array" else vector_to_array(F.col(column), "float32")
            batch_udf, pandas_udf = predict_batch_peer(model_bytes), pandas_peer(model_bytes)
            cases[(kind, "ours")] = lambda frame, m=model, c=out_col: m.transform(frame).withColumnRenamed(c, "pred")
            cases[(kind, "predict_batch_udf")] = lambda frame, u=batch_udf, f=feature: frame.withColumn("pred", u(f))
            cases[(kind, "pandas_udf")] = lambda frame, u=pandas_udf, f=feature: frame.withColumn("pred", u(f))
            cases[(kind, "floor (no model)")] = lambda frame, u=floor_udf(), f=feature: frame.withColumn("pred", u(f))

        # Correctness: a few rows against each other and against the model on the driver; the sums of all rows.
        print(f"\ncheck: the first {CHECK_ROWS} rows' predictions (rtol {RTOL}, atol {ATOL}) and the sum of all")
        first = df.filter(F.col("id") < CHECK_ROWS).orderBy("id").select("features").collect()
        with torch.no_grad():  # the fits kept the seeded weights (lr=0): every kind's model is the same
            inputs = torch.tensor(np.array([r.features for r in first]), dtype=torch.float32)
            expected = driver_nets[kinds[0]](inputs).numpy().reshape(-1)
        ok = True
        sums = {}
        for (kind, name), make in cases.items():
            if name.startswith("floor"):
                continue
            out = make(df)
            got = np.array([r.pred for r in
                            out.filter(F.col("id") < CHECK_ROWS).orderBy("id").select("pred").collect()])
            sums[(kind, name)] = out.agg(F.sum("pred")).collect()[0][0]
            close = np.allclose(got, expected, rtol=RTOL, atol=ATOL)
            ok &= close
            print(f"  {kind:<7}{name:<18}{np.array2string(got, precision=6, floatmode='fixed')}  "
                  f"max |diff| {np.max(np.abs(got - expected)):.2e} {'ok' if close else 'MISMATCH'}  "
                  f"sum {sums[(kind, name)]:.6f}")
        reference = next(iter(sums.values()))
        sums_ok = all(np.isclose(s, reference, rtol=RTOL) for s in sums.values())
        ok &= sums_ok
        print(f"  driver {np.array2string(expected, precision=6, floatmode='fixed')}; "
              f"sums agree: {'yes' if sums_ok else 'NO'}; predictions agree: {'yes' if ok else 'NO'}")

        # Timing: one warm-up each, then reps interleaved.
        def action(name_kind):
            out = cases[name_kind](df)
            start = time.perf_counter()
            out.agg(F.sum("pred")).collect()
            return time.perf_counter() - start

        for key in cases:
            action(key)
        times = {key: [] for key in cases}
        for _ in range(args.reps):
            for key in cases:
                times[key].append(action(key))

        rows = []
        for kind in kinds:
            best = {name: args.rows / min(times[(kind, name)]) for k, name in cases if k == kind}
            median = {name: args.rows / statistics.median(times[(kind, name)]) for k, name in cases if k == kind}
            peers = [name for name in best if name not in ("ours", "floor (no model)")]
            peer, peer_median = max(best[name] for name in peers), max(median[name] for name in peers)
            for name in best:
                ratio = f"{best[name] / peer:.2f} (median {median[name] / peer_median:.2f})" if name == "ours" else ""
                rows.append([f"{kind}: {name}", f"{best[name]:,.0f}", f"{median[name]:,.0f}",
                             f"{min(times[(kind, name)]):.3f}", ratio])
        print(f"\n{args.rows} rows, best (and median) of {args.reps} after one warm-up; "
              f"{platform.node()}, {os.cpu_count()} cores, torch {torch.__version__}, "
              f"{worker_threads(spark)} torch thread(s) per Python worker")
        print(table(["case", "rows/s (best)", "rows/s (median)", "best s", "ours / best peer"], rows))
        print(f"\ntotal {time.perf_counter() - wall:.0f} s")
        return 0 if ok else 1  # timings of predictions that disagree compare nothing
    finally:
        spark.stop()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
