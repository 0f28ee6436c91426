"""The test side of the cluster's driver process (``_driver.py``): send it jobs, read back Outcomes.

The driver is a separate process in the root namespace, not pytest itself: a process holds
one SparkContext, and tests/conftest.py's ``spark`` fixture (``local[2]``) must keep getting its
own; a driver that fault tests can wreck is better off outside pytest anyway.
"""

from __future__ import annotations

import base64
import itertools
import json
import os
import pickle
import queue
import re
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ._netns import DRIVER_ADDRESS, TestbedError

if TYPE_CHECKING:
    from ._cluster import Cluster

RESPONSE_MARK = "@@sparkhvd-cluster-driver@@ "  # _driver.py's MARK
_HERE = os.path.dirname(os.path.abspath(__file__))


def _pyspark_home() -> str:
    import pyspark

    return os.path.dirname(os.path.abspath(pyspark.__file__))


def _set_parent_death_signal() -> None:  # runs in the child between fork and exec
    import ctypes

    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: die with the pytest process


def _tail(path: str, lines: int = 25) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError as exc:
        return f"({path}: {exc})"


@dataclass
class Outcome:
    """What one ``HorovodRunner(np).run_all(job)`` on the cluster gave."""

    ok: bool
    seconds: float
    values: list = field(default_factory=list)
    hosts: list = field(default_factory=list)
    placements: list = field(default_factory=list)  # dicts: rank, local_rank, cross_rank, ...
    gpus: list = field(default_factory=list)
    restarts: list = field(default_factory=list)  # RunResult.restarts, as dicts
    error_type: str | None = None
    error: str | None = None
    output: str = ""  # what the driver printed during the run ("[rank] line"s included)

    def headline(self) -> str:
        return (self.error or "").strip().splitlines()[0] if self.error else ""

    def diagnosis(self, lines: int = 15) -> str:
        """A failed run's driver output and the tail of every rank's log (the folder its error names): for a
        failure message, where the first rank to fail is not always the one whose fault it was."""
        parts = [f"the driver's output:\n{self.output[-3000:]}"]
        found = re.search(r"Each rank's full output is in (\S+)/rank-<rank>\.log", self.error or "")
        if found and os.path.isdir(found.group(1)):
            for name in sorted(os.listdir(found.group(1))):
                parts.append(f"{name}:\n{_tail(os.path.join(found.group(1), name), lines)}")
        return "\n".join(parts)


class PendingRun:
    """A run the driver is doing; ``result(timeout)`` waits (bounded) for its Outcome."""

    def __init__(self, driver: "Driver", request_id: int, job: str, start: int):
        self.driver, self.request_id, self.job, self._start = driver, request_id, job, start
        self.submitted = time.monotonic()

    def output(self) -> str:
        """What the driver has printed since the run started."""
        return self.driver.output_since(self._start)

    def wait_for_output(self, text: str, timeout: float) -> str:
        """Wait (bounded) until the driver has printed ``text`` during this run; returns the output."""
        deadline = time.monotonic() + timeout
        while text not in (out := self.output()):
            if time.monotonic() >= deadline:
                raise TestbedError(f"the driver did not print {text!r} within {timeout:.0f} s; it printed:\n"
                                   f"{out[-3000:]}")
            time.sleep(0.05)
        return out

    def result(self, timeout: float) -> Outcome:
        response = self.driver._wait(self.request_id, timeout, f"run {self.job}")
        # The reader thread appends stdout lines in order, so the run's output is all in before its answer.
        return Outcome(output=self.output(), **{k: v for k, v in response.items() if k not in ("id", "op")})


