"""Benchmark (not a test): how long a restart from the last commit takes, and what a commit costs.

1. Recovery. A small torch training loop (``import torch``, ``hvd.init()``, an MLP with
   ``hvd.DistributedOptimizer``, ``hvd.elastic.TorchState``, a commit every 4 steps) runs under
   ``HorovodRunner(np, max_restarts=1)``; at step 9 rank 0 flushes its commit to the driver, writes
   ``time.time()`` to a file and kills itself with SIGKILL (once: a marker file remembers it). The
   first step that completes after the restart writes ``time.time()`` again (it resumed at step 8).
   Reported: that difference, measured on the ranks' clock, and ``RunResult.restarts[0].seconds``
   (the driver's clock: failure seen to rank 0 loading the commit). Peer, in the same run: a fresh
   ``HorovodRunner(np=2).run`` of the same function, from the call to its first completed step (what
   a user who restarts the job by hand waits, at least). At np=2 on a real ``local[2]`` SparkSession
   and at np=-2 (processes on the driver); restart and fresh runs alternate, one warm-up run of
   each first. A second table splits the restart into phases (ranks and driver share
   ``time.monotonic()``: one machine).
2. Commit cost of a ResNet-50-sized state: ResNet-50's 161 parameter shapes (25.6 M float32, as in
   ``bench/allreduce.py``; no BatchNorm buffers) and SGD with momentum (its buffers double the state
   to about 205 MB), at np=-1. Ours: the time ``state.commit()`` blocks the loop, the time until the
   commit has reached the driver (``commit()`` then ``_commits.flush()``), the bytes sent (the
   pickled snapshot), a small CPU step's time while the commit is sent in the background, and what
   the commit costs the loop in all (the time commit() blocks plus those steps' extra time). Peer,
   interleaved in the same rank: ``torch.save({"model": ..., "optimizer": ...})`` to a file in a
   temp folder and to an ``io.BytesIO``. Then the same with ``commit_dir=`` a local temp folder.

Everything it writes (the Spark session's and the JVM's temp files, run logs, commits, torch.save
files) goes under one temp folder, removed at the end. About three minutes on 2 CPUs. The machine's
other load shows: compare ours with the peer of the same table, measured alongside.

    python bench/recovery.py
    python bench/recovery.py --repeats 5
    python bench/recovery.py --quick      # one repeat of each, no warm-up restarts (about 80 s)
    python bench/recovery.py --no-spark   # recovery at np=-2 only, no SparkSession
    python bench/recovery.py --driver     # a driver SIGKILLed, a new driver resuming from storage, stage by stage
    python bench/recovery.py --cluster    # np=8 on a 4-host testbed, a killed rank and executor, stage by stage
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

STEPS, KILL_AT, COMMIT_EVERY = 12, 9, 4  # killed at step 9, resumes from the commit after step 8


# ---------------------------------------------------------------------------------------------
# 1. recovery: the training function the ranks run


def train(marks: str, kill: bool, kill_driver: int = 0):
    """A user's elastic loop; rank 0 records when it entered, imported torch, finished hvd.init() and its
    first step (``first-<pid>.json``), and, with ``kill``, when it killed itself (``killed.json``); with
    ``kill_driver`` (a pid), it SIGKILLs that driver process instead, once, at the same step."""
    import os
    import signal
    import time

    entered = time.monotonic()
    import torch

    imported = time.monotonic()
    import sparkhvd.collective.torch as hvd
    from sparkhvd._common import commits as _commits

    hvd.init()
    initialised = time.monotonic()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
                                   named_parameters=model.named_parameters())
    state = hvd.elastic.TorchState(model=model, optimizer=opt, step=0)
    built = time.monotonic()
    first = [True]

    def write(name, **values):
        with open(os.path.join(marks, name), "w") as f:
            json.dump(values, f)

    @hvd.elastic.run
    def loop(state):
        while state.step < STEPS:
            mark = os.path.join(marks, "killed")
            if (kill or kill_driver) and state.step == KILL_AT and hvd.rank() == 0 and not os.path.exists(mark):
                _commits.flush(60)  # the commit after step 8 is on the driver: the one resumed
                open(mark, "w").close()
                write("killed.json", wall=time.time(), mono=time.monotonic())
                os.kill(kill_driver or os.getpid(), signal.SIGKILL)
                if kill_driver:
                    time.sleep(120)  # the driver is gone: this rank leaves when it notices
            resumed_at = state.step
            g = torch.Generator().manual_seed(100 * state.step + hvd.rank())
            x = torch.randn(64, 32, generator=g)
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True).sin()).backward()
            opt.step()
            state.step += 1
            if first[0] and hvd.rank() == 0:
                first[0] = False
                write(f"first-{os.getpid()}.json", wall=time.time(), mono=time.monotonic(), entered=entered,
                      torch=imported, init=initialised, built=built, step=resumed_at)
            if state.step % COMMIT_EVERY == 0:
                state.commit()
        return state.step

    return loop(state)


def read(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


class SuperviseStamps:
    """Driver-side: when the run's policy decided an attempt failed (it calls ``_supervise.stop``) and when the
    attempt ended (the ranks aborted, the tasks stopped). Patched in for this benchmark only, as bench/launch.py
    does, and removed afterwards."""

    def __init__(self):
        from sparkhvd.runner._policy import policy as _run_policy
        from sparkhvd.runner._policy import supervise as _supervise

        policy = _run_policy.RunPolicy
        self._patched = [(policy, "_ended", policy._ended), (_supervise, "stop", _supervise.stop)]
        self.stopping: list[float] = []
        self.raised: list[float] = []
        ended, stop = policy._ended, _supervise.stop

        def stamped_ended(self_, outcome):
            if outcome.how == _supervise.FAILED:
                self.raised.append(time.monotonic())
            return ended(self_, outcome)

        def stamped_stop(*args, **kwargs):
            self.stopping.append(time.monotonic())
            return stop(*args, **kwargs)

        policy._ended, _supervise.stop = stamped_ended, stamped_stop

    def clear(self):
        self.stopping.clear()
        self.raised.clear()

    def close(self):
        for owner, name, original in self._patched:
            setattr(owner, name, original)


def quiet(fn):
    """Call ``fn()`` with our stdout/stderr kept aside (the driver's restart line, ranks' output); shown on failure."""
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            return fn()
    except BaseException:
        sys.stderr.write(out.getvalue())
        raise


def restart_once(np: int, scratch: str, stamps: SuperviseStamps) -> dict:
    """One run killed once at step 9 and restarted: its timings, seconds."""
    from sparkhvd import HorovodRunner

    marks = tempfile.mkdtemp(dir=scratch)
    runner = HorovodRunner(np, max_restarts=1, driver_log_verbosity="log_callback_only",
                           log_dir=os.path.join(marks, "logs"))
    stamps.clear()
    steps = quiet(lambda: runner.run(train, marks=marks, kill=True))
    event = runner.last_result.restarts[0]
    print(f"  {event.line(runner.last_result.run_id)}", file=sys.stderr, flush=True)
    killed = read(os.path.join(marks, "killed.json"))
    firsts = [read(os.path.join(marks, n)) for n in os.listdir(marks) if n.startswith("first-")]
    resumed = max(firsts, key=lambda d: d["wall"])
    assert steps == STEPS and resumed["step"] == KILL_AT - 1 and event.commit == {"step": KILL_AT - 1}, \
        (steps, resumed, event)
    restore = event.failed_at + event.seconds  # rank 0 asked for the commit (driver's clock)
    return {"outside": resumed["wall"] - killed["wall"], "driver": event.seconds,
            "phases": [event.failed_at - killed["mono"], stamps.stopping[0] - event.failed_at,
                       stamps.raised[0] - stamps.stopping[0], resumed["entered"] - stamps.raised[0],
                       resumed["torch"] - resumed["entered"], resumed["init"] - resumed["torch"],
                       resumed["built"] - resumed["init"], restore - resumed["built"], resumed["mono"] - restore,
                       resumed["mono"] - killed["mono"]]}


def fresh_once(np: int, scratch: str) -> float:
    """A fresh run of the same function: seconds from the call to its first completed step."""
    from sparkhvd import HorovodRunner

    marks = tempfile.mkdtemp(dir=scratch)
    runner = HorovodRunner(np, driver_log_verbosity="log_callback_only", log_dir=os.path.join(marks, "logs"))
    called = time.time()
    quiet(lambda: runner.run(train, marks=marks, kill=False))
    (first,) = [read(os.path.join(marks, n)) for n in os.listdir(marks) if n.startswith("first-")]
    return first["wall"] - called


PHASES = [
    "SIGKILL -> driver sees the failure",
    "-> failure decided (FAILURE_GRACE_S for the other ranks' errors, or until all exited)",
    "-> ranks aborted, tasks stopped (supervise raises)",
    "-> new rank 0 enters the function (slots, relaunch, process start, worker imports)",
    "-> import torch",
    "-> import sparkhvd.collective.torch, hvd.init()",
    "-> model, optimizer, TorchState (torch.optim imports torch._dynamo)",
    "-> rank 0 asks for the commit (RESTORE)",
    "-> first step done (load, sync, one step)",
    "total: SIGKILL -> first step done",
]


def recovery(repeats: int, warmup: bool, scratch: str, modes: list[int]) -> dict:
    stamps = SuperviseStamps()
    out = {}
    try:
        for np in modes:
            where = "local[2]" if np > 0 else "the driver"
            if warmup:
                took = time.perf_counter()
                restart_once(np, scratch, stamps)
                fresh_once(np, scratch)
                print(f"np={np}: warm-up restart and fresh run {time.perf_counter() - took:.1f} s", file=sys.stderr,
                      flush=True)
            runs, fresh = [], []
            for rep in range(repeats):
                for kind in (("restart", "fresh") if rep % 2 == 0 else ("fresh", "restart")):
                    if kind == "restart":
                        runs.append(restart_once(np, scratch, stamps))
                    else:
                        fresh.append(fresh_once(np, scratch))
                print(f"np={np} on {where}, rep {rep + 1}/{repeats}: "
                      f"SIGKILL -> first step {runs[-1]['outside']:.2f} s, restarts[0].seconds "
                      f"{runs[-1]['driver']:.2f} s, fresh run -> first step {fresh[-1]:.2f} s",
                      file=sys.stderr, flush=True)
            out[np] = {"runs": runs, "fresh": fresh}
    finally:
        stamps.close()
    return out


# ---------------------------------------------------------------------------------------------
# 1b. a driver killed, and a new driver that resumes the run from its storage

DRIVER = """
import json, os, sys, time
started = time.monotonic()
sys.path.insert(0, {bench!r})
from recovery import train
from sparkhvd import HorovodRunner
imported = time.monotonic()
marks, run_id, storage, kill = sys.argv[1], sys.argv[2], sys.argv[3] or None, sys.argv[4] == "kill"
runner = HorovodRunner(-2, run_id=run_id, storage=storage, driver_log_verbosity="log_callback_only",
                       log_dir=os.path.join(marks, "logs-" + str(os.getpid())))
