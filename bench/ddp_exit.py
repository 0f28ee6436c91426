"""Benchmark (not a test): how often PyTorch's DDP tutorial ending hangs a run, under sparkhvd and under torchrun.

The tutorial ends its training with ``cleanup()`` = ``dist.destroy_process_group()`` while the DDP model is still
alive, then returns; the model is freed as the function returns (docs/performance.md, "The DDP tutorial's
ending"). The rank body: 2 ranks on gloo, ``Linear(6, 1)`` under ``DistributedDataParallel``, 20 SGD steps on
``arange(6) + 1 + 6 * rank``, then the destroy with the model alive. Each run is a driver process of its own:

- function: ``HorovodRunner(np=-2).run(train)``, ``train`` that body (it imports torch itself, as a notebook
  cell's function would, so a fresh rank imports torch inside the user's code);
- script: ``HorovodRunner(np=-2).run("train.py")``, the same body as a script (run as ``__main__``);
- each with the warm process (the default) and with ``SPARKHVD_WARM=0`` (fresh rank processes);
- the peer: ``torchrun --standalone --nnodes=1 --nproc_per_node=2 train.py``, where ``.venv/bin/torchrun``
  (this interpreter's folder) exists.

The runs are interleaved (one of each setup per round), with ``--hogs`` CPU hogs (``while True: pass``)
running throughout, so that a busy machine's noise hits every setup alike. A run that has not ended within
``--timeout`` seconds is a hang: its process group is killed and the run counted; a run that ends with an
error, or whose rank 0 weights are not the expected ones (the weights after 20 steps of the averaged
gradient, computed here), is an error. Prints one row per setup: runs, hangs, errors, median seconds.

``--code DIR`` measures another sparkhvd: DIR holds a ``sparkhvd`` package, put first on ``PYTHONPATH``
(e.g. an older commit: ``mkdir -p DIR/sparkhvd && git archive COMMIT | tar -x -C DIR/sparkhvd``). Everything
the benchmark starts carries a mark in its environment; at the end it kills what is left with that mark (the
warm zygotes it started too) and removes its temp folder.

    python bench/ddp_exit.py                       # 100 runs of each setup (about an hour on 2 busy cores)
    python bench/ddp_exit.py --runs 30 --setups function-warm,script-warm --code /tmp/unfixed
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NP = 2
STEPS = 20
LR = 0.01
MARK = "SPARKHVD_BENCH_DDP_EXIT"

BODY = textwrap.dedent(f"""\
    import torch
    import torch.distributed as dist
    dist.init_process_group("gloo")  # env://, set by sparkhvd (or torchrun)
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 1)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr={LR})
    x = (torch.arange(6.0) + 1 + 6 * rank).reshape(1, 6)
    for _ in range({STEPS}):
        opt.zero_grad()
        ddp(x).sum().backward()
        opt.step()
    weights = model.weight.detach().flatten().tolist() + model.bias.detach().tolist()
    dist.destroy_process_group()  # the tutorial's cleanup(): the DDP model is still alive
