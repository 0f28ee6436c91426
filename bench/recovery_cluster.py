"""Benchmark (not a test): recovery at np=8 over 4 hosts, stage by stage (``python bench/recovery.py --cluster``).

A Spark standalone cluster of 4 namespace hosts (tests/cluster's testbed: root, iproute2 and Java), 2 task
slots each (``--hosts 5``: a fifth host, whose 2 slots are free when a fault comes), runs tests/cluster/_jobs.py's ``recovery_train`` (``import torch``, ``hvd.init()``, an MLP with
``hvd.DistributedOptimizer`` under ``hvd.elastic.run``, a commit every 5 steps) with ``max_restarts=1``. Once
rank 0's commit of step 10 is on the driver, a fault hits the host of the last rank:

  rank       SIGKILL of that rank's process
  executor   kill -9 of that host's executor JVM (Spark replaces it)
  node       the node is lost: that host's Worker is stopped (SIGSTOP), then its executor JVM killed, so that no
             replacement starts (every host shares this machine's 2 cores: a replacement JVM starting there slows
             the relaunch on the other hosts, which on a real cluster have cores of their own); the Worker goes on
             once the run ends
  preempted  SIGPWR to that host's executor JVM: Spark decommissions it (spark.decommission.enabled); every rank
             leaves at a commit and the run goes on from it (stage 1 is then the notice seen, stage 2 every rank
             left at the commit after it, and the total runs from the notice)
  own_cores  (with free slots only) ``executor``, where that host's Worker and every process it starts run at nice 19:
             the replacement JVM it starts then barely takes the cores the relaunch on the other hosts needs, as on
             a real cluster, where each host has cores of its own; nice 0 again once Spark has the executor back
  min_np     (without free slots only) ``executor`` under ``min_np=6``: the run goes on at once with the 6
             survivors, and grows back to np=8 at a commit once Spark has replaced the executor (the growth's own
             time is reported under the table)

Each stage of the restart, from one clock (every host is this machine): the driver's
``RunResult.restarts[0].stamps`` and rank 0's own marks (``entered``, ``init``, ``step``). The total is what
the driver's restart line says ("training resumed X s after the failure": failure seen -> rank 0 asks for
the commit). Peer, in the same run: a fresh ``HorovodRunner(np=8).run`` of the same function, from the call
to rank 0's first completed step, against the restart's failure seen -> first completed step. Fault runs and
fresh runs alternate, after one fresh warm-up run (the warm processes start on every host).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NP, HOSTS = 8, 4  # HOSTS: the default of --hosts
KINDS = ("rank", "executor", "own_cores", "node", "preempted", "min_np")
LABELS = {"rank": "rank killed", "executor": "executor killed", "own_cores": "executor killed, own cores",
          "node": "node lost", "preempted": "preempted", "min_np": "executor killed, min_np=6"}
MIN_NP = NP - 2

#: (label, from stamp, to stamp): driver stamps, the fault's time ("fault") and rank 0's marks ("r0.*")
STAGES = [
    ("1. the failure is seen", "fault", "failed"),
    ("2. the survivors are stopped (their processes exited)", "failed", "exited"),
    ("3. the stage is cancelled (its tasks ended)", "exited", "cancelled"),
    ("4a. Spark has the task slots again", "cancelled", "slots"),
    ("4b. the new stage is submitted", "slots", "launched"),
    ("5. the tasks start (first registered)", "launched", "registered"),
    ("5b. every task registered (ranks placed)", "registered", "placed"),
    ("6. the rank processes are up (every one asked for the function)", "placed", "fetched"),
    ("6b. rank 0 enters the function", "fetched", "r0.entered"),
    ("7. rendezvous (rank 0's hvd.init() returns)", "r0.entered", "r0.init"),
    ("8. the commit is loaded (rank 0 asks for it)", "r0.init", "resumed"),
    ("8b. the first step after it is done", "resumed", "r0.step"),
]


def _marks(folder: str, after: float = float("-inf")) -> dict:
    """Rank 0's marks of its first process that entered the function after ``after`` (the failure: the restarted
    process, not the one of a later growth back to np=8)."""
    found = []
    for name in os.listdir(folder):
        if name.startswith("rank0-"):
            with open(os.path.join(folder, name)) as f:
                found.append(json.load(f))
    first = min((m for m in found if m["entered"] > after), key=lambda m: m["entered"])
    return {f"r0.{k}": v for k, v in first.items()}


def _wait_executors(cluster, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while len(cluster.driver.executors()) < len(cluster.hosts) and time.monotonic() < deadline:
        time.sleep(0.5)


def _renice(cluster, host, contains: str, value: int) -> None:
    """Every thread of ``host``'s processes whose command line has ``contains`` at nice ``value`` (Linux keeps a
    nice per thread, and a process started by a thread takes that thread's)."""
    for pid, _ in cluster.processes(host, contains):
        try:
            for tid in os.listdir(f"/proc/{pid}/task"):
                os.setpriority(os.PRIO_PROCESS, int(tid), value)
        except OSError:  # the process or a thread of it ended meanwhile
            continue


