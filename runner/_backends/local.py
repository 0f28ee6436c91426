"""Processes on the driver (np < 0): one agent thread per rank, each starting its rank's process."""

from __future__ import annotations

import socket
import subprocess
import threading
import time

from .._agent.agent import run_task
from .._agent.process import kill_group
from .._agent.spec import TaskSpec
from .api import Backend, Launcher


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


class LocalBackend(Backend):
    """Ranks as processes on the driver: every slot is there, nothing to check or replace."""

    name = "local"

    def prepare(self, np: int, *, run_id: str, verbose: bool, gpus: bool) -> str:
        return "127.0.0.1"

    def launcher(self, n: int, *, gpus: bool) -> Launcher:
        return LocalLauncher(n)

    def free_slots(self) -> int:
        return 0  # a run on the driver has a fixed number of processes: it never grows

    def slots_for_restart(self, want: int, least: int | None, timeout: float) -> int:
        return want

    def replace_hosts(self, hosts: frozenset) -> None:
        pass  # the driver's own processes: no executor to replace
