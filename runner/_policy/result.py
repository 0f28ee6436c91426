"""What a run gives back: its ``RunResult``, and a ``RestartEvent`` for each time it was relaunched."""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class RunResult:
    """Everything one run produced.

    ``values[r]`` is rank ``r``'s return value; ``log_paths[r]`` the file holding rank ``r``'s
    stdout and stderr; ``placements[r]`` its rank, local_rank, cross_rank and sizes; ``hosts[r]``
    and ``gpus[r]`` where it ran.
    """

    values: list
    run_id: str
    log_dir: str
    log_paths: dict
    placements: list
    hosts: list
    gpus: list
    payload_bytes: int
    seconds: float
    restarts: list = field(default_factory=list)  # a RestartEvent per restart (HorovodRunner(max_restarts=))
    commits: list = field(default_factory=list)  # with storage: the commits the run left there (their metas)
    #: every rank's metrics over the run, from its heartbeats: ``{rank: [row, ...]}``, each row's totals (steps,
    #: seconds in collectives and data waits, CPU, memory, GPU) and rates since the row before (runner/_service/metrics.py)
    metrics: dict = field(default_factory=dict)
    #: the merged timeline of every rank (HOROVOD_TIMELINE's path, or timeline.json in the log folder) where a rank
    #: recorded one (runner/_service/timeline.py); None where none did
    timeline: str | None = None

    @property
    def value(self):
        """Rank 0's return value (what ``HorovodRunner.run`` returns)."""
        return self.values[0]


@dataclass
class RestartEvent:
    """One restart after an infrastructure failure, or a retry of a user's exception of ``retry_on``
    (``RunResult.restarts``, printed on the driver).

    ``lost``: the failure's cause; ``kind``: ``"restart"`` (counted against ``max_restarts``),
    ``"retry"`` (against ``max_retries``), ``"preemption"`` (against ``max_preemptions``) or ``"mesh"`` (gloo did not
    connect the ranks while they built their process group: relaunched twice at most, apart from the others); ``attempt`` of
    ``attempts``: this relaunch's attempt of its kind (2 is the first) and the most there can be (None: no limit); ``commit``: the plain fields (epoch, batch) of the
    commit the ranks resumed from, None where they started from the beginning; ``seconds``: from the
    driver seeing the failure to rank 0 loading that commit (to the new ranks' start where the
    function does not use ``hvd.elastic.run``).
    """

    attempt: int
    attempts: int | None
    lost: str | None  # None: not a failure, the run grew (every rank left at a commit, Spark had slots for more)
    np_before: int
    np_after: int
    failed_at: float = field(repr=False, default=0.0)
    commit: dict | None = None
    seconds: float | None = None
    counted: bool = True  # False: not one of max_restarts (a grown stage that could not start, run again smaller)
    #: ``time.monotonic()`` of each step from the failure to the resumed training, on the driver: ``failed``
    #: (seen), ``exited`` (the ranks' processes), ``cancelled`` (the tasks ended), ``slots`` (Spark had them),
    #: ``launched`` (the next attempt started), ``registered`` (its first task), ``placed`` (its last),
    #: ``fetched`` (every rank's process asked for the function), ``resumed`` (rank 0 asked for the commit)
    stamps: dict = field(repr=False, default_factory=dict)
    kind: str = "restart"

    def line(self, run_id: str) -> str:
        if self.commit is None:
            resumed = "from the beginning (no state.commit() had reached the driver)"
        else:
            fields = " ".join(f"{k}={v}" for k, v in self.commit.items()) or "with no plain fields"
            resumed = f"from the last commit ({fields})"
        ranks = f" with np={self.np_after} (was {self.np_before})" if self.np_after != self.np_before else ""
        since = ("the preemption notice" if self.kind == "preemption" else "the failure") if self.lost is not None \
            else "every rank left"
        when = f" {self.seconds:.1f} s after {since}" if self.seconds is not None else ""
        return f"[sparkhvd] run {run_id}: {self.what()}; training resumed{when}{ranks}, {resumed}."

    def what(self) -> str:
        if self.lost is None:
            if self.np_after == self.np_before:
                return (f"relaunching with np={self.np_after} at a commit: the task slots Spark had free for more "
                        "ranks were taken meanwhile")
            return (f"growing from np={self.np_before} to np={self.np_after} at a commit, as Spark has task slots for "
                    "more ranks")
        if not self.counted:
            return f"going back from np={self.np_before} to np={self.np_after} after {self.lost}"
        if self.kind == "preemption":
            most = "" if self.attempts is None else f" of {self.attempts - 1}"
            return f"preempted: relaunch {self.attempt - 1}{most} (max_preemptions) after {self.lost}"
        if self.kind == "mesh":
            return (f"relaunch {self.attempt - 1} of {self.attempts - 1} (not one of max_restarts) after gloo did not "
                    f"connect the ranks while they built their process group: {self.lost}")
        what = "retry" if self.kind == "retry" else "restart"
        return f"{what} {self.attempt - 1} of {self.attempts - 1} after {self.lost}"


def resumed(event: RestartEvent | None, run_id: str, commit: dict | None, *, at: float | None = None) -> None:
    """The restart's ranks resumed (rank 0 asked for its commit, or ``at``: they started): say so, once."""
    if event is None or event.seconds is not None:
        return
    at = time.monotonic() if at is None else at
    event.seconds = at - event.failed_at
    event.stamps["resumed"] = at
    event.commit = None if commit is None else dict(commit.get("fields") or {})
    print(event.line(run_id), flush=True)
