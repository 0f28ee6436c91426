"""The barrier stages this driver's sparkhvd runs hold, per SparkContext: what several runs at once share.

Spark's slot count (``spark.task_slots``) counts busy slots too, and its status tracker sees a barrier stage's
tasks only once they run; a barrier stage whose slots another run holds waits for them, silently, until
``start_timeout``. So each ``SparkLauncher`` holds its stage's task count here from its submission to the end of
its job, under one lock, and a run whose np is more than the slots less what the others hold is refused at once
(``refusal``). Runs on the driver (np<0) hold no task slot and are not here.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass


@dataclass(frozen=True)
class Stage:
    """One running barrier stage: the SparkContext's application, the run and Spark job group, its task count and
    the ranks in each task."""

    app: str
    run_id: str
    group: str
    tasks: int
    per_task: int = 1


_lock = threading.Lock()
_stages: dict[str, Stage] = {}  # job group -> its stage, from submission to the end of its job


def held(app: str, *, other_than: str | None = None) -> list[Stage]:
    """A snapshot of the stages running on application ``app``, but those of run ``other_than``."""
    with _lock:
        return [s for s in _stages.values() if s.app == app and s.run_id != other_than]


def hold(stage: Stage, *, slots: int | None = None, master: str = "") -> None:
    """Hold ``stage``'s tasks until ``release``; where ``slots`` is given (a run's first stage), first check, in
    the same lock, that the other runs leave enough of them (RuntimeError, ``refusal``'s sentence, if not)."""
    with _lock:
        if slots is not None:
            others = [s for s in _stages.values() if s.app == stage.app and s.run_id != stage.run_id]
            problem = refusal(stage.tasks, slots, master, others, stage.per_task)
            if problem is not None:
                raise RuntimeError(problem)
        _stages[stage.group] = stage


def release(group: str) -> None:
    """The stage of job group ``group`` has ended (idempotent)."""
    with _lock:
        _stages.pop(group, None)


def free(slots: int, stages: list[Stage]) -> int:
    """What ``slots`` task slots leave once ``stages`` hold theirs (never below 0)."""
    return max(0, slots - sum(s.tasks for s in stages))


def refusal(np: int, slots: int, master: str, stages: list[Stage], per_task: int = 1) -> str | None:
    """Why np tasks cannot all start on a cluster of ``slots`` task slots (``master``) while ``stages`` run, as
    one sentence with the numbers and the fix; None where they can (or where ``slots`` alone is short: the
    slot check's own sentence says that). ``per_task``: the ranks of each task, which the sentence counts np in."""
    left, taken = free(slots, stages), sum(s.tasks for s in stages)
    if np <= left or np > slots:
        return None
    runs: dict[str, int] = {}
    for s in stages:
        runs[s.run_id] = runs.get(s.run_id, 0) + s.tasks
    each = ", ".join(f"run {run_id}: {n} task{'s' if n != 1 else ''}" for run_id, n in sorted(runs.items()))
    fewer = f"use np<={left * per_task}, " if left > 0 else ""
    return (f"np={np * per_task} needs {np} task slot{'s' if np != 1 else ''} but the cluster has {slots} ({master}) and "
            f"{len(runs)} sparkhvd run{'s' if len(runs) != 1 else ''} of this driver still running hold "
            f"{taken} of them ({each}), leaving {left} free; {fewer}start this run once "
            f"{'one of them has' if len(runs) != 1 else 'it has'} ended, or use np=-{np * per_task} to run on the "
            "driver.")
