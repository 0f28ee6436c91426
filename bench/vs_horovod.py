"""Benchmark (not a test): sparkhvd against Horovod itself, the same body on both, np=2, gloo.

One body (``rank_body`` below) runs on 2 rank processes, written against Horovod's torch API
and imported as either ``horovod.torch`` or ``sparkhvd.collective.torch``. Each rank process
has OMP_NUM_THREADS=1 and ``torch.set_num_threads(1)``. Rank 0 measures:

- allreduce_ in place, ``hvd.allreduce_(t, op=hvd.Sum)``, fp32 4 KB, 64 KB, 1 MB, 16 MB, 64 MB:
  the median over ``--reps`` timings (each between barriers; small sizes repeated within a
  timing so that it is long enough to read) of the time per call;
- 64 x 4 KB ``allreduce_async_`` issued together, then ``synchronize`` on each: time per op;
- an MLP of 2.9M parameters (784-1024-1024-1024-10, batch 64, SGD) wrapped in
  ``hvd.DistributedOptimizer``: steps per second over ``--steps`` steps after 5 warm-up steps;
- start-up: from the launcher's Popen to the first allreduce done on rank 0 (seconds), and from
  rank 0's own process start (its age from /proc, 10 ms resolution) to the same point.

How the ranks start: sparkhvd's are 2 plain subprocesses with torchrun's variables (RANK,
WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), which ``hvd.init()`` reads
outside Spark. Horovod's gloo mode needs its rendezvous server, so its ranks start under
``horovodrun -np 2 -H localhost:2 --gloo`` (the one next to ``--horovod-python``); the Popen row
therefore includes horovodrun's own start-up, and the process-start row leaves both launchers out.

The two alternate, Horovod's run then ours, ``--pairs`` times, so that drift on the machine hits
both alike; the table shows the median over the pairs of each run's value, the ratio
sparkhvd/Horovod of those medians and the range of the per-pair ratios. Without
``--horovod-python`` only sparkhvd runs. About two minutes with the defaults on 2 CPUs.

    python bench/vs_horovod.py --horovod-python /tmp/hvdbuild/venv/bin/python [--pairs 4]
    python bench/vs_horovod.py          # sparkhvd only

``--horovod-python`` is an interpreter where ``import horovod.torch`` works (Horovod built with
gloo against the same torch).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

NP = 2
SIZES = [4 * 2 ** 10, 64 * 2 ** 10, 2 ** 20, 16 * 2 ** 20, 64 * 2 ** 20]
BURST = 64  # async allreduces in flight together
MLP = [784, 1024, 1024, 1024, 10]


# --- the rank processes ------------------------------------------------------------------------
def rank_body(framework: str, reps: int, steps: int) -> dict | None:
    """Runs on every rank; returns rank 0's measurements (None elsewhere)."""
    started = process_start_time()
    import torch
    import torch.nn as nn

    if framework == "horovod":
        import horovod.torch as hvd
    else:
        import sparkhvd.collective.torch as hvd
    hvd.init()
    hvd.allreduce_(torch.zeros(1024), op=hvd.Sum)
    first_done = time.time()
    torch.set_num_threads(1)

    def per_call(fn, inner: int) -> float:
        """Median over ``reps`` timings of ``inner`` calls of ``fn``, per call (seconds)."""
        fn()  # warm up
        runs = []
        for _ in range(reps):
            hvd.barrier()
            start = time.perf_counter()
            for _ in range(inner):
                fn()
            runs.append((time.perf_counter() - start) / inner)
        return statistics.median(runs)

    result = {"startup_proc": first_done - started, "first_done": first_done, "size": hvd.size()}
    for size in SIZES:
        t = torch.zeros(size // 4)  # zeros: sums stay 0, no inf or denormals after many rounds
        inner = max(1, min(200, (64 * 2 ** 20) // size // 4))
        result[f"allreduce_{size}"] = per_call(lambda: hvd.allreduce_(t, op=hvd.Sum), inner)

    burst = [torch.zeros(1024) for _ in range(BURST)]

    def async_burst():
        handles = [hvd.allreduce_async_(x, op=hvd.Sum) for x in burst]
        for h in handles:
            hvd.synchronize(h)

    result["async_per_op"] = per_call(async_burst, 10) / BURST

    torch.manual_seed(0)
    layers = []
    for a, b in zip(MLP, MLP[1:]):
        layers += [nn.Linear(a, b), nn.ReLU()]
    model = nn.Sequential(*layers[:-1])
    result["mlp_params"] = sum(p.numel() for p in model.parameters())
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                   named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    x, y = torch.randn(64, MLP[0]), torch.randint(0, MLP[-1], (64,))

    def step():
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    for _ in range(5):
        step()
    hvd.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    result["mlp_steps_per_s"] = steps / (time.perf_counter() - start)
    hvd.barrier()
    return result if hvd.rank() == 0 else None


def process_start_time() -> float:
    """This process's start (seconds since the epoch): its age from /proc (Linux), taken from now."""
    with open("/proc/self/stat") as f:
        start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22: start, ticks after boot
    with open("/proc/uptime") as f:
        uptime = float(f.read().split()[0])
    return time.time() - (uptime - start_ticks / os.sysconf("SC_CLK_TCK"))


# --- the driver --------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_once(framework: str, args, out: Path) -> dict:
    """Starts one np=2 job of ``framework``; returns rank 0's result plus the Popen-to-first time."""
    body = ["--rank-body", framework, "--out", str(out), "--reps", str(args.reps), "--steps", str(args.steps)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    launched = time.time()
    if framework == "horovod":
        horovodrun = str(Path(args.horovod_python).with_name("horovodrun"))
        cmd = [horovodrun, "-np", str(NP), "-H", f"localhost:{NP}", "--gloo", args.horovod_python, __file__, *body]
        procs = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)]
    else:
        port = free_port()
        procs = []
        for rank in range(NP):
            rank_env = dict(env, RANK=str(rank), WORLD_SIZE=str(NP), LOCAL_RANK=str(rank),
                            LOCAL_WORLD_SIZE=str(NP), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            procs.append(subprocess.Popen([sys.executable, __file__, *body], env=rank_env,
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = [p.communicate(timeout=args.timeout)[0] for p in procs]
    if any(p.returncode for p in procs) or not out.exists():
        raise SystemExit(f"{framework} run failed:\n" + "\n".join(outputs))
    result = json.loads(out.read_text())
    result["startup_popen"] = result["first_done"] - launched
    return result


ROWS = [  # (key, label, scale, unit); steps/s is the one where higher is better
    *[(f"allreduce_{s}", f"allreduce_ {s // 2 ** 10} KB" if s < 2 ** 20 else f"allreduce_ {s // 2 ** 20} MB",
       1e6 if s < 2 ** 20 else 1e3, "us" if s < 2 ** 20 else "ms") for s in SIZES],
    ("async_per_op", f"{BURST} x 4 KB allreduce_async_ + synchronize, per op", 1e6, "us"),
    ("mlp_steps_per_s", "MLP {params:.2f}M params, DistributedOptimizer (higher is better)", 1, "steps/s"),
    ("startup_popen", "Popen -> init() + first allreduce done", 1, "s"),
    ("startup_proc", "rank 0 process start -> init() + first allreduce done", 1, "s"),
]


def fmt(value: float) -> str:
    return f"{value:.0f}" if value >= 100 else f"{value:.3g}"


def print_table(runs: dict) -> None:
    ours, theirs = runs["sparkhvd"], runs.get("horovod")
    params = ours[0]["mlp_params"] / 1e6
    pairs = len(ours)
    if theirs:
        print(f"\n## sparkhvd vs Horovod 0.28.1, np={NP}, gloo, OMP_NUM_THREADS=1; median of {pairs} alternating "
              f"pairs\n")
        print("| measure | unit | Horovod | sparkhvd | sparkhvd/Horovod | per-pair ratios (min-max) |")
        print("|---|---|---|---|---|---|")
    else:
        print(f"\n## sparkhvd alone (no --horovod-python), np={NP}, gloo; median of {pairs} runs\n")
        print("| measure | unit | sparkhvd |")
        print("|---|---|---|")
    for key, label, scale, unit in ROWS:
        label = label.format(params=params)
        mine = statistics.median(r[key] for r in ours) * scale
        if not theirs:
            print(f"| {label} | {unit} | {fmt(mine)} |")
            continue
        other = statistics.median(r[key] for r in theirs) * scale
        ratios = [a[key] / b[key] for a, b in zip(ours, theirs)]
        print(f"| {label} | {unit} | {fmt(other)} | {fmt(mine)} | {mine / other:.2f} | "
              f"{min(ratios):.2f}-{max(ratios):.2f} |")
    import torch

    print(f"\nmachine: {os.cpu_count()} CPUs, torch {torch.__version__}; Horovod's ranks under horovodrun --gloo, "
          f"ours as plain subprocesses with torchrun's variables; ratios < 1 mean sparkhvd is faster, except "
          f"steps/s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--horovod-python", help="an interpreter where horovod.torch imports (built with gloo)")
    parser.add_argument("--pairs", type=int, default=4, help="alternating runs of each (default 4)")
    parser.add_argument("--reps", type=int, default=5, help="timings per allreduce measure within a run")
    parser.add_argument("--steps", type=int, default=30, help="timed MLP steps within a run")
    parser.add_argument("--timeout", type=float, default=600, help="seconds one run may take")
    parser.add_argument("--rank-body", choices=["horovod", "sparkhvd"], help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.rank_body:  # a rank process started by run_once
        result = rank_body(args.rank_body, args.reps, args.steps)
        if result is not None:
            Path(args.out).write_text(json.dumps(result))
        return

    frameworks = ["horovod", "sparkhvd"] if args.horovod_python else ["sparkhvd"]
    runs = {f: [] for f in frameworks}
    with tempfile.TemporaryDirectory() as tmp:
        for pair in range(args.pairs):
            for framework in frameworks:
                runs[framework].append(run_once(framework, args, Path(tmp) / f"{framework}-{pair}.json"))
                print(f"pair {pair + 1}/{args.pairs}: {framework} done", file=sys.stderr, flush=True)
    print_table(runs)


if __name__ == "__main__":
    main()
