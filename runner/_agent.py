"""The task agent: what runs in each Spark barrier task (or launcher thread) for one rank.

It registers with the driver, receives its rank, starts the rank's own Python process with
the GPU pinning in its environment (a fresh process, so the pinning holds before any CUDA
work even when Spark reuses its Python workers), forwards that process's stdout and stderr
to the driver line by line, and reports its exit code. The secret reaches the rank process on
its stdin, never on a command line or in the environment.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from typing import Callable

from ._client import RunAborted, ServiceClient, ServiceError
from ._commits import ENV_COMMIT_DIR
from ._host import host_id
from ._protocol import Kind

#: Environment of the rank process; read by ``_worker`` only.
ENV_DRIVER = "SPARKHVD_DRIVER"
ENV_RUN_ID = "SPARKHVD_RUN_ID"
ENV_PLACEMENT = "SPARKHVD_PLACEMENT"
ENV_PARENT = "SPARKHVD_PARENT_PID"
ENV_NETWORK_INTERFACE = "SPARKHVD_NETWORK_INTERFACE"
ENV_RETURN = "SPARKHVD_RETURN"  # "all": every rank ships its value; "0": only rank 0 does
MAX_LINE_BYTES = 64 * 1024  # longer lines reach the driver in pieces of this size
PUMP_DRAIN_S = 5.0  # after the rank's process group is gone, its pipes close at once


@dataclass(frozen=True)
class TaskSpec:
    """Everything a task needs to join a run; travels inside the Spark closure."""

    address: tuple[str, int]
    secret: bytes = field(repr=False)
    run_id: str
    python: str | None = None  # the rank process's interpreter; default: this one
    stall_tasks: frozenset = frozenset()  # fault tests: these task indices never register
    network_interface: str | None = None  # the interface ranks talk on; default: the one toward the driver
    every_value: bool = True  # False: only rank 0 ships its return value (HorovodRunner.run)
    attempt: int = 0  # 0, then 1, 2, ... for each restart (HorovodRunner(max_restarts=))
    commit_dir: str | None = None  # where rank 0 writes elastic commits (runner/_commits.py); default: the driver


def run_task(spec: TaskSpec, task: int, *, host: str | None = None, gpus: list[str] | None = None,
             on_spawn: Callable[[subprocess.Popen], None] | None = None) -> dict:
    """Run rank ``task``'s process to the end; returns a small status row.

    Never raises for the user's failure: that reaches the driver through the service, so a
    Spark barrier stage never retries a training run on its own.
    """
    client = ServiceClient(spec.address, spec.secret)
    if task in spec.stall_tasks:  # fault tests: never register; leave when the run is aborted
        try:
            client.request(Kind.WATCH, {"rank": -1})
        except (RunAborted, ServiceError, OSError, ConnectionError):
            pass
        client.close()
        return {"task": task, "rank": None, "exit": None, "note": "stalled on purpose"}
    try:
        placement = client.request(Kind.REGISTER, {
            "task": task, "host": host or socket.gethostname(), "host_id": host_id(), "pid": os.getpid(),
            "gpus": list(gpus or [])}).meta
    except (RunAborted, ServiceError) as exc:
        client.close()
        return {"task": task, "rank": None, "exit": None, "note": str(exc)}
    rank = placement["rank"]
    try:
        env = _rank_env(spec, placement, gpus)
    except ValueError as exc:  # the executor's GPU settings: the rank's error, not a Spark task failure
        _report(client, Kind.ERROR, {"rank": rank, "type": "ValueError", "message": str(exc), "traceback": ""})
        _report(client, Kind.EXIT, {"rank": rank, "code": 1})
        client.close()
        return {"task": task, "rank": rank, "exit": 1, "note": str(exc)}
    proc = subprocess.Popen([spec.python or sys.executable, "-m", "sparkhvd.runner._worker"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=env, start_new_session=True)
    if on_spawn is not None:
        on_spawn(proc)
    proc.stdin.write(spec.secret)
    proc.stdin.close()
    pumps = [threading.Thread(target=_pump, args=(client, rank, name, pipe), daemon=True)
             for name, pipe in (("stdout", proc.stdout), ("stderr", proc.stderr))]
    for pump in pumps:
        pump.start()
    try:
        code = proc.wait()
    except BaseException:  # the Spark task was killed: take the rank process with us
        _kill_group(proc)
        raise
    _kill_group(proc)  # whatever the rank started and left running goes with it
    for pump in pumps:
        pump.join(PUMP_DRAIN_S)
    _report(client, Kind.EXIT, {"rank": rank, "code": code})
    client.close()
    return {"task": task, "rank": rank, "exit": code, "note": ""}


def _report(client: ServiceClient, kind: Kind, meta: dict) -> None:
    try:
        client.request(kind, meta)
    except (OSError, ConnectionError, RunAborted, ServiceError):
        pass  # the driver has gone or has finished; nothing left to tell it


def _rank_env(spec: TaskSpec, placement: dict, gpus: list[str] | None) -> dict:
    import json

    env = dict(os.environ)
    env.update({
        ENV_DRIVER: f"{spec.address[0]}:{spec.address[1]}",
        ENV_RUN_ID: spec.run_id,
        ENV_PLACEMENT: json.dumps(placement),
        ENV_PARENT: str(os.getpid()),
        ENV_RETURN: "all" if spec.every_value else "0",
        "PYTHONUNBUFFERED": "1",
    })
    if spec.commit_dir:
        env[ENV_COMMIT_DIR] = spec.commit_dir
    if spec.network_interface:
        env[ENV_NETWORK_INTERFACE] = spec.network_interface
        env["GLOO_SOCKET_IFNAME"] = env["NCCL_SOCKET_IFNAME"] = spec.network_interface
    if "OMP_NUM_THREADS" not in env:
        # As torchrun does: ranks sharing a host split its cores, instead of each starting one OpenMP
        # thread per core, whose spinning then starves the other ranks (measured: a Keras step at np=2
        # on 2 cores went from 20 ms to 7 ms).
        env["OMP_NUM_THREADS"] = str(omp_threads(placement["local_size"]))
    if gpus:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(visible_gpus(gpus, os.environ.get("CUDA_VISIBLE_DEVICES")))
        env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    # Horovod and torchrun variables that would make hvd.init() join a different job.
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    return env


def visible_gpus(addresses: list, visible: str | None) -> list:
    """The devices a rank sees: Spark's GPU addresses, mapped through an executor's own
    ``CUDA_VISIBLE_DEVICES`` when it has one (Spark's addresses then index that list), as
    pyspark's TorchDistributor does."""
    addresses = [str(a) for a in addresses]
    if not visible:
        return addresses
    if any(not a.isdigit() for a in addresses):
        raise ValueError(f"Spark gave this task the GPU addresses {addresses}, which cannot index the executor's "
                         f"CUDA_VISIBLE_DEVICES={visible!r}; make the discovery script print indices 0..n-1 into "
                         "that list, or unset CUDA_VISIBLE_DEVICES in the executors' environment.")
    devices = [d.strip() for d in visible.split(",") if d.strip()]
    beyond = [a for a in addresses if int(a) >= len(devices)]
    if beyond:
        raise ValueError(f"Spark gave this task GPU address{'es' if len(beyond) > 1 else ''} {', '.join(beyond)}, "
                         f"but the executor's CUDA_VISIBLE_DEVICES={visible!r} lists only {len(devices)} device"
                         f"{'s' if len(devices) != 1 else ''}; make the discovery script print indices into that list "
                         "(0.." f"{len(devices) - 1}), or unset CUDA_VISIBLE_DEVICES in the executors' environment.")
    return [devices[int(a)] for a in addresses]


def omp_threads(local_size: int) -> int:
    """The CPU threads each of ``local_size`` ranks on this host gets: an equal share, at least 1."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        cpus = os.cpu_count() or 1
    return max(1, cpus // max(1, local_size))


def _pump(client: ServiceClient, rank: int, stream: str, pipe) -> None:
    """Forward a pipe's lines to the driver as they come (very long lines in pieces)."""
    forward = True
    with pipe:
        for raw in iter(lambda: pipe.readline(MAX_LINE_BYTES), b""):
            if not forward:
                continue  # keep draining so the process never blocks on a full pipe
            line = raw.decode("utf-8", errors="replace").rstrip("\r\n")
            try:
                client.notify(Kind.LOG, {"rank": rank, "stream": stream, "lines": [line]})
            except Exception:  # noqa: BLE001 - the driver has gone or refused: stop forwarding, not draining
                forward = False


def _kill_group(proc: subprocess.Popen) -> None:
    """Kill the rank's process and everything it started (its own session and group)."""
    try:
        os.killpg(proc.pid, 9)
    except (ProcessLookupError, PermissionError):
        pass