def fault_once(cluster, faults, kind: str, scratch: str) -> dict:
    marks = tempfile.mkdtemp(dir=scratch)
    runner = {"max_restarts": 1, **({"min_np": MIN_NP} if kind == "min_np" else {})}
    pending = cluster.driver.submit("recovery_train", NP, runner=runner, marks=marks)
    pending.wait_for_output("[0] commit of step 10 is on the driver", timeout=240)
    ranks = faults.wait_for_ranks(cluster, NP, timeout=30)
    host, pid = ranks[NP - 1]
    if kind == "own_cores":
        _renice(cluster, host, "org.apache.spark.deploy.worker.Worker", 19)
    fault = time.monotonic()
    stopped = []
    if kind == "rank":
        os.kill(pid, signal.SIGKILL)
    else:
        if kind == "node":
            stopped = [p for p, _ in cluster.processes(host, "org.apache.spark.deploy.worker.Worker")]
            for worker in stopped:
                os.kill(worker, signal.SIGSTOP)
        faults.kill_executor(cluster, host, signal.SIGPWR if kind == "preempted" else signal.SIGKILL)
    try:
        outcome = pending.result(300)
    finally:
        for worker in stopped:
            os.kill(worker, signal.SIGCONT)
    failures = [e for e in outcome.restarts or [] if e["lost"] is not None]
    if not outcome.ok or len(failures) != 1:
        raise RuntimeError(f"the {kind} fault's run did not end in one restart: {outcome.error or outcome.restarts}")
    event = failures[0]
    if kind == "min_np" and event["np_after"] != MIN_NP:
        raise RuntimeError(f"the min_np fault's run went on with np={event['np_after']}, not the {MIN_NP} survivors")
    stamps = {"fault": fault, **event["stamps"]}
    stamps.update(_marks(marks, after=stamps["failed"]))
    line = next(line for line in outcome.output.splitlines()
                if "restart 1 of 1 after" in line or "preempted: relaunch 1" in line)
    grown = [e for e in outcome.restarts if e["lost"] is None]
    if kind != "rank":
        _wait_executors(cluster)
    if kind == "own_cores":
        _renice(cluster, host, "", 0)
    return {"stamps": stamps, "seconds": event["seconds"], "to_step": stamps["r0.step"] - stamps["failed"],
            "line": line, "grown": grown[0]["seconds"] if grown else None}


def fresh_once(cluster, scratch: str) -> float:
    marks = tempfile.mkdtemp(dir=scratch)
    called = time.monotonic()
    outcome = cluster.driver.run("recovery_train", NP, timeout=300, marks=marks, steps=12)
    if not outcome.ok:
        raise RuntimeError(f"the fresh run failed: {outcome.error}")
    return _marks(marks)["r0.step"] - called


def kinds_for(hosts: int) -> list:
    """The faults a testbed of ``hosts`` can show: a lost node and own cores need free slots (the relaunch goes
    there), min_np needs none (with free slots the relaunch takes all 8)."""
    spare = hosts * 2 - NP >= 2
    return [k for k in KINDS if (k not in ("node", "own_cores") or spare) and (k != "min_np" or not spare)]


