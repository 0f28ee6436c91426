"""The backend contract: where a run's ranks run (``Backend``) and how one attempt's tasks are started (``Launcher``).

The driver's ``HorovodRunner`` asks ``registry.backend_for`` for a backend once per run; the run's policy
(runner/_policy/) then asks it for slots and one launcher per attempt, through these two classes alone. A new
backend is one module that implements ``Backend`` plus one line in ``registry.py``; the contract test
(tests/runner/backends/test_backend_contract.py) runs over every backend.
"""

from __future__ import annotations

import abc

from .._agent.spec import TaskSpec


class Launcher(abc.ABC):
    """Starts ``np`` task agents somewhere and can stop them all."""

    #: Human-readable description for messages, e.g. "a Spark barrier stage on local[2]".
    description: str = ""
    #: Whether what failed cannot run ranks again (a stopped SparkContext): no restart is tried.
    fatal: bool = False

    @abc.abstractmethod
    def start(self, spec: TaskSpec) -> None:
        """Start every task; returns at once.

        Raises:
            RuntimeError: (Spark's, a run's first attempt) other runs of this driver took the task slots since
                ``prepare`` found them, in one sentence with the numbers and the fix (``running.py``).
        """

    @abc.abstractmethod
    def failure(self) -> str | None:
        """Why the launch itself failed (a Spark job failure, say), or None."""

    def lost(self, unfinished: list) -> str | None:
        """Why these ranks (``(rank, Registration)``) may have vanished, if known."""
        return None

    def lost_ranks(self, unfinished: list) -> set:
        """Which of these ranks (``(rank, Registration)``) ran where the cluster says it lost them: no exit will
        come from them."""
        return set()

    def preempted(self, unfinished: list) -> str | None:
        """Whether the cluster is taking back (decommissioning) an executor where these ranks (``(rank,
        Registration)``) run: a clause naming the executors, their hosts and their ranks, or None."""
        return None

    def waiting_for(self) -> str:
        """While ranks have not registered: what the backend says of the launch, as a clause for the wait's note
        (``" (Spark has not submitted the barrier stage yet)"``), or "" where it says nothing."""
        return ""

    @abc.abstractmethod
    def join(self, timeout: float) -> bool:
        """Wait for every task to end; True if all have."""

    @abc.abstractmethod
    def stop(self) -> None:
        """Stop every task now (idempotent)."""


def check_ranks_per_task(np: int, per_task: int, name: str = "np") -> None:
    """Refuse a rank count (``name``: np, min_np, max_np) that ``per_task`` ranks in each task cannot make
    (RuntimeError, with the numbers)."""
    if np % per_task:
        below, above = np // per_task * per_task, (np // per_task + 1) * per_task
        choices = f"{name}={below} or {name}={above}" if below else f"{name}={above}"
        raise RuntimeError(
            f"{name}={np} is not a multiple of spark.task.resource.gpu.amount={per_task}: each Spark task holds "
            f"{per_task} GPUs and runs one rank on each; use {choices}, or set spark.task.resource.gpu.amount=1 "
            "for one rank per task.")


class Backend(abc.ABC):
    """Where a run's ranks run: a Spark barrier stage per attempt, a Spark Connect session's, or processes on the
    driver. One object per run: it may keep what the run's attempts share (the executors it asked to replace).
    ``prepare`` is called once, before any other method, which may rely on what it found."""

    #: The ``sparkhvd.runner._backends`` module name, for messages and tests ("local", "spark", "connect").
    name: str = ""
    #: Ranks in each of its tasks, known once ``prepare`` has run: k where a Spark task holds k GPUs, one rank on each
    #: (spark.py: ranks_per_task). Every attempt's rank count is a multiple of it.
    per_task: int = 1
    #: Known once ``prepare`` has run: True where the ranks cannot reach this process (a Spark Connect client off the
    #: cluster), so that rank 0's task hosts each attempt's driver service (runner/_policy/hosted.py); ``launcher``'s
    #: launchers then start a ``HostedAttempt``, and ``prepare`` returns no address.
    hosts_service: bool = False

    def check_sizes(self, **sizes) -> None:
        """Refuse, after ``prepare``, an elastic bound (``min_np=``, ``max_np=``; None: unset) that is not a multiple
        of ``per_task`` (RuntimeError, with the numbers)."""
        for name, value in sizes.items():
            if value is not None:
                check_ranks_per_task(value, self.per_task, name)

    @abc.abstractmethod
    def prepare(self, np: int, *, run_id: str, verbose: bool, gpus: bool) -> str:
        """Check, before anything launches, that ``np`` ranks can run here; return the address the driver
        service binds to (one the tasks reach). ``gpus``: whether each task asks for a GPU where there are some.

        Raises:
            RuntimeError: the ranks cannot all run at once (task slots, GPU slots, dynamic allocation, the
                executors' Python, an unreachable server), in one sentence with the numbers and the fix.
            JavaNotFoundError: a Spark session had to be started and no Java 17+ was found.
        """

    @abc.abstractmethod
    def launcher(self, n: int, *, gpus: bool) -> Launcher:
        """A launcher for one attempt of ``n`` ranks (not started)."""

    @abc.abstractmethod
    def free_slots(self) -> int:
        """Task slots no running task holds: what the run may grow into (0 where it cannot grow)."""

    @abc.abstractmethod
    def slots_for_restart(self, want: int, least: int | None, timeout: float) -> int:
        """Ranks a restart can have: ``want`` once there are that many slots; at once what there is, if at least
        ``least`` (min_np: the run goes on with fewer and grows back at a commit).

        Raises:
            RuntimeError: fewer than ``want`` slots and fewer than ``least`` (or ``least`` is None) for
                ``timeout`` seconds, in one sentence with the numbers and the fix.
        """

    @abc.abstractmethod
    def replace_hosts(self, hosts: frozenset) -> None:
        """Ask the cluster to replace the executors on ``hosts``, whose ranks went silent (nothing where it cannot).
        Never raises: a cluster that cannot be asked is warned about, and notices the loss itself later."""
