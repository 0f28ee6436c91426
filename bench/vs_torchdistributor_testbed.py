"""``python bench/vs_torchdistributor.py --testbed``: the warm launch with 2 GPUs per Spark task, on 2 hosts.

tests/cluster's testbed (docs/cluster-tests.md: root, iproute2, util-linux, Java): 2 network-namespace hosts,
each a Spark standalone Worker of 2 cores and 2 fake GPUs (host B's executors see ``CUDA_VISIBLE_DEVICES=6,7``,
as in the cluster tests). This process is the driver: a SparkSession on the testbed's master with tests/cluster's
settings (tests/cluster/_driver.py's ``session``) and ``spark.task.resource.gpu.amount=2``, so one task per host
holds both of its GPUs. The same function then runs under

- theirs: ``pyspark.ml.torch.distributor.TorchDistributor(num_processes=4, local_mode=False, use_gpu=True)``:
  num_processes / 2 = 2 barrier tasks, each ``torchrun --nnodes=2 --nproc_per_node=2``
- ours:   ``sparkhvd.TorchDistributor`` with the same arguments: 2 tasks of 2 processes, each task a torchrun node

``ddp_launch_layout`` (bench/vs_torchdistributor.py) imports torch, calls ``init_process_group("gloo")`` (env://)
and allreduces one small tensor in which each process has written its ``RANK``, ``LOCAL_RANK``, ``NODE_RANK``,
``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, a checksum of its hostname and its ``CUDA_VISIBLE_DEVICES`` ids (fake: the
function never touches CUDA). Every run's rows are checked: ranks 0,1 on one host and 2,3 on the other, LOCAL_RANK
r % 2, NODE_RANK r // 2, WORLD_SIZE 4, LOCAL_WORLD_SIZE 2, and both processes of a node listing the same 2 GPUs.

Timed as in the local mode: one bare barrier stage of 2 tasks first (charged to neither), each side's first run
(ours first), then ``--rounds`` warm runs, the order reversed every other round; the floor (that bare stage)
is timed each round too. A side whose run raises or gives the wrong layout shows why in its row and is not run
again; a run with no answer within ``RUN_CAP_S`` is cancelled. The testbed is built and removed by
tests/cluster's ``Cluster``; everything (namespaces, JVMs, processes, folders) goes at the end, on Ctrl-C and on
SIGTERM. About 3 minutes on 2 cores with ``--rounds 3``: the testbed and session start (~45 s), then mostly
pyspark's runs (~20 s each). Numbers: bench/README.md.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import io
import os
import platform
import re
import signal
import statistics
import sys
import tempfile
import threading
import time
import zlib

import launch  # bench/launch.py: table, make_peer, make_floor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HOSTS = 2
GPUS_PER_TASK = 2  # spark.task.resource.gpu.amount: each host's one task holds both of its GPUs
NP = HOSTS * GPUS_PER_TASK
HOST_B_VISIBLE_DEVICES = "6,7"  # tests/cluster/conftest.py's: Spark's addresses "0", "1" index this list
RUN_CAP_S = 300.0  # a run with no answer by then is cancelled and reported
LABELS = {"ours": "ours: sparkhvd.TorchDistributor", "theirs": "theirs: pyspark.ml.torch TorchDistributor"}
# An exception's own line in a traceback or a Java "Caused by:" (the last one that is not a wrapper is the cause)
_ERROR_LINE = re.compile(r"^\s*(?:Caused by: )?([A-Za-z_][\w.]*(?:Error|Exception|Failure|Interrupt)): (.+)$")
_WRAPPERS = ("Py4JJavaError", "SparkException", "PythonException", "ChildFailedError")


@dataclasses.dataclass(frozen=True)
class Attempt:
    """One run() of a side: its wall seconds and value, or why it gave none."""

    seconds: float | None
    value: object = None
    error: str = ""  # the exception as raised ("" when it returned)
    output: str = ""  # what the run printed on the driver (pyspark relays its tasks' output)


def unavailable_reason() -> str | None:
    sys.path.insert(0, ROOT)
    from tests.cluster._netns import unavailable_reason as reason

    return reason()


def attempt(sc, fn) -> Attempt:
    """``fn()`` in a thread, its prints kept aside; cancels Spark's jobs if it has not returned within RUN_CAP_S."""
    box: dict = {}
    out = io.StringIO()

    def call():
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
                start = time.perf_counter()
                box["value"] = fn()
                box["seconds"] = time.perf_counter() - start
        except BaseException as exc:  # noqa: BLE001 - reported in the row
            box["error"] = f"{type(exc).__name__}: {exc}"

    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    thread.join(RUN_CAP_S)
    if thread.is_alive():
        sc.cancelAllJobs()
        thread.join(120)
        if thread.is_alive():  # still inside redirect_stdout: give this process its own streams back
            sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__
        return Attempt(None, error=f"no answer within {RUN_CAP_S:.0f} s; its Spark job was cancelled. "
                                   + box.get("error", ""), output=out.getvalue())
    if "error" in box:
        return Attempt(None, error=box["error"], output=out.getvalue())
    return Attempt(box["seconds"], box["value"], output=out.getvalue())


