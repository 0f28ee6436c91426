"""Faults to inject into a running cluster: kill a rank or an executor, drop a link, cut two hosts apart.

Each takes the ``Cluster`` and the hosts it acts on; each undo (``link_up``, ``heal``) is safe
to call when nothing was done.
"""

from __future__ import annotations

import os
import signal
import time

from sparkhvd.runner._warm.protocol import WORKER_MODULE

from ._cluster import Cluster
from ._netns import Host, TestbedError, sh


def rank_processes(cluster: Cluster) -> dict[int, tuple[Host, int]]:
    """The live rank processes on every host: ``{rank: (host, pid)}``, read from their command line
    (``python -m sparkhvd.runner._rank.worker rank=<r>``, forked from the warm zygote or not)."""
    found = {}
    for host in cluster.hosts:
        for pid, cmd in cluster.processes(host, WORKER_MODULE):
            rank = next((arg[5:] for arg in cmd.split() if arg.startswith("rank=")), "")
            if rank.isdigit():
                found[int(rank)] = (host, pid)
    return found


def wait_for_ranks(cluster: Cluster, np: int, timeout: float = 60) -> dict[int, tuple[Host, int]]:
    """Wait (bounded) until all ``np`` rank processes run; returns ``{rank: (host, pid)}``."""
    deadline = time.monotonic() + timeout
    while len(found := rank_processes(cluster)) < np:
        if time.monotonic() >= deadline:
            raise TestbedError(f"only ranks {sorted(found)} of {np} were running after {timeout:.0f} s")
        time.sleep(0.05)
    return found


def rank_pid(cluster: Cluster, rank: int, timeout: float = 60) -> tuple[Host, int]:
    """``(host, pid)`` of rank ``rank``'s process, waiting (bounded) for it to start."""
    deadline = time.monotonic() + timeout
    while (found := rank_processes(cluster).get(rank)) is None:
        if time.monotonic() >= deadline:
            raise TestbedError(f"rank {rank}'s process did not appear on any host within {timeout:.0f} s")
        time.sleep(0.05)
    return found


def kill_rank(cluster: Cluster, rank: int, sig: int = signal.SIGKILL) -> tuple[Host, int]:
    """Send ``sig`` to rank ``rank``'s process; returns where it ran."""
    host, pid = rank_pid(cluster, rank)
    os.kill(pid, sig)
    return host, pid


def kill_executor(cluster: Cluster, host: Host, sig: int = signal.SIGKILL) -> list[int]:
    """Send ``sig`` to the executor JVM(s) on ``host``; returns their pids."""
    pids = cluster.executor_pids(host)
    if not pids:
        raise TestbedError(f"no executor JVM runs on {host.hostname}")
    for pid in pids:
        os.kill(pid, sig)
    return pids


def link_down(host: Host) -> None:
    """Take ``host``'s link down on the bridge's side: it reaches nothing, nothing reaches it."""
    sh("ip", "link", "set", host.veth, "down")


def link_up(host: Host) -> None:
    sh("ip", "link", "set", host.veth, "up")


def partition(a: Host, b: Host) -> None:
    """Cut ``a`` and ``b`` off from each other only; both still reach the driver (198.18.0.1).

    A blackhole route on each side: packets on established connections vanish (TCP retries in
    silence), new connections fail at once with EINVAL, as a broken path between two racks does
    to a sender whose route was withdrawn.
    """
    a.run("ip", "route", "replace", "blackhole", f"{b.address}/32")
    b.run("ip", "route", "replace", "blackhole", f"{a.address}/32")


def heal(cluster: Cluster) -> None:
    """Undo every ``partition`` and ``link_down`` on the cluster."""
    for host in cluster.hosts:
        link_up(host)
        for other in cluster.hosts:
            if other is not host:
                host.run("ip", "route", "delete", "blackhole", f"{other.address}/32", check=False)
