"""Benchmark (not a test): one DDP function under pyspark's TorchDistributor and under sparkhvd's drop-in.

One ``local[2]`` SparkSession (bench/launch.py's settings) runs, in the same process, the same functions under

- theirs: ``pyspark.ml.torch.distributor.TorchDistributor(num_processes=2, local_mode=False, use_gpu=False)``
- ours:   ``sparkhvd.TorchDistributor(num_processes=2, local_mode=False, use_gpu=False)``

and measures, for each:

- launch: ``ddp_launch`` imports torch, calls ``init_process_group("gloo")``, allreduces one tensor and
  returns. The first run in the session (after one bare Spark job, so that neither pays for Spark starting
  its Python workers), then ``--rounds`` warm runs: median, min, max of the driver's wall seconds.
- steps/s: ``ddp_train``, an MLP of 399,370 parameters under ``DistributedDataParallel`` (batch 64, SGD,
  cross-entropy), ``--warmup`` steps, then ``--steps`` steps timed inside the function; rank 0's rate, one per
  round; and the wall seconds of that whole run() (launch, training, exit).
- faults: ``ddp_train`` again, where rank 1, a few steps into the timed loop, writes ``time.time()`` to a file
  and then (a) raises ``ValueError`` or (b) SIGKILLs itself. Reported: the seconds from that stamp to when
  ``run()`` raises on the driver (``time.time()`` on both sides: two processes, one clock), the first line of
  the error as the user sees it, and whether the error's text names the cause (the ValueError's message; for
  the SIGKILL, any of "SIGKILL", "signal 9", "-9"). The process group is made with a ``--pg-timeout``
  (default 60 s) and the driver waits at most ``--cap`` seconds (default 90) from the fault: past it, the
  row says ">90 s" and the bench cancels the Spark job.

Each round runs ours and theirs in turn, the order reversed every other round, so that a shared machine's
noise hits both alike. Prints the table, then ours/theirs for the warm launch (goal <= 0.05) and for steps/s
(each round's pair; goal >= 0.98 on their median), and our seconds to an error that names the true cause
(goal <= 5 s). Default: 5 rounds, about 3.5 minutes on 2 cores, nearly all of it TorchDistributor. Needs pandas
(the ``bench`` extra), as bench/launch.py's peer does.

    python bench/vs_torchdistributor.py [--rounds 5] [--steps 500] [--warmup 20] [--cap 90] [--verbose]

``--testbed`` (bench/vs_torchdistributor_testbed.py): the warm launch only, on tests/cluster's 2-host namespace
testbed (root, iproute2, Java; skipped with the reason where it cannot be built) with
``spark.task.resource.gpu.amount=2``: both sides' ``TorchDistributor(num_processes=4, local_mode=False,
use_gpu=True)`` as 2 tasks of 2 processes (torchrun nodes of 2) over fake GPUs, each run's torchrun variables
checked; goal ours/theirs <= 0.05. ``--rounds`` warm runs (``--steps``, ``--warmup`` and ``--cap`` unused).

    python bench/vs_torchdistributor.py --testbed [--rounds 3] [--verbose]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import platform
import shutil
import statistics
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))

import launch  # noqa: E402 - bench/launch.py: timed, table, require_pandas, stop_zygotes, the TorchDistributor logger

NP = launch.NP
LAUNCH_GOAL = 0.05
STEPS_GOAL = 0.98
CAUSE_GOAL_S = 5.0
FAULT_RANK = 1
FAULT_STEP = 5  # steps into the timed loop
FAULT_STEPS = 10 ** 6  # the fault runs' loop length: the healthy rank is still training when its peer fails
INJECTED = "injected fault: a bad batch"
KILL_WORDS = ("SIGKILL", "signal 9", "-9")

# The functions below are defined in __main__, so both picklers (ours: cloudpickle; theirs: pyspark's
# bundled copy, pyspark.cloudpickle) send them by value: the two sides run the same bytecode.


def ddp_launch():
    """What every DDP function starts with: form the gloo group, one tiny allreduce; returns the world size."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    t = torch.ones(1)
    dist.all_reduce(t)
    dist.destroy_process_group()
    return int(t.item())


