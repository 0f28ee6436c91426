"""Measure how runs on the namespace cluster end under faults (not a test; run by hand, as root).

    .venv/bin/python tests/cluster/probe_faults.py [--faults rank,executor,link,partition]

Builds the 2-host cluster, and for each fault starts an np=4 allreduce loop, injects the
fault on host B once every rank is looping, and prints one row of:

    fault | seconds to the error | the error's first line | leftover processes | next run OK

The executors get HOROVOD_STALL_SHUTDOWN_TIME_SECONDS=120 (spark.executorEnv), so a partition
should end in the stall report's error within about 120 s. Spark's own timeouts are left at
their defaults unless --network-timeout is given.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/, for `cluster`

from cluster import _faults
from cluster._cluster import Cluster
from cluster._netns import TestbedError, unavailable_reason

NP = 4
FAULTS = {
    "rank": "SIGKILL of one rank process on host B, inside an allreduce loop",
    "executor": "kill -9 of host B's executor JVM",
    "link": "host B's link down (root side of its veth)",
    "partition": "hosts A and B cut off from each other only (blackhole routes); both reach the driver",
}


def inject(cluster: Cluster, fault: str) -> str:
    a, b = cluster.hosts[0], cluster.hosts[1]
    if fault == "rank":
        ranks = _faults.rank_processes(cluster)
        rank = max(r for r, (host, _) in ranks.items() if host is b)
        _faults.kill_rank(cluster, rank, signal.SIGKILL)
        return f"killed rank {rank} on {b.hostname}"
    if fault == "executor":
        return f"killed executor pid(s) {_faults.kill_executor(cluster, b)} on {b.hostname}"
    if fault == "link":
        _faults.link_down(b)
        return f"{b.veth} down"
    if fault == "partition":
        _faults.partition(a, b)
        return f"{a.hostname} <-/-> {b.hostname}"
    raise ValueError(fault)


def wait_executors(cluster: Cluster, timeout: float) -> float:
    """Wait (bounded) until the driver sees one executor per host again; returns the seconds waited."""
    started = time.monotonic()
    while len(cluster.driver.executors()) < len(cluster.hosts):
        if time.monotonic() - started > timeout:
            break
        time.sleep(0.5)
    return time.monotonic() - started


def probe(cluster: Cluster, fault: str, bound: float) -> dict:
    pending = cluster.driver.submit("allreduce_loop", NP)
    for r in range(NP):
        pending.wait_for_output(f"[{r}] rank {r} pid", timeout=120)
    _faults.wait_for_ranks(cluster, NP, timeout=30)
    time.sleep(1.0)  # let every rank get well into the loop (a fault before it tests start-up instead)
    note = inject(cluster, fault)
    injected = time.monotonic()
    row = {"fault": fault, "note": note}
    try:
        outcome = pending.result(bound)
        row["seconds"] = f"{time.monotonic() - injected:.1f}"
        row["headline"] = outcome.headline() if not outcome.ok else "(the run succeeded)"
    except TestbedError:
        row["seconds"] = f"> {bound:.0f} (no error)"
        row["headline"] = "(none within the bound)"
        outcome = None
    _faults.heal(cluster)
    if outcome is None:  # after healing the run may resume or fail; wait for it, bounded
        try:
            late = pending.result(300)
            row["headline"] += f"; after healing: {'succeeded' if late.ok else late.headline()[:120]}"
        except TestbedError:
            row["headline"] += "; still running 300 s after healing"
    left = cluster.wait_no_ranks(timeout=15)
    row["leftovers"] = ", ".join(f"{h}: ranks {p}" for h, p in left.items()) or "none"
    waited = wait_executors(cluster, timeout=180)
    nxt = cluster.driver.run("whoami", NP, timeout=240)
    row["next"] = (f"OK ({nxt.seconds:.1f} s" + (f", after {waited:.0f} s for executors" if waited > 1 else "") + ")"
                   if nxt.ok else f"FAILED: {nxt.headline()[:120]}")
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--faults", default=",".join(FAULTS), help=f"comma-separated, of: {', '.join(FAULTS)}")
    parser.add_argument("--bound", type=float, default=400, help="seconds to wait for the error (default 400)")
    parser.add_argument("--network-timeout", help="spark.network.timeout for the driver, e.g. 30s (default: Spark's)")
    args = parser.parse_args()
    reason = unavailable_reason()
    if reason:
        print(f"cannot probe: {reason}", file=sys.stderr)
        return 2
    conf = {"spark.network.timeout": args.network_timeout} if args.network_timeout else {}
    cluster = Cluster(2, python=sys.executable)
    rows = []
    try:
        cluster.start(conf=conf, executor_env={"HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "120"})
        print(f"cluster up in {cluster.start_seconds:.1f} s; logs in {cluster.base_dir}", flush=True)
        for fault in args.faults.split(","):
            print(f"-- {fault}: {FAULTS[fault]}", flush=True)
            row = probe(cluster, fault, args.bound)
            print(f"   {row}", flush=True)
            rows.append(row)
    finally:
        problems = cluster.close()
    print("\n| fault | seconds to the error | the error's first line | leftover processes | next run OK |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {FAULTS[r['fault']]} ({r['note']}) | {r['seconds']} | {r['headline'][:300]} | {r['leftovers']} "
              f"| {r['next']} |")
    print(f"\ncleanup: {'complete' if not problems else problems}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