""")

# One write per line: torchrun's two ranks share one pipe, and print() under PYTHONUNBUFFERED writes the newline apart.
SCRIPT = BODY + 'import json, os\nos.write(1, f"WEIGHTS {rank} {json.dumps(weights)}\\n".encode())\n'

DRIVER = ("import json, sys\n"
          "from sparkhvd import HorovodRunner\n\n"
          "def train():\n" + textwrap.indent(BODY, "    ") + "    return weights\n\n"
          "if sys.argv[1] == 'function':\n"
          "    print('RESULT', json.dumps(HorovodRunner(np=-2).run(train)), flush=True)\n"
          "else:\n"
          "    HorovodRunner(np=-2).run(sys.argv[2])\n")

SETUPS = ("function-warm", "script-warm", "function-fresh", "script-fresh", "torchrun")
LABELS = {"function-warm": "sparkhvd, function, warm process", "script-warm": "sparkhvd, script, warm process",
          "function-fresh": "sparkhvd, function, SPARKHVD_WARM=0", "script-fresh": "sparkhvd, script, SPARKHVD_WARM=0",
          "torchrun": "torchrun --nproc_per_node=2, script"}


def expected_weights() -> list:
    """Rank 0's weights after ``STEPS`` steps of DDP's averaged gradient: d(sum(Wx + b))/dW = x, /db = 1."""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Linear(6, 1)
    mean_x = torch.arange(6.0) + 1 + 6 * (NP - 1) / 2
    w = model.weight.detach().flatten() - STEPS * LR * mean_x
    b = model.bias.detach() - STEPS * LR
    return w.tolist() + b.tolist()


def _weights(out: str) -> list | None:
    """Rank 0's weights in a run's output (a function's ``RESULT``, a script's rank 0 line), or None."""
    for line in out.splitlines():
        for tag in ("RESULT ", "WEIGHTS 0 "):
            if tag in line:
                try:
                    return json.JSONDecoder().raw_decode(line.split(tag, 1)[1])[0]
                except ValueError:
                    return None
    return None


def one_run(setup: str, folder: str, env: dict, timeout: float) -> tuple:
    """``(outcome, seconds, tail)``: outcome is "ok", "hang" or "error"."""
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    if setup == "torchrun":
        argv = [torchrun, "--standalone", "--nnodes=1", f"--nproc_per_node={NP}", "train.py"]
        env = {k: v for k, v in env.items() if not k.startswith("SPARKHVD_") or k == MARK}
    else:
        argv = [sys.executable, "drive.py", setup.split("-")[0], "train.py"]
        env = dict(env, SPARKHVD_WARM="1" if setup.endswith("warm") else "0")
    start = time.monotonic()
    proc = subprocess.Popen(argv, cwd=folder, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(proc.pid)
        out, _ = proc.communicate()
        kill_marked(env[MARK], spare_zygotes=True)  # a rank that outlived its driver
        return "hang", time.monotonic() - start, out[-2000:]
    seconds = time.monotonic() - start
    if proc.returncode != 0:
        return "error", seconds, out[-2000:]
    got = _weights(out)
    if got is None or not all(abs(a - b) <= 1e-4 * max(1.0, abs(b)) for a, b in zip(got, EXPECTED, strict=True)):
        return "error", seconds, f"rank 0's weights {got}, expected {EXPECTED}\n" + out[-2000:]
    return "ok", seconds, ""


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except OSError:
        pass


def marked_processes(mark: str) -> list:
    """``(pid, cmdline)`` of every process whose environment holds ``MARK=mark``."""
    found, entry = [], f"{MARK}={mark}".encode()
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                if entry not in f.read().split(b"\0"):
                    continue
            with open(f"/proc/{name}/cmdline", "rb") as f:
                found.append((int(name), f.read().replace(b"\0", b" ").decode(errors="replace")))
        except OSError:
            pass
    return found


def kill_marked(mark: str, spare_zygotes: bool = False) -> int:
    """Kill what this benchmark started and left running; returns how many."""
    killed = 0
    for pid, cmdline in marked_processes(mark):
        if spare_zygotes and "sparkhvd.runner._warm.server" in cmdline:
            continue
        try:
            os.kill(pid, signal.SIGKILL)
            killed += 1
        except OSError:
            pass
    return killed


EXPECTED: list = []


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=100, help="runs of each setup")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds after which a run is a hang")
    parser.add_argument("--hogs", type=int, default=2, help="CPU hogs running throughout")
    parser.add_argument("--setups", default=",".join(SETUPS), help=f"comma-separated, of {', '.join(SETUPS)}")
    parser.add_argument("--code", help="a folder holding the sparkhvd package to measure (first on PYTHONPATH)")
    parser.add_argument("--verbose", action="store_true", help="print each hang's and error's output")
    args = parser.parse_args()
    setups = [s.strip() for s in args.setups.split(",") if s.strip()]
    bad = [s for s in setups if s not in SETUPS]
    if bad:
        parser.error(f"unknown setup {bad[0]!r}; choose from {', '.join(SETUPS)}")
    if "torchrun" in setups and not os.path.exists(os.path.join(os.path.dirname(sys.executable), "torchrun")):
        print("torchrun is not installed beside this interpreter: no peer row", file=sys.stderr)
        setups.remove("torchrun")
    EXPECTED[:] = expected_weights()

    folder = tempfile.mkdtemp(prefix="sparkhvd-bench-ddp-exit-")
    mark = f"{os.getpid()}-{os.urandom(4).hex()}"
    env = dict(os.environ, TMPDIR=folder, PYSPARK_PYTHON=sys.executable, **{MARK: mark})
    env.pop("OMP_NUM_THREADS", None)  # each launcher sets its own (torchrun: 1; sparkhvd: cores / ranks)
    if args.code:
        env["PYTHONPATH"] = os.pathsep.join([os.path.abspath(args.code), *filter(None, [env.get("PYTHONPATH")])])
    with open(os.path.join(folder, "train.py"), "w") as f:
        f.write(SCRIPT)
    with open(os.path.join(folder, "drive.py"), "w") as f:
        f.write(DRIVER)
    hogs = []
    results = {s: [] for s in setups}
    try:
        for _ in range(args.hogs):
            hogs.append(subprocess.Popen([sys.executable, "-c", "while True: pass"], env=env))
        code = args.code or ROOT
        print(f"sparkhvd from {code}; {args.runs} runs of each of {len(setups)} setups; {args.hogs} CPU hogs on "
              f"{os.cpu_count()} cores; a run is a hang past {args.timeout:.0f} s", flush=True)
        for i in range(args.runs):
            for setup in setups:
                outcome, seconds, tail = one_run(setup, folder, env, args.timeout)
                results[setup].append((outcome, seconds))
                if outcome != "ok":
                    print(f"run {i + 1}, {setup}: {outcome} after {seconds:.1f} s", flush=True)
                    if args.verbose:
                        print(textwrap.indent(tail, "    "), flush=True)
            if (i + 1) % 10 == 0:
                print(f"... {i + 1} rounds: " + ", ".join(
                    f"{s} {sum(o == 'hang' for o, _ in results[s])} hangs" for s in setups), flush=True)
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
        left = kill_marked(mark)
        shutil.rmtree(folder, ignore_errors=True)
    _table(results)
    if left:
        print(f"killed {left} processes left at the end (warm zygotes included)")
    return 0


def _table(results: dict) -> None:
    print()
    print(f"| {'setup':38} | runs | hangs | errors | median s |")
    print(f"|{'-' * 40}|------|-------|--------|----------|")
    for setup, rows in results.items():
        hangs = sum(o == "hang" for o, _ in rows)
        errors = sum(o == "error" for o, _ in rows)
        ok = [s for o, s in rows if o == "ok"]
        median = f"{statistics.median(ok):.2f}" if ok else "-"
        print(f"| {LABELS[setup]:38} | {len(rows):4} | {hangs:5} | {errors:6} | {median:>8} |")


if __name__ == "__main__":
    sys.exit(main())