with open(os.path.join(marks, "driver-" + str(os.getpid()) + ".json"), "w") as f:
    json.dump({{"started": started, "imported": imported, "called": time.monotonic()}}, f)
print("STEPS", runner.run(train, marks=marks, kill=False, kill_driver=os.getpid() if kill else 0), flush=True)
"""

DRIVER_PHASES = [
    "the driver script starts -> sparkhvd imported",
    "-> HorovodRunner(...).run called",
    "-> rank 0 enters the function (lease, manifest, launch, process start)",
    "-> import torch, hvd.init(), model, optimizer, TorchState",
    "-> first step done (the commit loaded: the resumed run; none: the fresh run)",
    "total: process start -> first step done",
]


def _driver(scratch: str, marks: str, run_id: str, storage: str, kill: bool) -> subprocess.CompletedProcess:
    script = os.path.join(scratch, "driver.py")
    if not os.path.exists(script):
        with open(script, "w") as f:
            f.write(DRIVER.format(bench=os.path.dirname(os.path.abspath(__file__))))
    return subprocess.run([sys.executable, script, marks, run_id, storage, "kill" if kill else ""],
                          capture_output=True, text=True, timeout=300)


def _first_step(marks: str, driver_pid: int) -> list:
    """The phases of one driver process's run (``DRIVER_PHASES``), from its stamps and rank 0's."""
    d = read(os.path.join(marks, f"driver-{driver_pid}.json"))
    firsts = [read(os.path.join(marks, n)) for n in os.listdir(marks) if n.startswith("first-")]
    r = max((f for f in firsts if f["entered"] >= d["called"]), key=lambda f: f["mono"])
    return [d["imported"] - d["started"], d["called"] - d["imported"], r["entered"] - d["called"],
            r["built"] - r["entered"], r["mono"] - r["built"], r["mono"] - d["started"]]


def _pid_of(marks: str, after: set) -> int:
    (name,) = [n for n in os.listdir(marks) if n.startswith("driver-") and n not in after]
    return int(name[len("driver-"):-len(".json")])


def driver_restart_once(scratch: str, n: int) -> dict:
    """A driver SIGKILLed at step 9 (its ranks flushed the commit after step 8 to its storage), then a new driver
    with the same run_id; and, as the peer, a fresh driver process of the same function without storage."""
    marks = tempfile.mkdtemp(dir=scratch)
    storage = os.path.join(scratch, "storage")
    run_id = f"bench-driver-{n}"
    first = _driver(scratch, marks, run_id, storage, kill=True)
    assert first.returncode == -9, (first.returncode, first.stderr[-2000:])
    seen = {x for x in os.listdir(marks) if x.startswith("driver-")}
    second = _driver(scratch, marks, run_id, storage, kill=False)
    assert second.returncode == 0 and f"STEPS {STEPS}" in second.stdout, second.stderr[-3000:]
    resumed = _first_step(marks, _pid_of(marks, seen))
    fresh_marks = tempfile.mkdtemp(dir=scratch)
    fresh = _driver(scratch, fresh_marks, f"bench-fresh-{n}", "", kill=False)
    assert fresh.returncode == 0, fresh.stderr[-3000:]
    return {"resumed": resumed, "fresh": _first_step(fresh_marks, _pid_of(fresh_marks, set())),
            "resumed_step": max((read(os.path.join(marks, x)) for x in os.listdir(marks) if x.startswith("first-")),
                                key=lambda f: f["mono"])["step"]}


def driver_restarts(repeats: int, scratch: str) -> list:
    driver_restart_once(scratch, 0)  # warm-up: the warm process, the page cache
    runs = []
    for rep in range(repeats):
        runs.append(driver_restart_once(scratch, rep + 1))
        print(f"driver restart, rep {rep + 1}/{repeats}: new driver -> first step {runs[-1]['resumed'][-1]:.2f} s "
              f"(resumed at step {runs[-1]['resumed_step']}), fresh driver -> first step {runs[-1]['fresh'][-1]:.2f} s",
              file=sys.stderr, flush=True)
    return runs


def print_driver_restarts(runs: list, repeats: int) -> None:
    print()
    print(f"## A driver SIGKILLed at step {KILL_AT}, then a new driver process with the same run_id and storage "
          f"(np=-2, a local storage folder): seconds, median (min-max) of {repeats}; peer: a fresh driver process "
          "of the same function")
    print()
    rows = [[label, spread([r["resumed"][i] for r in runs]), spread([r["fresh"][i] for r in runs]),
             ratio([r["resumed"][i] for r in runs], [r["fresh"][i] for r in runs]) if i == len(DRIVER_PHASES) - 1
             else "-"] for i, label in enumerate(DRIVER_PHASES)]
    print(table(["phase", "new driver, resumed", "fresh driver", "ours/peer"], rows))
    print(f"\nthe new driver resumed at step {sorted({r['resumed_step'] for r in runs})} (the commit after step "
          f"{KILL_AT - 1}); goal: total <= 2x the fresh driver's")


# ---------------------------------------------------------------------------------------------
# 2. commit cost: the rank body


def resnet50_shapes() -> list:
    """The parameter shapes of torchvision's ResNet-50 (161 tensors, 25,557,032 values), as in bench/allreduce.py."""
    shapes = [(64, 3, 7, 7), (64,), (64,)]
    inplanes = 64
    for planes, blocks in ((64, 3), (128, 4), (256, 6), (512, 3)):
        for b in range(blocks):
            shapes += [(planes, inplanes, 1, 1), (planes,), (planes,), (planes, planes, 3, 3), (planes,), (planes,),
                       (planes * 4, planes, 1, 1), (planes * 4,), (planes * 4,)]
            if b == 0:
                shapes += [(planes * 4, inplanes, 1, 1), (planes * 4,), (planes * 4,)]
            inplanes = planes * 4
    shapes += [(1000, 2048), (1000,)]
    return shapes