class Driver:
    """The driver process: a SparkSession on the cluster, running jobs it is sent one at a time."""

    def __init__(self, cluster: "Cluster", conf: dict, executor_env: dict, log_path: str, slots: int | None = None):
        """``slots``: the task slots it waits for (default: the cluster's, one GPU per task)."""
        self.cluster = cluster
        self.log_path = log_path
        self._ids = itertools.count()
        self._responses: queue.Queue = queue.Queue()
        self._lines: list[str] = []
        self._lock = threading.Lock()
        config = {"master": cluster.master_url, "conf": conf, "executor_env": executor_env,
                  "executors": len(cluster.hosts), "slots": cluster.slots if slots is None else slots}
        self._log = open(log_path, "a", buffering=1)
        env = dict(os.environ, PYSPARK_PYTHON=cluster.python, SPARK_HOME=_pyspark_home(),
                   SPARK_LOCAL_IP=DRIVER_ADDRESS, SPARK_CONF_DIR=cluster.conf_dir,
                   TMPDIR=cluster._dir("driver", "tmp"))  # the runs' log folders go with the cluster
        self.proc = subprocess.Popen(
            [cluster.python, os.path.join(_HERE, "_driver.py"), json.dumps(config)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True, env=env,
            cwd=cluster.base_dir, start_new_session=True, preexec_fn=_set_parent_death_signal)
        threading.Thread(target=self._read, daemon=True, name="cluster-driver-stdout").start()
        self.ready: dict | None = None

    def _read(self) -> None:
        for line in self.proc.stdout:
            if line.startswith(RESPONSE_MARK):
                self._responses.put(pickle.loads(base64.b64decode(line[len(RESPONSE_MARK):])))
            else:
                self._log.write(line)
                with self._lock:
                    self._lines.append(line)
        self._responses.put(None)  # the driver has exited

    def _wait(self, request_id, timeout: float, what: str):
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TestbedError(f"the cluster driver did not answer {what} within {timeout:.0f} s; "
                                   f"its log ({self.log_path}) ends:\n{_tail(self.log_path)}")
            try:
                response = self._responses.get(timeout=left)
            except queue.Empty:
                continue
            if response is None:
                self._responses.put(None)
                raise TestbedError(f"the cluster driver exited (code {self.proc.poll()}) before answering "
                                   f"{what}; its log ({self.log_path}) ends:\n{_tail(self.log_path)}")
            if response.get("id") == request_id:
                return response

    def wait_ready(self, timeout: float) -> dict:
        self.ready = self._wait("ready", timeout, "that its executors registered")
        if not self.ready.get("ok"):
            raise TestbedError(f"the cluster driver could not start: {self.ready.get('error')}\n"
                               f"{self.cluster.diagnostics()}")
        return self.ready

    def _send(self, op: str, **fields) -> int:
        request_id = next(self._ids)
        line = base64.b64encode(pickle.dumps({"id": request_id, "op": op, **fields})).decode()
        try:
            self.proc.stdin.write(line + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            raise TestbedError(f"the cluster driver has exited (code {self.proc.poll()}); its log "
                               f"({self.log_path}) ends:\n{_tail(self.log_path)}") from None
        return request_id

    def request(self, op: str, timeout: float, **fields) -> dict:
        return self._wait(self._send(op, **fields), timeout, f"{op} {fields.get('job', '')}".strip())

    def submit(self, job: str, np: int, *, runner: dict | None = None, driver_env: dict | None = None,
               **kwargs) -> "PendingRun":
        """Start ``HorovodRunner(np, **runner).run_all(_jobs.<job>, **kwargs)`` on the driver, with ``driver_env`` in
        the driver's environment meanwhile; returns at once."""
        with self._lock:
            start = len(self._lines)
        request_id = self._send("run", job=job, np=np, kwargs=kwargs, runner=runner or {}, driver_env=driver_env or {})
        return PendingRun(self, request_id, job, start)

    def run(self, job: str, np: int, *, timeout: float = 120, runner: dict | None = None,
            driver_env: dict | None = None, **kwargs) -> Outcome:
        """``HorovodRunner(np, **runner).run_all(_jobs.<job>, **kwargs)`` on the driver, to the end."""
        return self.submit(job, np, runner=runner, driver_env=driver_env, **kwargs).result(timeout)

    def output_since(self, start: int) -> str:
        with self._lock:
            return "".join(self._lines[start:])

    def executors(self, timeout: float = 30) -> list:
        """The executors the driver's SparkContext knows now: ``[{"id", "host", ...}]``."""
        return self.request("executors", timeout)["executors"]

    def close(self, timeout: float = 20) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()  # the driver stops its session and exits
            except OSError:
                pass
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # its JVM too, if anything is left
        except ProcessLookupError:
            pass
        self.proc.wait(10)
        self._log.close()
