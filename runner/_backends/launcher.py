"""How ranks are started: the launcher interface and the local (driver) launcher."""

from __future__ import annotations

import abc
import socket
import subprocess
import threading
import time

from .._agent.agent import run_task
from .._agent.process import kill_group
from .._agent.spec import TaskSpec


class Launcher(abc.ABC):
    """Starts ``np`` task agents somewhere and can stop them all."""

    #: Human-readable description for messages, e.g. "a Spark barrier stage on local[2]".
    description: str = ""
    #: Whether what failed cannot run ranks again (a stopped SparkContext): no restart is tried.
    fatal: bool = False

    @abc.abstractmethod
    def start(self, spec: TaskSpec) -> None:
        """Start every task; returns at once."""

    @abc.abstractmethod
    def failure(self) -> str | None:
        """Why the launch itself failed (a Spark job failure, say), or None."""

    def lost(self, unfinished: list) -> str | None:
        """Why these ranks (``(rank, Registration)``) may have vanished, if known."""
        return None

    @abc.abstractmethod
    def join(self, timeout: float) -> bool:
        """Wait for every task to end; True if all have."""

    @abc.abstractmethod
    def stop(self) -> None:
        """Stop every task now (idempotent)."""


class JobLauncher(Launcher):
    """A launcher whose tasks run as one Spark job, submitted and awaited on a thread of its own (``_job``); the
    job's error is the launch's failure."""

    def __init__(self):
        self._thread: threading.Thread | None = None
        self._error: str | None = None
        self._stopped = False

    def _submit(self, spec: TaskSpec, name: str) -> None:
        self._thread = threading.Thread(target=self._job, args=(spec,), daemon=True, name=f"{name}-{spec.run_id}")
        self._thread.start()

    @abc.abstractmethod
    def _job(self, spec: TaskSpec) -> None:
        """Run the job to its end; set ``_error`` where it fails (not after ``stop``)."""

    def failure(self) -> str | None:
        return self._error

    def join(self, timeout: float) -> bool:
        if self._thread is not None:
            self._thread.join(timeout)
            return not self._thread.is_alive()
        return True


class LocalLauncher(Launcher):
    """``n`` rank processes on the driver, each behind an agent thread (np < 0)."""

    def __init__(self, n: int):
        self.n = n
        self.description = f"{n} process{'es' if n > 1 else ''} on the driver"
        self._procs: list[subprocess.Popen] = []
        self._threads: list[threading.Thread] = []
        self._errors: list[str] = []
        self._lock = threading.Lock()
        self._stopped = False

    def start(self, spec: TaskSpec) -> None:
        host = socket.gethostname()
        for task in range(self.n):
            thread = threading.Thread(target=self._agent, args=(spec, task, host), daemon=True,
                                      name=f"sparkhvd-local-task-{task}")
            self._threads.append(thread)
            thread.start()

    def _agent(self, spec: TaskSpec, task: int, host: str) -> None:
        try:
            run_task(spec, task, host=host, on_spawn=self._spawned)
        except Exception as exc:  # noqa: BLE001 - reported through failure()
            with self._lock:
                if not self._stopped:
                    self._errors.append(f"the agent of task {task} failed: {type(exc).__name__}: {exc}")

    def _spawned(self, proc: subprocess.Popen) -> None:
        with self._lock:
            self._procs.append(proc)
            stopped = self._stopped
        if stopped:
            kill_group(proc)

    def failure(self) -> str | None:
        with self._lock:
            return "; ".join(self._errors) or None

    def join(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        return not any(t.is_alive() for t in self._threads)

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
            procs = list(self._procs)
        for proc in procs:
            kill_group(proc)  # also what an exited rank left running