def commit_cost(repeats: int, warmup: bool, folder: str) -> dict:
    """At np=1: ours (commit, commit to driver, bytes, a step during the send) against torch.save, interleaved."""
    import pickle
    import time

    import torch

    import sparkhvd.collective.torch as hvd
    from sparkhvd._common import commits as _commits

    hvd.init()
    model = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(s) * 0.01) for s in resnet50_shapes()])
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    for p in model.parameters():
        p.grad = torch.full_like(p, 1e-3)
    opt.step()  # creates the momentum buffers: the optimizer's state is now as large as the model
    state = hvd.elastic.TorchState(model=model, optimizer=opt, epoch=0, batch=0)
    path = os.path.join(folder, "checkpoint.pt")
    w, x = torch.randn(512, 512), torch.randn(256, 512)

    def step() -> float:  # a small CPU "training step": a few matmuls
        start = time.perf_counter()
        for _ in range(4):
            (x @ w).relu_().sum()
        return time.perf_counter() - start

    def save_peer(target):
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, target)

    out = {k: [] for k in ("commit", "to_driver", "save", "pickle", "bytes", "file", "file_bytes", "bytesio",
                           "bytesio_bytes", "step_idle", "step_busy", "send_s", "busy_steps", "lost", "loop_cost")}
    for rep in range(repeats + (1 if warmup else 0)):
        sample = {}
        # ours: how long commit() blocks, then until the driver has it
        start = time.perf_counter()
        state.commit()
        blocked = time.perf_counter() - start
        assert _commits.flush(300), "the commit did not reach the driver within 300 s"
        sample["commit"], sample["to_driver"] = blocked, time.perf_counter() - start
        # what commit() is made of: save() (the deepcopy of the state_dicts) and, off the loop, pickle.dumps
        start = time.perf_counter()
        state.save()
        sample["save"] = time.perf_counter() - start
        start = time.perf_counter()
        blob = pickle.dumps(state._snapshot(), protocol=pickle.HIGHEST_PROTOCOL)
        sample["pickle"], sample["bytes"] = time.perf_counter() - start, len(blob)
        del blob
        # peer: torch.save to a file, then to memory
        start = time.perf_counter()
        save_peer(path)
        sample["file"], sample["file_bytes"] = time.perf_counter() - start, os.path.getsize(path)
        os.remove(path)
        buf = io.BytesIO()
        start = time.perf_counter()
        save_peer(buf)
        sample["bytesio"], sample["bytesio_bytes"] = time.perf_counter() - start, buf.getbuffer().nbytes
        del buf
        # a step while nothing is sent, then steps while a commit is sent in the background: what the
        # commit costs the loop is the time commit() blocks plus how much longer those steps took
        idle = [step() for _ in range(10)]
        start = time.perf_counter()
        state.commit()
        blocked = time.perf_counter() - start
        busy = []
        while not _commits.flush(0):
            busy.append(step())
        sample["send_s"] = time.perf_counter() - start
        idle = statistics.median(idle + [step() for _ in range(10)])  # 10 steps before the commit, 10 after
        sample["step_idle"], sample["busy_steps"] = idle, len(busy)
        sample["step_busy"] = statistics.median(busy) if busy else float("nan")
        sample["lost"] = sum(busy) - len(busy) * idle
        sample["loop_cost"] = blocked + sample["lost"]
        if warmup and rep == 0:
            continue  # the first round warms up (the connection to the driver, the allocator)
        for k, v in sample.items():
            out[k].append(v)
    out["params"] = sum(p.numel() for p in model.parameters())
    out["tensors"] = len(list(model.parameters()))
    return out