def run(repeats: int, hosts: int = HOSTS, only: list | None = None) -> dict:
    sys.path.insert(0, ROOT)
    from tests.cluster import _faults
    from tests.cluster._cluster import Cluster
    from tests.cluster._netns import unavailable_reason

    reason = unavailable_reason()
    if reason:
        raise SystemExit(f"bench/recovery.py --cluster needs the namespace testbed: {reason}")
    scratch = tempfile.mkdtemp(prefix="sparkhvd-bench-recovery-")
    # The driver's temp dir, and the JVMs' java.io.tmpdir (its executors take the driver's, tests/cluster/_driver.py):
    # Spark extracts liblz4-java there, which would otherwise be left in /tmp.
    os.environ["TMPDIR"] = tempfile.tempdir = scratch
    os.environ["PYSPARK_SUBMIT_ARGS"] = f"--driver-java-options -Djava.io.tmpdir={scratch} pyspark-shell"
    cluster = Cluster(hosts, python=sys.executable)
    kinds = [k for k in kinds_for(hosts) if not only or k in only]
    out = {kind: [] for kind in kinds}
    out["fresh"] = []
    try:
        cluster.start(timeout=300)
        print(f"{hosts} hosts up in {cluster.start_seconds:.0f} s; warm-up run", file=sys.stderr, flush=True)
        fresh_once(cluster, scratch)
        for rep in range(repeats):
            for kind in kinds:
                sample = fault_once(cluster, _faults, kind, scratch)
                out[kind].append(sample)
                out["fresh"].append(fresh_once(cluster, scratch))
                print(f"rep {rep + 1}/{repeats} {kind}: restart line {sample['seconds']:.2f} s, failure -> first "
                      f"step {sample['to_step']:.2f} s; fresh run -> first step {out['fresh'][-1]:.2f} s\n  "
                      f"{sample['line']}", file=sys.stderr, flush=True)
    finally:
        problems = cluster.close()
        shutil.rmtree(scratch, ignore_errors=True)
        if problems:
            print(f"cluster cleanup problems: {problems}", file=sys.stderr)
    return out


def report(out: dict, repeats: int, table, hosts: int = HOSTS) -> None:
    spare = hosts * 2 - NP
    print()
    print(f"## Recovery at np={NP} over {hosts} hosts (2 slots each, {spare} free): seconds, median of {repeats}")
    print()
    kinds = [k for k in KINDS if k in out]
    rows = []
    for label, start, end in STAGES:
        rows.append([label] + [_median_stage(out[k], start, end) for k in kinds])
    rows.append(["total: the restart line (failure seen -> rank 0 asks for the commit)"]
                + [f"{statistics.median(s['seconds'] for s in out[k]):.2f}" for k in kinds])
    fresh = statistics.median(out["fresh"])
    rows.append(["failure seen -> first step done; peer: a fresh run, call -> first step done"]
                + [f"{statistics.median(s['to_step'] for s in out[k]):.2f} / {fresh:.2f} = "
                   f"{statistics.median(s['to_step'] for s in out[k]) / fresh:.2f}" for k in kinds])
    print(table(["stage", *(LABELS[k] for k in kinds)], rows))
    for k in kinds:
        grown = [s["grown"] for s in out[k] if s.get("grown") is not None]
        if grown:
            print(f"\n{LABELS[k]}: grew back to np={NP} at a commit once Spark had the slots again, "
                  f"{statistics.median(grown):.2f} s from every rank leaving to rank 0 asking for the commit (median of "
                  f"{len(grown)}).")


def _median_stage(samples: list, start: str, end: str) -> str:
    """The stage's median seconds, or "-" where the relaunch had no such step (a preemption stops no stage)."""
    spans = [s["stamps"][end] - s["stamps"][start] for s in samples if start in s["stamps"] and end in s["stamps"]]
    return f"{statistics.median(spans):.2f}" if spans else "-"


def main(repeats: int, table, hosts: int = HOSTS, only: list | None = None) -> None:
    out = run(repeats, hosts, only)
    report(out, repeats, table, hosts)