def cause(text: str, width: int = 160) -> str:
    """The line of an error's text that names its cause: the last exception line that is not a wrapper's."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    found = [m.group(0).strip() for ln in lines if (m := _ERROR_LINE.match(ln)) and
             not m.group(1).endswith(_WRAPPERS)]
    line = found[-1] if found else (lines[0] if lines else "")
    return line if len(line) <= width else line[:width - 3] + "..."


def layout_problem(rows, hostnames: dict) -> str | None:
    """Why ``ddp_launch_layout``'s rows are not 2 tasks of 2 processes as torchrun numbers them (None: they are)."""
    if not isinstance(rows, list) or len(rows) != NP:
        return f"returned {rows!r}, not {NP} rows"
    for r, row in enumerate(rows):
        want = {"RANK": r, "LOCAL_RANK": r % GPUS_PER_TASK, "NODE_RANK": r // GPUS_PER_TASK, "WORLD_SIZE": NP,
                "LOCAL_WORLD_SIZE": GPUS_PER_TASK, "gpus": GPUS_PER_TASK}
        wrong = {k: row[k] for k, v in want.items() if row[k] != v}
        if wrong:
            return f"rank {r} has {wrong}, torchrun's would be {dict((k, want[k]) for k in wrong)}"
    nodes = [rows[n * GPUS_PER_TASK:(n + 1) * GPUS_PER_TASK] for n in range(HOSTS)]
    for n, node in enumerate(nodes):
        if len({(p["host"], p["gpu0"], p["gpu1"]) for p in node}) != 1:
            return f"node {n}'s processes are on different hosts or see different GPUs: {node}"
    if len({node[0]["host"] for node in nodes}) != HOSTS or any(node[0]["host"] not in hostnames for node in nodes):
        return f"the nodes are not on the testbed's {HOSTS} hosts: {[node[0]['host'] for node in nodes]}"
    return None


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})" if values else "-"


def main(args, launch_fn) -> int:
    """Run the comparison on a fresh testbed and print its table; ``launch_fn`` is ddp_launch_layout, defined in
    ``__main__`` so that both picklers send it by value."""
    reason = unavailable_reason()
    if reason:
        print(f"bench/vs_torchdistributor.py --testbed skipped: no cluster testbed here: {reason}")
        return 0
    from tests.cluster._cluster import Cluster
    from tests.cluster._driver import session, wait_ready
    from tests.cluster._netns import DRIVER_ADDRESS

    wall = time.perf_counter()
    cluster = Cluster(HOSTS, python=sys.executable, host_env={1: {"CUDA_VISIBLE_DEVICES": HOST_B_VISIBLE_DEVICES}})
    atexit.register(cluster.close)
    previous = {sig: signal.signal(sig, _interrupt) for sig in (signal.SIGTERM, signal.SIGHUP)}
    spark = None
    try:
        cluster.start(timeout=240)
        # Cluster.start's own driver (tests/cluster/_driver.py, one GPU per task) makes way for this process's
        # session: a process may hold one SparkContext, and this one runs both sides' run() in-process.
        cluster.driver.close()
        cluster.driver = None
        scratch = cluster._dir("driver", "tmp")  # goes with the testbed: the runs' log folders, Spark's temp files
        os.environ.update(TMPDIR=scratch, PYSPARK_PYTHON=sys.executable, SPARK_LOCAL_IP=DRIVER_ADDRESS,
                          PYSPARK_SUBMIT_ARGS=f"--driver-java-options -Djava.io.tmpdir={scratch} pyspark-shell")
        tempfile.tempdir = scratch
        config = {"master": cluster.master_url, "conf": {"spark.task.resource.gpu.amount": str(GPUS_PER_TASK)},
                  "executor_env": {}, "executors": HOSTS, "slots": HOSTS}
        spark = session(config)
        sc = spark.sparkContext
        wait_ready(sc, config)
        sc.setLogLevel("ERROR")
        up = time.perf_counter() - wall
        log(f"testbed up in {cluster.start_seconds:.1f} s, session with {GPUS_PER_TASK} GPUs per task at {up:.1f} s")
        results = compare(sc, args, launch_fn, {zlib.crc32(h.hostname.encode()): h.hostname for h in cluster.hosts})
    finally:
        if spark is not None:
            spark.stop()
        problems = cluster.close()
        atexit.unregister(cluster.close)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if problems:
            log(f"testbed cleanup problems: {problems}")
    report(results, args, up, time.perf_counter() - wall)
    return 0


@dataclasses.dataclass
class Side:
    """What one side's runs gave: the seconds of its good runs, its last good rows, why it stopped (if it did)."""

    first: float | None = None
    warm: list = dataclasses.field(default_factory=list)
    rows: list | None = None
    failed: str = ""