def commit_runs(repeats: int, warmup: bool, scratch: str) -> dict:
    from sparkhvd import HorovodRunner

    results = {}
    for name in ("driver", "commit_dir"):
        folder = tempfile.mkdtemp(dir=scratch)
        commit_dir = os.path.join(folder, "commits") if name == "commit_dir" else None
        runner = HorovodRunner(-1, driver_log_verbosity="log_callback_only", commit_dir=commit_dir,
                               log_dir=os.path.join(folder, "logs"))
        took = time.perf_counter()
        results[name] = quiet(lambda: runner.run(commit_cost, repeats=repeats, warmup=warmup, folder=folder))
        if commit_dir is not None:
            left = os.listdir(commit_dir) if os.path.isdir(commit_dir) else []
            results[name]["left_in_commit_dir"] = left  # the run removes its folder at the end
        print(f"commit cost, {name}: {time.perf_counter() - took:.1f} s", file=sys.stderr, flush=True)
    return results


# ---------------------------------------------------------------------------------------------
# printing


def fmt_row(cells, widths):
    return "| " + " | ".join(str(c).ljust(w) for c, w in zip(cells, widths)) + " |"


def table(header, rows) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = [fmt_row(header, widths), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    lines += [fmt_row(r, widths) for r in rows]
    return "\n".join(lines)


def spread(values: list[float], scale: float = 1.0, digits: int = 2) -> str:
    """``median (min-max)``, or the one value."""
    values = [v * scale for v in values]
    med = f"{statistics.median(values):.{digits}f}"
    return med if len(values) == 1 else f"{med} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def ratio(ours: list[float], peer: list[float]) -> str:
    return f"{statistics.median(ours) / statistics.median(peer):.2f}"


def print_recovery(rec: dict, repeats: int) -> None:
    print()
    print(f"## Recovery from a SIGKILL of rank 0 (small MLP, commit every {COMMIT_EVERY} steps, killed at step "
          f"{KILL_AT}): seconds, median (min-max) of {repeats}")
    print()
    rows = []
    for np, r in rec.items():
        where = "np=2 on local[2]" if np > 0 else "np=-2 on the driver"
        outside = [x["outside"] for x in r["runs"]]
        rows.append([f"{where}: SIGKILL -> first step done after the restart (ranks' time.time()); "
                     "peer: a fresh HorovodRunner(np).run, call -> first step done",
                     "s", spread(outside), spread(r["fresh"]), ratio(outside, r["fresh"])])
        driver = [x["driver"] for x in r["runs"]]
        rows.append([f"{where}: RunResult.restarts[0].seconds (driver: failure seen -> rank 0 asks for the commit)",
                     "s", spread(driver), "-", "-"])
    print(table(["measure", "unit", "ours", "peer", "ours/peer"], rows))
    print()
    print("## Where a restart's time goes (ranks and driver on one machine share time.monotonic()): seconds, median")
    print()
    header = ["phase"] + [("np=2 on local[2]" if np > 0 else "np=-2 on the driver") for np in rec]
    rows = [[label] + [f"{statistics.median(x['phases'][i] for x in r['runs']):.3f}" for r in rec.values()]
            for i, label in enumerate(PHASES)]
    print(table(header, rows))


def print_commits(res: dict, repeats: int) -> None:
    first = res["driver"]
    mb = first["bytes"][0] / 1e6
    print()
    print(f"## Commit of a ResNet-50-sized state ({first['params'] / 1e6:.1f} M float32 parameters in "
          f"{first['tensors']} tensors + SGD momentum, {mb:.0f} MB), np=-1: median (min-max) of {repeats}")
    for name, r in res.items():
        where = ("to the driver (in its memory: under SPARKHVD_COMMIT_MEMORY_BYTES, 256 MiB)" if name == "driver"
                 else "with commit_dir= a local temp folder (the driver gets its path)")
        print()
        print(f"### {where}")
        print()
        ms = 1e3
        rows = [
            ["state.commit() blocks the loop; peer: torch.save to a file", "ms", spread(r["commit"], ms, 0),
             spread(r["file"], ms, 0), ratio(r["commit"], r["file"])],
            ["state.commit() blocks the loop; peer: torch.save to io.BytesIO", "ms", spread(r["commit"], ms, 0),
             spread(r["bytesio"], ms, 0), ratio(r["commit"], r["bytesio"])],
            ["  state.save() alone (the deepcopy of the state_dicts that commit() makes)", "ms",
             spread(r["save"], ms, 0), "-", "-"],
            ["commit() -> on the driver (commit, then _commits.flush()); peer: torch.save to a file", "ms",
             spread(r["to_driver"], ms, 0), spread(r["file"], ms, 0), ratio(r["to_driver"], r["file"])],
            ["  of which pickle.dumps(state._snapshot()) (off the loop); peer: torch.save to io.BytesIO", "ms",
             spread(r["pickle"], ms, 0), spread(r["bytesio"], ms, 0), ratio(r["pickle"], r["bytesio"])],
            ["bytes sent (pickled snapshot); peer: torch.save file size", "MB", f"{r['bytes'][0] / 1e6:.1f}",
             f"{r['file_bytes'][0] / 1e6:.1f}", f"{r['bytes'][0] / r['file_bytes'][0]:.3f}"],
            ["a CPU step (4 matmuls 256x512x512) while a commit is sent; peer: the same step, nothing sent", "ms",
             spread(r["step_busy"], ms, 1), spread(r["step_idle"], ms, 1), ratio(r["step_busy"], r["step_idle"])],
            [f"  steps run during the send (commit() -> on the driver: {spread(r['send_s'], ms, 0)} ms)", "steps",
             spread(r["busy_steps"], 1, 0), "-", "-"],
            ["what a commit costs the loop: commit() blocked + those steps' extra time; peer: torch.save to a file",
             "ms", spread(r["loop_cost"], ms, 0), spread(r["file"], ms, 0), ratio(r["loop_cost"], r["file"])],
        ]
        print(table(["measure", "unit", "ours", "peer", "ours/peer"], rows))
        if r.get("left_in_commit_dir"):
            print(f"\nleft in commit_dir after the run (should be nothing): {r['left_in_commit_dir']}")


# ---------------------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of each (default 3)")
    parser.add_argument("--quick", action="store_true", help="one repeat of each, no warm-up restarts")
    parser.add_argument("--no-spark", action="store_true", help="recovery at np=-2 only (no SparkSession)")
    parser.add_argument("--driver", action="store_true",
                        help="only a driver SIGKILLed and a new driver resuming from its storage (np=-2)")
    parser.add_argument("--cluster", action="store_true",
                        help="recovery at np=8 on a 4-host namespace testbed, stage by stage (bench/recovery_cluster.py)")
    parser.add_argument("--hosts", type=int, default=4,
                        help="--cluster's hosts, 2 task slots each (default 4; 5 leaves 2 slots free for a relaunch)")
    parser.add_argument("--faults", default="",
                        help="--cluster's faults, comma-separated (default: every one the --hosts allow): "
                             "rank, executor, own_cores, node, preempted, min_np")
    args = parser.parse_args()
    if args.hosts < 4:
        parser.error(f"--hosts {args.hosts} has {args.hosts * 2} task slots, fewer than np=8 needs; use --hosts 4 or more")
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    if args.cluster:
        import recovery_cluster

        only = [f for f in args.faults.split(",") if f]
        allowed = recovery_cluster.kinds_for(args.hosts)
        if any(f not in allowed for f in only):
            parser.error(f"--faults {args.faults}: --hosts {args.hosts} allows {', '.join(allowed)} (a lost node and "
                         "own_cores need --hosts 5, min_np --hosts 4)")
        recovery_cluster.main(1 if args.quick else args.repeats, table, args.hosts, only)
        return 0
    repeats, warmup = (1, False) if args.quick else (args.repeats, True)
    wall = time.perf_counter()

    # Everything goes under one folder, removed at the end: as tests/conftest.py does, TMPDIR for this
    # process and the ranks, and java.io.tmpdir for the JVM.
    scratch = tempfile.mkdtemp(prefix="sparkhvd-bench-recovery-")
    os.environ["TMPDIR"] = tempfile.tempdir = scratch
    os.environ["PYSPARK_PYTHON"] = sys.executable
    jvm_tmp = f"-Djava.io.tmpdir={scratch}"
    os.environ["PYSPARK_SUBMIT_ARGS"] = (f"--driver-java-options {jvm_tmp} --conf "
                                         f"spark.executor.extraJavaOptions={jvm_tmp} pyspark-shell")
    spark = None
    if args.driver:
        try:
            runs = driver_restarts(repeats, scratch)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        print_driver_restarts(runs, repeats)
        return 0
    try:
        modes = [-2]
        if not args.no_spark:
            from pyspark.sql import SparkSession

            spark = (SparkSession.builder.master("local[2]").appName("sparkhvd-bench-recovery")
                     .config("spark.ui.enabled", "false")
                     .config("spark.ui.showConsoleProgress", "false")
                     .getOrCreate())
            spark.sparkContext.setLogLevel("ERROR")
            modes = [2, -2]
        rec = recovery(repeats, warmup, scratch, modes)
        # always one warm-up round here: it is short, and without it the first touch of fresh memory dominates
        commits = commit_runs(repeats, True, scratch)
    finally:
        if spark is not None:
            spark.stop()
        shutil.rmtree(scratch, ignore_errors=True)

    import pyspark
    import torch

    print_recovery(rec, repeats)
    print_commits(commits, repeats)
    print()
    print("Notes:")
    print("- ours' restart: the driver sees rank 0's exit, waits runner/_policy/supervise.py's FAILURE_GRACE_S (1 s) for the other "
          "ranks' errors unless every rank has exited, aborts and stops the tasks, relaunches every rank; rank 0 "
          "loads the commit, state.sync() gives it to rank 1. The fresh run's ranks pay the same start-up.")
    print("- commit(): TorchState.save() deepcopies the model's and optimizer's state_dicts in the loop; rank 0's "
          "background thread pickles that copy and sends it (one frame over loopback TCP here; with commit_dir, "
          "a file write and its path). torch.save to a file is not fsynced.")
    print()
    print(f"machine: {os.cpu_count()} CPUs ({platform.machine()}, Linux {platform.release()}), no GPU used; "
          f"python {platform.python_version()}, torch {torch.__version__}, pyspark {pyspark.__version__}; "
          f"whole benchmark {time.perf_counter() - wall:.0f} s")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception:  # noqa: BLE001 - show it, exit non-zero
        traceback.print_exc()
        sys.exit(1)