def ddp_train(steps, warmup, fault=None, stamp=None, pg_timeout_s=None):
    """An MLP under DDP: ``warmup`` steps, then ``steps`` timed; rank 0's steps/s. With ``fault`` ("raise" or
    "kill"), rank FAULT_RANK writes time.time() to ``stamp`` at step FAULT_STEP of the timed loop and fails."""
    import datetime
    import os
    import signal
    import time

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel

    kwargs = {} if pg_timeout_s is None else {"timeout": datetime.timedelta(seconds=pg_timeout_s)}
    dist.init_process_group("gloo", **kwargs)
    rank = dist.get_rank()
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512),
                              torch.nn.ReLU(), torch.nn.Linear(512, 10))
    model = DistributedDataParallel(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(rank)
    x, y = torch.randn(64, 256, generator=gen), torch.randint(0, 10, (64,), generator=gen)

    def step(ddp):  # the model as an argument, so that `del model` below drops the last reference
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(ddp(x), y).backward()
        opt.step()

    for _ in range(warmup):
        step(model)
    dist.barrier()
    start = time.perf_counter()
    for i in range(steps):
        if fault and rank == FAULT_RANK and i == FAULT_STEP:
            with open(stamp, "w") as f:
                f.write(repr(time.time()))
            if fault == "raise":
                raise ValueError(f"{INJECTED} at step {i} on rank {rank}")
            os.kill(os.getpid(), signal.SIGKILL)
        step(model)
    rate = steps / (time.perf_counter() - start)
    # DDP's Reducer holds the process group. Released after destroy_process_group(), as tutorials write it,
    # the group's destructor runs under the GIL and joins a gloo thread that waits for the GIL: under torch
    # 2.13 that deadlocks often, with or without Spark (docs/performance.md). Release the model first.
    del model
    dist.destroy_process_group()
    return {"steps_per_s": rate, "threads": torch.get_num_threads(),
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
            "params": sum(p.numel() for p in net.parameters())}


#: What ddp_launch_layout's allreduce carries from each process, a row per rank (-1: unset or not a number).
LAYOUT_FIELDS = ("RANK", "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "host", "gpus", "gpu0", "gpu1")


def ddp_launch_layout():
    """ddp_launch for --testbed, whose one allreduce also carries each process's torchrun variables, a checksum of
    its hostname and its CUDA_VISIBLE_DEVICES (how many ids, the first two); returns the rows, the same on every
    rank. CPU tensors only: the testbed's GPUs are fake."""
    import os
    import socket
    import zlib

    import torch
    import torch.distributed as dist

    def number(text):
        return int(text) if text.isdigit() else -1

    dist.init_process_group("gloo")
    visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d]
    row = [number(os.environ.get(name, "")) for name in LAYOUT_FIELDS[:5]]
    row += [zlib.crc32(socket.gethostname().encode()), len(visible)] + [number(d) for d in (visible + ["", ""])[:2]]
    table = torch.zeros(dist.get_world_size(), len(LAYOUT_FIELDS), dtype=torch.float64)  # exact below 2**53
    table[dist.get_rank()] = torch.tensor(row, dtype=torch.float64)
    dist.all_reduce(table)
    dist.destroy_process_group()
    return [dict(zip(LAYOUT_FIELDS, map(int, r))) for r in table.tolist()]


# ---------------------------------------------------------------------------------------------


def distributors():
    """{"ours": class, "theirs": class}, both called as TorchDistributor(num_processes=NP, local_mode=False,
    use_gpu=False)."""
    from pyspark.ml.torch.distributor import TorchDistributor as Theirs

    from sparkhvd import TorchDistributor as Ours

    launch.make_peer()  # only for its side effect: pyspark's TorchDistributor logger keeps its warnings only
    return {"ours": Ours, "theirs": Theirs}


def run_on(cls, fn, *args):
    return cls(num_processes=NP, local_mode=False, use_gpu=False).run(fn, *args)


def first_line(exc: BaseException, width: int = 100) -> str:
    text = f"{type(exc).__name__}: {str(exc).strip()}"
    line = next((ln.strip() for ln in text.splitlines() if ln.strip()), "")
    return line if len(line) <= width else line[:width - 3] + "..."


def names_cause(exc: BaseException, fault: str) -> bool:
    text = str(exc)
    return INJECTED in text if fault == "raise" else any(word in text for word in KILL_WORDS)


def fault_run(sc, cls, fault: str, args, scratch: str) -> dict:
    """One run whose rank FAULT_RANK fails; the blocking run() goes in a thread so that a hang is capped."""
    stamp = os.path.join(scratch, f"fault-{fault}")
    with contextlib.suppress(FileNotFoundError):
        os.remove(stamp)
    box: dict = {"out": io.StringIO()}

    def call():
        try:
            with contextlib.redirect_stdout(box["out"]), contextlib.redirect_stderr(box["out"]):
                box["value"] = run_on(cls, ddp_train, FAULT_STEPS, args.warmup, fault, stamp, args.pg_timeout)
        except BaseException as exc:  # noqa: BLE001 - the error under test
            box["raised_at"] = time.time()
            box["error"] = exc

    start = time.perf_counter()
    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    fault_at = None
    while thread.is_alive():
        thread.join(0.05)
        if fault_at is None and os.path.exists(stamp):
            with open(stamp) as f:
                text = f.read()
            fault_at = float(text) if text else None  # (read before the rank finished writing: try again)
        waited = time.time() - fault_at if fault_at else time.perf_counter() - start
        if thread.is_alive() and waited > (args.cap if fault_at else args.cap + 120):
            sc.cancelAllJobs()  # ends the hung run: run() then raises, late
            thread.join(120)
            return {"seconds": None, "line": f"(no error within {args.cap:.0f} s of the fault; job cancelled) "
                    + (first_line(box["error"], 60) if "error" in box else ""), "cause": False,
                    "text": str(box.get("error", "")), "out": box["out"].getvalue()}
    if "error" not in box:
        return {"seconds": None, "line": f"(no error: returned {box.get('value')!r})", "cause": False, "text": "",
                "out": box["out"].getvalue()}
    if fault_at is None and os.path.exists(stamp):
        with open(stamp) as f:
            fault_at = float(f.read())
    exc = box["error"]
    return {"seconds": None if fault_at is None else box["raised_at"] - fault_at, "line": first_line(exc),
            "cause": names_cause(exc, fault), "text": f"{type(exc).__name__}: {exc}", "out": box["out"].getvalue()}


def spread(values: list[float], digits: int = 2) -> str:
    return f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="warm launches and training runs of each (default 5)")
    parser.add_argument("--steps", type=int, default=500, help="timed DDP steps per training run (default 500)")
    parser.add_argument("--warmup", type=int, default=20, help="untimed DDP steps first (default 20)")
    parser.add_argument("--pg-timeout", type=float, default=60.0,
                        help="the fault runs' init_process_group timeout, seconds (default 60)")
    parser.add_argument("--cap", type=float, default=90.0,
                        help="seconds the driver waits for an error after a fault (default 90)")
    parser.add_argument("--verbose", action="store_true", help="print each fault's full error and captured output")
    parser.add_argument("--testbed", action="store_true",
                        help="the warm launch on tests/cluster's 2-host testbed, 2 GPUs per task, num_processes=4 "
                             "(bench/vs_torchdistributor_testbed.py; needs root, iproute2, Java)")
    args = parser.parse_args()
    if args.rounds < 1 or args.steps < 1 or args.warmup < 0:
        parser.error("--rounds and --steps must be >= 1, --warmup >= 0")
    pandas = launch.require_pandas()
    if args.testbed:
        import vs_torchdistributor_testbed

        return vs_torchdistributor_testbed.main(args, ddp_launch_layout)
    wall = time.perf_counter()

    scratch = tempfile.mkdtemp(prefix="sparkhvd-bench-vs-td-")
    os.environ["SPARKHVD_LOG_ROOT"] = os.path.join(scratch, "logs")  # ours' per-run log folders, removed below
    os.environ["TMPDIR"] = scratch  # Spark's workers and their children: torchrun leaves a torchelastic_* folder
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["SPARKHVD_BENCH_LAUNCH"] = str(os.getpid())  # marks the warm zygotes to end: launch.stop_zygotes
    from pyspark.sql import SparkSession

    spark = (SparkSession.builder.master(f"local[{NP}]").appName("sparkhvd-bench-vs-torchdistributor")
             .config("spark.ui.enabled", "false")
             .config("spark.ui.showConsoleProgress", "false")
             .getOrCreate())
    sc = spark.sparkContext
    sc.setLogLevel("ERROR")
    try:
        sides = distributors()
        launch.timed(launch.make_floor(sc))  # Spark starts its Python workers: charged to neither side
        first = {}
        for name in ("ours", "theirs"):
            first[name] = launch.timed(lambda: check(run_on(sides[name], ddp_launch) == NP, name))
            log(f"first launch {name}: {first[name]:.2f} s")
        launches: dict[str, list[float]] = {"ours": [], "theirs": []}
        rates: dict[str, list[float]] = {"ours": [], "theirs": []}
        trains: dict[str, list[float]] = {"ours": [], "theirs": []}  # the training runs' wall seconds
        info = {}
        for rnd in range(args.rounds):
            order = ["ours", "theirs"] if rnd % 2 == 0 else ["theirs", "ours"]
            for name in order:
                launches[name].append(launch.timed(lambda: check(run_on(sides[name], ddp_launch) == NP, name)))
            for name in order:
                box = {}
                trains[name].append(launch.timed(
                    lambda: box.update(run_on(sides[name], ddp_train, args.steps, args.warmup))))
                rates[name].append(box["steps_per_s"])
                info[name] = box
            log(f"round {rnd + 1}/{args.rounds}: launch " + ", ".join(f"{n} {launches[n][-1]:.2f} s" for n in order)
                + "; training run " + ", ".join(f"{n} {trains[n][-1]:.2f} s ({rates[n][-1]:.1f} steps/s)"
                                                 for n in order))
        faults: dict[tuple[str, str], dict] = {}
        sc.setLogLevel("OFF")  # each of theirs' faults logs the executor's Java stack trace (ERROR Executor)
        for i, fault in enumerate(("raise", "kill")):
            for name in (["ours", "theirs"] if i % 2 == 0 else ["theirs", "ours"]):
                faults[name, fault] = got = fault_run(sc, sides[name], fault, args, scratch)
                seconds = "-" if got["seconds"] is None else f"{got['seconds']:.2f} s"
                log(f"fault {fault} {name}: {seconds}: {got['line']}")
                if args.verbose:
                    log(f"--- {name} {fault}: full error ---\n{got['text']}\n--- captured output ---\n{got['out']}")
    finally:
        spark.stop()
        launch.stop_zygotes()
        shutil.rmtree(scratch, ignore_errors=True)

    import pyspark
    import torch

    labels = {"ours": "ours: sparkhvd.TorchDistributor", "theirs": "theirs: pyspark.ml.torch TorchDistributor"}

    def fault_cell(got):
        return f">{args.cap:.0f}" if got["seconds"] is None else f"{got['seconds']:.2f}"

    rows = [[labels[n], f"{first[n]:.2f}", spread(launches[n]), spread(rates[n], 1), spread(trains[n]),
             fault_cell(faults[n, "raise"]), fault_cell(faults[n, "kill"])] for n in ("ours", "theirs")]
    print(f"\n## DDP under TorchDistributor(num_processes={NP}, local_mode=False, use_gpu=False) on local[{NP}]: "
          f"{args.rounds} rounds, median (min-max)\n")
    print(launch.table(["", "first launch s", "warm launch s", "steps/s", "training run s", "s to error: raise",
                        "s to error: SIGKILL"], rows))
    print("\nThe error the driver raises, first line (names the cause: yes/no):\n")
    print(launch.table(["side", "fault", "cause", "first line"],
                       [[n, f, "yes" if faults[n, f]["cause"] else "no", faults[n, f]["line"]]
                        for f in ("raise", "kill") for n in ("ours", "theirs")]))
    launch_ratio = statistics.median(launches["ours"]) / statistics.median(launches["theirs"])
    rate_ratio = statistics.median(rates["ours"]) / statistics.median(rates["theirs"])
    paired = [o / t for o, t in zip(rates["ours"], rates["theirs"])]  # each round's two runs ran back to back
    ours_cause = [faults["ours", f]["seconds"] if faults["ours", f]["cause"] else None for f in ("raise", "kill")]
    worst = None if None in ours_cause else max(ours_cause)
    print(f"\nwarm launch ours / theirs (medians): {launch_ratio:.3f}   goal <= {LAUNCH_GOAL:.2f}: "
          f"{verdict(launch_ratio <= LAUNCH_GOAL)}")
    print(f"steps/s ours / theirs: each round's pair, median {spread(paired, 3)}; of the medians "
          f"{rate_ratio:.3f}   goal >= {STEPS_GOAL:.2f} (paired median): "
          f"{verdict(statistics.median(paired) >= STEPS_GOAL)}")
    print(f"ours: seconds to an error that names the true cause (worse of the two faults): "
          f"{'never' if worst is None else f'{worst:.2f}'}   goal <= {CAUSE_GOAL_S:.0f} s: "
          f"{verdict(worst is not None and worst <= CAUSE_GOAL_S)}")
    print("\nNotes:")
    print("- training run s: the wall seconds of each whole ddp_train run() (launch, warm-up, timed steps, exit).")
    print(f"- model: {info['ours']['params']:,} parameters, batch 64, {args.warmup} warm-up steps then {args.steps} "
          "timed inside the function, rank 0's rate; threads per rank (torch.get_num_threads, OMP_NUM_THREADS): "
          + ", ".join(f"{n} {info[n]['threads']} ({info[n]['OMP_NUM_THREADS']})" for n in ("ours", "theirs")) + ".")
    print(f"- faults: rank {FAULT_RANK} fails at step {FAULT_STEP} of the timed loop; seconds from its time.time() "
          f"stamp to run() raising on the driver; init_process_group(timeout={args.pg_timeout:.0f} s); a run "
          f"with no error {args.cap:.0f} s after the fault shows '>{args.cap:.0f}' and was cancelled.")
    print("- first launch: each side's first run in the session, ours first, after one bare Spark job; ours' "
          "ranks start as fresh processes there and are forked from the warm process afterwards.")
    print(f"\nmachine: {os.cpu_count()} CPUs ({platform.machine()}), python {platform.python_version()}, torch "
          f"{torch.__version__}, pyspark {pyspark.__version__}, {pandas}; whole benchmark "
          f"{time.perf_counter() - wall:.0f} s")
    return 0


def check(ok: bool, name: str) -> None:
    if not ok:
        raise AssertionError(f"{name}: ddp_launch did not return the world size {NP}")


def verdict(ok: bool) -> str:
    return "met" if ok else "NOT met"


def log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
