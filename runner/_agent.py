"""The task agent: what runs in each Spark barrier task (or launcher thread) for one rank.

It registers with the driver (with its GPUs, mapped through its executor's own
``CUDA_VISIBLE_DEVICES``), receives its rank and this job's GPUs on its host, starts the rank's
own Python process with those GPUs in its environment (a fresh process, so the list holds before
any CUDA work even when Spark reuses its Python workers), forwards that process's stdout and stderr
to the driver in batches of lines, and reports its exit code. The secret reaches the rank process on
its stdin, never on a command line or in the environment.
"""

from __future__ import annotations

import os
import select
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from .._common import settings
from .._common.client import RunAborted, ServiceClient, ServiceError
from .._common.commits import ENV_COMMIT_DIR
from .._common.protocol import FLUSH_CHARS, MAX_LINE_BYTES, MAX_PROGRESS_CHARS, Kind
from ._host import host_id

#: Environment of the rank process; read by ``_worker`` only.
READ_BYTES = 64 * 1024  # a pipe's default capacity: one read takes all there is
# A LOG frame goes when this many characters of lines are pending, or this long after the oldest
# was read. Its JSON (at most 6 bytes a character, 12 for a pair of surrogates, plus a progress
# state of at most MAX_PROGRESS_CHARS) stays well under the protocol's MAX_META_BYTES.
FLUSH_S = 0.05
PROGRESS_S = 0.25  # a progress bar's state goes to the driver at most this often (4 a second)
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
    commit_dir: str | None = None  # where rank 0 writes elastic commits (_common/commits.py); default: the driver
    env: tuple = field(default=(), repr=False)  # (name, value) pairs added to the rank's environment (MLflow)


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
    host = host or socket.gethostname()
    try:  # mapped here, through this executor's own list: another executor on the host may have another
        devices, unusable = visible_gpus(list(gpus or []), os.environ.get("CUDA_VISIBLE_DEVICES")), None
    except ValueError as exc:
        devices, unusable = [], exc
    try:
        answer = client.request(Kind.REGISTER, {
            "task": task, "host": host, "host_id": host_id(), "pid": os.getpid(),
            "gpus": list(gpus or []), "devices": devices}).meta
    except (RunAborted, ServiceError) as exc:
        client.close()
        return {"task": task, "rank": None, "exit": None, "note": str(exc)}
    host_gpus = [str(d) for d in answer.pop("host_gpus", None) or []]
    placement = answer  # exactly a Placement's fields: the rank process reads it back as one
    rank = placement["rank"]
    try:
        if unusable is not None:
            raise unusable
        env = _rank_env(spec, placement, host_gpus, host)
    except ValueError as exc:  # the executor's GPU settings: the rank's error, not a Spark task failure
        _report(client, Kind.ERROR, {"rank": rank, "type": "ValueError", "message": str(exc), "traceback": ""})
        _report(client, Kind.EXIT, {"rank": rank, "code": 1})
        client.close()
        return {"task": task, "rank": rank, "exit": 1, "note": str(exc)}
    proc = _spawn(spec.python, env, rank)
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


def _rank_env(spec: TaskSpec, placement: dict, host_gpus: list[str], host: str) -> dict:
    """The rank process's environment. ``host_gpus``: this job's GPUs on the host, in local-rank order
    (``_common/topology.py: host_gpus``), its ``CUDA_VISIBLE_DEVICES``; empty: the executor's is kept."""
    import json

    env = dict(os.environ)
    env.update(spec.env)
    env.update({
        settings.DRIVER.name: f"{spec.address[0]}:{spec.address[1]}",
        settings.RUN_ID.name: spec.run_id,
        settings.PLACEMENT.name: json.dumps(placement),
        settings.PARENT_PID.name: str(os.getpid()),
        settings.RETURN.name: "all" if spec.every_value else "0",
        "PYTHONUNBUFFERED": "1",
    })
    if spec.commit_dir:
        env[ENV_COMMIT_DIR] = spec.commit_dir
    if spec.network_interface:
        env[settings.NETWORK_INTERFACE.name] = spec.network_interface
        env["GLOO_SOCKET_IFNAME"] = env["NCCL_SOCKET_IFNAME"] = spec.network_interface
    if "OMP_NUM_THREADS" not in env:
        # As torchrun does: ranks sharing a host split its cores, instead of each starting one OpenMP
        # thread per core, whose spinning then starves the other ranks (measured: a Keras step at np=2
        # on 2 cores went from 20 ms to 7 ms).
        env["OMP_NUM_THREADS"] = str(omp_threads(placement["local_size"]))
    if host_gpus:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(host_gpus)
        env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    # Horovod and torchrun variables that would make hvd.init() join a different job.
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    return env


def visible_gpus(addresses: list, visible: str | None) -> list:
    """A task's GPUs as its host names them: Spark's GPU addresses, mapped through an executor's own
    ``CUDA_VISIBLE_DEVICES`` when it has one (Spark's addresses then index that list), as
    pyspark's TorchDistributor does. Each task maps its own, before it registers: executors on one
    host may have different lists."""
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


