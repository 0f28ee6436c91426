"""A launcher whose tasks run as one Spark job on a thread of its own: Spark's and Spark Connect's."""

from __future__ import annotations

import abc
import threading

from .._agent.spec import TaskSpec
from .api import Launcher


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
