"""Benchmark (not a test): warm wall time of launching a function on 2 ranks.

One ``local[2]`` SparkSession (``spark.ui.enabled=false``, ``PYSPARK_PYTHON`` = this
interpreter) runs, in the same process:

- ours:  ``HorovodRunner(np=2, driver_log_verbosity="log_callback_only").run(fn)``
- peer:  ``TorchDistributor(num_processes=2, local_mode=False, use_gpu=False).run(fn)``
  (pyspark.ml.torch: a barrier ``mapInArrow`` stage whose tasks each start
  ``torch_run_process_wrapper`` -> ``torch.distributed.run`` -> the function's process)
- floor: a bare Spark barrier stage,
  ``sc.parallelize(range(2), 2).barrier().mapPartitions(lambda it: [1]).collect()``

``fn`` is, with ``--fn init`` (the default), what a training function starts with: ours
imports ``sparkhvd.collective.torch`` and calls ``hvd.init()``; the peer imports
``torch.distributed`` and calls ``init_process_group("gloo")`` (and destroys it). With ``--fn
trivial`` both run ``return 1`` and import nothing. With ``--fn keras``, a Keras function's start: ours
imports keras and ``sparkhvd.collective.keras`` and calls ``hvd.init()`` (its ranks fork from the warm process
that preloads TensorFlow); the peer imports keras and tensorflow and runs one op. Ours forks its ranks from the warm zygote
(runner/_warm/server.py, docs/performance.md) from the second run on; run with ``SPARKHVD_WARM=0`` in
the environment for fresh rank processes, the baseline.

Each gets one warm-up run (floor first, then ours, then the peer; each is reported as that
launch's first run), then ``--reps`` timed runs, interleaved ours / peer / floor (the order
reversed every other round) so that drift hits all of them alike. Prints median, min and max
seconds, the ratio ours/TorchDistributor on the medians (target <= 0.10), a breakdown of where
ours' time goes (driver-side timestamps of the rank protocol, on Spark and with np=-2 on the
driver, from extra runs after the timed ones), and one line describing the machine. About two
minutes on 2 CPUs with the defaults, nearly all of it TorchDistributor. Spark's start-up
warnings and, from TorchDistributor's ranks, an occasional c10d TCPStore "Connection reset by
peer" warning reach stderr from the JVM's side and cannot be captured here; they are harmless.

pandas: TorchDistributor(local_mode=False) needs it (pyspark's pandas_udf version check on
the driver, and ``pyarrow.RecordBatch.from_pandas`` for rank 0's result in the task); `make
bench` installs it with the ``bench`` extra.

    python bench/launch.py
    python bench/launch.py --reps 9
    python bench/launch.py --no-peer          # ours and the floor only (seconds, not minutes)
    python bench/launch.py --fn trivial       # return 1 on both sides
    SPARKHVD_WARM=0 python bench/launch.py    # no warm zygote: every rank a fresh process
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import logging
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

NP = 2
TARGET_RATIO = 0.10


def trivial():
    return 1


def ours_init():
    import sparkhvd.collective.torch as hvd

    hvd.init()
    return 1 if hvd.size() == NP else hvd.size()


def peer_init():
    import torch.distributed as dist

    dist.init_process_group("gloo")
    size = dist.get_world_size()
    dist.destroy_process_group()
    return 1 if size == NP else size


def ours_keras():
    import keras  # noqa: F401 - what a Keras function imports first

    import sparkhvd.collective.keras as hvd

    hvd.init()
    return 1 if hvd.size() == NP else hvd.size()


def peer_keras():
    import keras  # noqa: F401
    import tensorflow as tf

    return 1 if tf.constant(1).numpy() == 1 else 0


# keras: a Keras function's launch (ours from the warm process that preloads TensorFlow, runner/_warm/server.py);
# TorchDistributor runs the same imports as its peer
FNS = {"init": (ours_init, peer_init), "trivial": (trivial, trivial), "keras": (ours_keras, peer_keras)}
FN = "init"  # set from --fn


# ---------------------------------------------------------------------------------------------
def require_pandas() -> str:
    """TorchDistributor(local_mode=False) needs real pandas (pyspark's ml extra)."""
    if importlib.util.find_spec("pandas") is None:
        sys.exit("error: the TorchDistributor peer needs pandas>=2.2, which is not installed; "
                 "run `make bench` (installs sparkhvd[bench]) or pass --no-peer.")
    import pandas

    return f"real pandas {pandas.__version__}"


# ---------------------------------------------------------------------------------------------
# the three launches


LOG_DIRS: list[str] = []  # the per-run log folders ours leaves in $TMPDIR; removed at the end


def make_ours(np: int = NP):
    from sparkhvd import HorovodRunner

    def ours():
        result = HorovodRunner(np=np, driver_log_verbosity="log_callback_only").run_all(FNS[FN][0])
        LOG_DIRS.append(result.log_dir)
        assert result.value == 1, result.values

    return ours


def make_peer():
    from pyspark.ml.torch.distributor import TorchDistributor

    # TorchDistributor logs two INFO lines per run to stderr: keep its warnings only.
    logger = logging.getLogger("TorchDistributor")
    handler = logging.StreamHandler(sys.stderr)
    handler.setLevel(logging.WARNING)
    logger.addHandler(handler)
    logger.propagate = False

    def peer():
        value = TorchDistributor(num_processes=NP, local_mode=False, use_gpu=False).run(FNS[FN][1])
        assert value == 1, value

    return peer


def make_floor(sc):
    def floor():
        rows = sc.parallelize(range(NP), NP).barrier().mapPartitions(lambda it: [1]).collect()
        assert rows == [1] * NP, rows

    return floor


def timed(fn) -> float:
    """Seconds for one call; the callee's prints (the peer relays its ranks' output) are kept
    aside and shown only if it fails."""
    out = io.StringIO()
    start = time.perf_counter()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            fn()
    except BaseException:
        sys.stderr.write(out.getvalue())
        raise
    return time.perf_counter() - start


# ---------------------------------------------------------------------------------------------
# where ours' time goes: driver-side timestamps of the rank protocol. The instrumentation is
# patched in here only, for extra runs after the timed ones, and removed afterwards.

PHASES = [
    "driver setup: pickle, Spark checks, service up",
    "launcher starts -> both tasks REGISTERed",
    "both REGISTERed -> both FETCH (rank process start, imports, connect)",
    "FETCH -> RESULT (unpickle, call, pickle, send)",
    "RESULT -> EXIT (rank interpreter exit, agent reports)",
    "EXIT -> supervise returns (launcher join: Spark job end)",
    "supervise returns -> run() returns (service/log close)",
    "total",
]


def breakdown_ours(fns: dict, reps: int) -> dict[str, dict[str, list[float]]]:
    """For each launch in ``fns`` ({name: callable}), reps runs -> {name: {phase: [seconds]}}."""
    from sparkhvd.runner._policy import policy as _run_policy
    from sparkhvd.runner._service import service as _service

    events: dict[str, list[float]] = {}

    def stamp(name):
        events.setdefault(name, []).append(time.perf_counter())

    def wrap(owner, attr, name, after=False):
        original = getattr(owner, attr)

        def wrapper(*args, **kwargs):
            if not after:
                stamp(name)
            try:
                return original(*args, **kwargs)
            finally:
                if after:
                    stamp(name)

        setattr(owner, attr, wrapper)
        return owner, attr, original

    # DriverService binds its handlers in __init__, so patching the class first is enough.
    patches = [wrap(_service.DriverService, "__init__", "service", after=True),
               wrap(_run_policy.RunPolicy, "_ended", "supervised"),  # the attempt's ranks are done
               wrap(_service.DriverService, "_register", "register"),
               wrap(_service.DriverService, "_fetch", "fetch"),
               wrap(_service.DriverService, "_result", "result"),
               wrap(_service.DriverService, "_exit", "exit")]
    out: dict[str, dict[str, list[float]]] = {}
    try:
        for _ in range(reps):
            for name, fn in fns.items():
                events.clear()
                start = time.perf_counter()
                timed(fn)
                end = time.perf_counter()
                e = events
                marks = [start, e["service"][0], max(e["register"]), max(e["fetch"]),
                         max(e["result"]), max(e["exit"]), e["supervised"][0], end]
                phases = out.setdefault(name, {})
                for label, a, b in zip(PHASES, marks, marks[1:]):
                    phases.setdefault(label, []).append(b - a)
                phases.setdefault(PHASES[-1], []).append(end - start)
    finally:
        for owner, attr, original in reversed(patches):
            setattr(owner, attr, original)
    return out


def subprocess_seconds(args: list[str], reps: int = 5) -> float:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        subprocess.run(args, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


# ---------------------------------------------------------------------------------------------


def fmt_row(cells, widths):
    return "| " + " | ".join(str(c).ljust(w) for c, w in zip(cells, widths)) + " |"


def table(header, rows) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = [fmt_row(header, widths), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    lines += [fmt_row(r, widths) for r in rows]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=5, help="timed runs of each (default 5)")
    parser.add_argument("--no-peer", action="store_true", help="skip TorchDistributor")
    parser.add_argument("--no-breakdown", action="store_true", help="skip ours' time breakdown")
    parser.add_argument("--fn", choices=sorted(FNS), default="init",
                        help="init: each side initialises its process group (default); trivial: return 1")
    args = parser.parse_args()
    global FN
    FN = args.fn
    if args.reps < 1:
        parser.error("--reps must be >= 1")
    wall = time.perf_counter()

    os.environ["PYSPARK_PYTHON"] = sys.executable
    # Marks the zygotes this benchmark's tasks start (they inherit the environment), ended at the end.
    os.environ["SPARKHVD_BENCH_LAUNCH"] = str(os.getpid())
    from pyspark.sql import SparkSession

    spark = (SparkSession.builder.master(f"local[{NP}]").appName("sparkhvd-bench-launch")
             .config("spark.ui.enabled", "false")
             .config("spark.ui.showConsoleProgress", "false")
             .getOrCreate())
    sc = spark.sparkContext
    sc.setLogLevel("ERROR")
    session_s = time.perf_counter() - wall

    scratch = tempfile.mkdtemp(prefix="sparkhvd-bench-launch-")
    try:
        pandas_note = "" if args.no_peer else require_pandas()
        launches = {"floor": make_floor(sc), "ours": make_ours()}
        if not args.no_peer:
            launches["peer"] = make_peer()
        # Warm-ups: the floor first, so that the session's first Spark job (which starts the
        # Python workers) is not charged to ours' cold run.
        cold = {}
        for name in launches:
            cold[name] = timed(launches[name])
            print(f"warm-up {name}: {cold[name]:.3f} s", file=sys.stderr, flush=True)
        order = [k for k in ("ours", "peer", "floor") if k in launches]
        samples: dict[str, list[float]] = {name: [] for name in order}
        for rep in range(args.reps):
            for name in (order if rep % 2 == 0 else order[::-1]):
                samples[name].append(timed(launches[name]))
            print(f"rep {rep + 1}/{args.reps}: " + ", ".join(
                f"{n} {samples[n][-1]:.3f} s" for n in order), file=sys.stderr, flush=True)

        parts = None
        if not args.no_breakdown:
            local = make_ours(-NP)
            timed(local)  # its own warm-up
            parts = breakdown_ours({"spark": launches["ours"], "local": local}, args.reps)
            python_s = subprocess_seconds([sys.executable, "-c", "pass"])
            worker_s = subprocess_seconds([sys.executable, "-c", "import sparkhvd.runner._rank.worker, cloudpickle"])
            deps_s = subprocess_seconds([sys.executable, "-c", "import ctypes, json, signal, socket, subprocess, "
                                         "hmac, hashlib, secrets, struct, dataclasses, cloudpickle"])
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        for log_dir in LOG_DIRS:
            shutil.rmtree(log_dir, ignore_errors=True)

    import pyspark
    import torch

    labels = {
        "ours": f"ours: HorovodRunner(np=2).run({FNS[FN][0].__name__})",
        "peer": f"TorchDistributor(num_processes=2, local_mode=False, use_gpu=False).run({FNS[FN][1].__name__})",
        "floor": "floor: bare Spark barrier stage, 2 tasks",
    }
    rows = []
    for name in order:
        values = samples[name]
        rows.append([labels[name], f"{statistics.median(values):.3f}", f"{min(values):.3f}",
                     f"{max(values):.3f}", f"{cold[name]:.3f}"])
    ours_med = statistics.median(samples["ours"])
    floor_med = statistics.median(samples["floor"])
    print()
    print(f"## Launch of fn={FN} at np={NP} on {sc.master}: wall seconds, {args.reps} warm runs "
          "each (interleaved)")
    print()
    print(table(["launch", "median", "min", "max", "first run"], rows))
    print()
    if "peer" in samples:
        ratio = ours_med / statistics.median(samples["peer"])
        verdict = "met" if ratio <= TARGET_RATIO else "NOT met"
        print(f"ratio ours / TorchDistributor (medians): {ratio:.3f}   target <= {TARGET_RATIO:.2f}: {verdict}")
    print(f"ours minus the barrier-stage floor (medians): {ours_med - floor_med:+.3f} s")
    print()
    print("Notes:")
    print('- ours uses driver_log_verbosity="log_callback_only" (ranks\' output is not relayed to the '
          "driver's stdout). Every launch's Python-level stdout/stderr is captured and dropped, alike for all.")
    print(f"- 'first run' is each launch's warm-up on the started session, in the order {', '.join(cold)}: "
          "the floor's pays for Spark starting its Python workers; ours' includes importing sparkhvd.runner "
          f"on the driver. Starting the SparkSession took {session_s:.1f} s (not in any number).")
    if "peer" in samples:
        print(f"- TorchDistributor: {pandas_note}. Nothing else was needed: local[{NP}] gives the barrier "
              "stage its slots, and use_gpu=False needs no spark.task.resource.gpu.amount. Each of its tasks "
              "runs torch_run_process_wrapper -> torch.distributed.run (static rendezvous, nnodes=2, "
              "nproc_per_node=1) -> the function. Its run() sleeps a fixed 1.0 s after starting its "
              "log-streaming server and 0.2 s when stopping it; both are in its times.")
    if FN == "trivial":
        print("- trivial() returns 1; neither side initialises a process group.")
    else:
        print("- ours_init() imports sparkhvd.collective.torch and calls hvd.init(); peer_init() calls "
              'torch.distributed.init_process_group("gloo") and destroys it.')
    warm = os.environ.get("SPARKHVD_WARM", "1") != "0"
    print(f"- ours' ranks: {'forked from the warm zygote (runner/_warm/server.py)' if warm else 'fresh processes (SPARKHVD_WARM=0)'}.")
    if parts:
        print()
        print(f"## Where ours' time goes: {args.reps} more runs each, instrumented (driver-side timestamps "
              "of the rank protocol), seconds")
        print()
        spark_p, local_p = parts["spark"], parts["local"]
        print(table(["phase (max over the 2 ranks)", f"np={NP} on Spark: median", "min", "max",
                     f"np=-{NP} on the driver: median"],
                    [[label, f"{statistics.median(spark_p[label]):.3f}", f"{min(spark_p[label]):.3f}",
                      f"{max(spark_p[label]):.3f}", f"{statistics.median(local_p[label]):.3f}"]
                     for label in PHASES]))
        print()
        print(f"One process alone, no Spark (median of 5): python -c pass {python_s:.3f} s; "
              f"import sparkhvd.runner._rank.worker, cloudpickle {worker_s:.3f} s; "
              f"just the stdlib modules the rank needs + cloudpickle {deps_s:.3f} s.")
    print()
    print(f"machine: {os.cpu_count()} CPUs ({platform.machine()}, Linux {platform.release()}), no GPU used; "
          f"python {platform.python_version()}, torch {torch.__version__}, pyspark {pyspark.__version__}, "
          f"java via {os.environ.get('JAVA_HOME') or 'PATH'}; whole benchmark {time.perf_counter() - wall:.0f} s")
    spark.stop()
    stop_zygotes()
    return 0


def stop_zygotes() -> None:
    """End the warm zygotes this benchmark's tasks started (they would otherwise idle out)."""
    from sparkhvd.runner._warm.client import marked

    for pid in marked(f"SPARKHVD_BENCH_LAUNCH={os.getpid()}"):
        try:
            os.kill(pid, 9)
        except OSError:
            pass


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception:  # noqa: BLE001 - show it, exit non-zero
        traceback.print_exc()
        sys.exit(1)