def compare(sc, args, launch_fn, hostnames: dict) -> dict:
    """Each side's first and warm runs, and the floor's; a side stops at its first failed run."""
    from pyspark.ml.torch.distributor import TorchDistributor as Theirs

    from sparkhvd import TorchDistributor as Ours

    launch.make_peer()  # only for its side effect: pyspark's TorchDistributor logger keeps its warnings only
    classes = {"ours": Ours, "theirs": Theirs}
    sides = {name: Side() for name in classes}
    floor = launch.make_floor(sc)  # a bare barrier stage of 2 tasks (launch.NP), one per host
    warmup = attempt(sc, floor)  # Spark starts its Python workers on both hosts: charged to neither side
    if warmup.error:
        raise RuntimeError(f"a bare barrier stage of {HOSTS} tasks failed on the testbed: {warmup.error}")
    floors: list[float] = []

    def one(name: str, first: bool) -> str:
        side = sides[name]
        if side.failed:
            return f"{name} -"
        got = attempt(sc, lambda: classes[name](num_processes=NP, local_mode=False, use_gpu=True).run(launch_fn))
        side.failed = got.error and f"failed: {cause(got.error)}" or layout_problem(got.value, hostnames) or ""
        if side.failed:
            log(f"{name}: {side.failed}\n--- its error ---\n{got.error}\n--- what it printed (last 40 lines) ---\n"
                + "".join(got.output.splitlines(keepends=True)[-40:]))
            return f"{name} {side.failed}"
        side.rows = got.value
        if first:
            side.first = got.seconds
        else:
            side.warm.append(got.seconds)
        if args.verbose:
            log(f"--- {name}: what it printed ---\n{got.output}")
        return f"{name} {got.seconds:.2f} s"

    for name in classes:
        log(f"first launch: {one(name, first=True)}")
    for rnd in range(args.rounds):
        order = ["ours", "theirs"] if rnd % 2 == 0 else ["theirs", "ours"]
        done = [one(name, first=False) for name in order]
        floor_run = attempt(sc, floor)
        if floor_run.seconds is not None:
            floors.append(floor_run.seconds)
            done.append(f"floor {floor_run.seconds:.2f} s")
        log(f"round {rnd + 1}/{args.rounds}: " + ", ".join(done))
    return {"sides": sides, "floors": floors, "hostnames": hostnames}


def report(results: dict, args, up: float, wall: float) -> None:
    import pyspark
    import torch

    sides, hostnames = results["sides"], results["hostnames"]
    good = f"{HOSTS} tasks x {GPUS_PER_TASK} processes, as torchrun numbers them"
    rows = [[LABELS[n], "-" if s.first is None else f"{s.first:.2f}", spread(s.warm), len(s.warm), s.failed or good]
            for n, s in sides.items()]
    rows.append([f"floor: a bare barrier stage of {HOSTS} tasks", "-", spread(results["floors"]),
                 len(results["floors"]), "-"])
    print(f"\n## Warm launch under TorchDistributor(num_processes={NP}, local_mode=False, use_gpu=True) on the "
          f"{HOSTS}-host testbed, spark.task.resource.gpu.amount={GPUS_PER_TASK}: {args.rounds} rounds, median "
          f"(min-max)\n")
    print(launch.table(["", "first launch s", "warm launch s", "warm runs", "layout"], rows))
    ours, theirs = sides["ours"], sides["theirs"]
    if ours.warm and theirs.warm:
        ratio = statistics.median(ours.warm) / statistics.median(theirs.warm)
        print(f"\nwarm launch ours / theirs (medians): {ratio:.3f}   goal <= 0.05: "
              f"{'met' if ratio <= 0.05 else 'NOT met'}")
    else:
        print("\nwarm launch ours / theirs: not measured (" + "; ".join(
            f"{n} {s.failed}" for n, s in sides.items() if s.failed) + ")")
    print("\nEach process's torchrun variables and CUDA_VISIBLE_DEVICES, as its side's last good run gathered them:\n")
    detail = [[n, row["RANK"], hostnames.get(row["host"], f"? (crc {row['host']})"), row["LOCAL_RANK"],
               row["NODE_RANK"], row["WORLD_SIZE"], row["LOCAL_WORLD_SIZE"],
               ",".join(str(row[k]) for k in ("gpu0", "gpu1") if row[k] >= 0)]
              for n, s in sides.items() for row in s.rows or []]
    print(launch.table(["side", "RANK", "host", "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
                        "CUDA_VISIBLE_DEVICES"], detail) if detail else "(no run returned)")
    print("\nNotes:")
    print("- ddp_launch_layout: import torch, init_process_group('gloo') via env://, one allreduce of a "
          f"{NP}-row float64 table (each process writes its own row), destroy_process_group; CPU tensors only.")
    print("- first launch: each side's first run in the session, ours first, after one bare Spark stage on both "
          "hosts; the floor is that stage, timed after each round's two runs.")
    print(f"\nmachine: {os.cpu_count()} CPUs ({platform.machine()}) shared by the {HOSTS} hosts, python "
          f"{platform.python_version()}, torch {torch.__version__}, pyspark {pyspark.__version__}; testbed and "
          f"session up in {up:.0f} s, whole benchmark {wall:.0f} s")


def _interrupt(signum, frame):  # SIGTERM/SIGHUP: unwind like Ctrl-C, so that the testbed is removed
    raise KeyboardInterrupt(f"signal {signum}")


def log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)