class _Lines:
    """Splits a stream's bytes into lines as a terminal shows them (the pure part of ``_pump``).

    A line rewritten with ``\\r`` (a tqdm bar) counts once, as its final state: the text after its
    last ``\\r``. While such a line is unfinished, ``progress()`` is its current state; only that
    state is held, so a bar updated forever costs no memory. Lines longer than ``MAX_LINE_BYTES``
    come out in pieces of that size.
    """

    def __init__(self):
        self._partial = b""  # the unfinished line
        self._live = False  # whether it has been rewritten with \r

    def feed(self, data: bytes) -> list:
        buf = self._partial + data
        end = buf.rfind(b"\n")
        lines = []
        if end >= 0:
            for raw in buf[:end].split(b"\n"):
                lines.extend(_pieces(_final(raw) if b"\r" in raw else raw))
            buf = buf[end + 1:]
            self._live = False
        if b"\r" in buf:
            self._live = True
            cut = buf.rstrip(b"\r").rfind(b"\r")
            buf = buf[cut + 1:]  # the current state, and a trailing \r that the next write overwrites
        while len(buf) > MAX_LINE_BYTES:
            lines.append(buf[:MAX_LINE_BYTES].decode("utf-8", errors="replace"))
            buf = buf[MAX_LINE_BYTES:]
        self._partial = buf
        return lines

    def progress(self) -> str | None:
        """The unfinished line's state if it is a bar (rewritten with ``\\r``), else None."""
        if not self._live:
            return None
        state = self._partial.rstrip(b"\r")[:MAX_PROGRESS_CHARS].decode("utf-8", errors="replace")
        return state or None

    def end(self) -> list:
        """The unfinished line, at the end of the stream."""
        lines = _pieces(_final(self._partial)) if self._partial else []
        self._partial, self._live = b"", False
        return lines


def _final(raw: bytes) -> bytes:
    """What a terminal leaves of a line rewritten with \\r: the text after the last one (before
    any trailing \\r, as in a Windows line end)."""
    raw = raw.rstrip(b"\r")
    return raw[raw.rfind(b"\r") + 1:]


def _pieces(raw: bytes) -> list:
    return [raw[i:i + MAX_LINE_BYTES].decode("utf-8", errors="replace")
            for i in range(0, max(len(raw), 1), MAX_LINE_BYTES)]


def _pump(client: ServiceClient, rank: int, stream: str, pipe) -> None:
    """Forward a pipe's output to the driver as it comes, in batches: a LOG frame when
    ``FLUSH_CHARS`` are pending or ``FLUSH_S`` after the oldest pending line, and at the end. An
    unfinished ``\\r``-rewritten line goes along as the frame's ``progress``, at most every
    ``PROGRESS_S``."""
    fd = pipe.fileno()
    poller = select.poll()  # not select.select: an executor's descriptors may pass FD_SETSIZE
    poller.register(fd, select.POLLIN)
    lines = _Lines()
    batch: list = []
    pending = 0  # characters in batch
    oldest = 0.0  # when batch's first line was read
    shown = None  # the progress state last sent
    shown_at = -PROGRESS_S
    forward = True

    def send(progress: str | None) -> None:
        nonlocal batch, pending, shown, shown_at, forward
        if forward and (batch or progress is not None):
            try:
                meta = {"rank": rank, "stream": stream, "lines": batch}
                if progress is not None:
                    meta["progress"] = progress
                client.notify(Kind.LOG, meta)
            except Exception:  # noqa: BLE001 - the driver has gone or refused: stop forwarding, not draining
                forward = False
        if batch:
            shown = None  # these lines may have finished the bar last shown
        if progress is not None:
            shown, shown_at = progress, time.monotonic()
        batch, pending = [], 0

    with pipe:
        while True:
            state = lines.progress()
            due = [oldest + FLUSH_S] if batch else []
            if state is not None and state != shown:
                due.append(shown_at + PROGRESS_S)
            wait = None if not due else max(0.0, min(due) - time.monotonic())
            if poller.poll(None if wait is None else wait * 1000):
                data = os.read(fd, READ_BYTES)
                if not data:
                    break
                for line in lines.feed(data):
                    if pending + len(line) > FLUSH_CHARS:
                        send(None)
                    if not batch:
                        oldest = time.monotonic()
                    batch.append(line)
                    pending += len(line) + 1
            now = time.monotonic()
            state = lines.progress()
            bar = state if state is not None and state != shown and now >= shown_at + PROGRESS_S else None
            if bar is not None or (batch and (pending >= FLUSH_CHARS or now >= oldest + FLUSH_S)):
                send(bar)
        batch.extend(lines.end())
        send(None)


def _spawn(python: str | None, env: dict, rank: int):
    """Start the rank's process: forked from this executor's warm zygote (runner/_zygote.py) when
    there is one, else a fresh ``python -m sparkhvd.runner._worker rank=<rank>`` (the argument only
    names the rank in ps: /proc/<pid>/environ of a forked rank is the zygote's). Either has Popen's
    surface."""
    from . import _zygote

    argv = ("-m", "sparkhvd.runner._worker", f"rank={rank}")
    if _zygote.enabled(python):
        try:
            return _zygote.spawn(env, argv=argv)
        except Exception as exc:  # noqa: BLE001 - any failure of the warm path: a fresh process
            if os.environ.get(_zygote.ENV_DEBUG) == "1":
                sys.stderr.write(f"sparkhvd: the warm zygote did not start this rank ({type(exc).__name__}: {exc}); "
                                 "starting a fresh process.\n")
    return subprocess.Popen([python or sys.executable, *argv],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=env, start_new_session=True)


def _kill_group(proc: subprocess.Popen) -> None:
    """Kill the rank's process and everything it started (its own session and group)."""
    try:
        os.killpg(proc.pid, 9)
    except (ProcessLookupError, PermissionError):
        pass
