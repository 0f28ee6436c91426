"""``HorovodRunner``'s settings as one dataclass, each checked on creation with a sentence that says the fix."""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field

from .._common import settings
from ._service.commit_store import check_commit_dir
from ._service.logs import VERBOSITIES
from ._service.run_storage import check_run_id
from ._shared.framework_env import LAYOUTS

DEFAULT_RETRIES = 3  # max_retries where retry_on names classes and max_retries is not given


@dataclass
class RunnerConfig:
    """HorovodRunner's settings, validated on creation.

    The keyword-only fields are what the drop-ins and the estimators set (never HorovodRunner's own arguments):
    ``layout``, the torchrun variables' layout (runner/_shared/framework_env.py); ``use_gpu`` False, tasks ask for no
    GPU and ranks see none; ``warn_unencrypted`` False, the caller checked Spark's encryption itself;
    ``one_rank_per_task`` True, a Spark task holding k GPUs runs one rank that has all k (MirroredStrategyRunner's
    worker), not k ranks of one each; ``dataframe``, a Spark DataFrame whose partition ``i`` the stage's task ``i``
    hands its ranks (TorchDistributor._train_on_dataframe);
    ``stall_tasks``, tasks whose agents never register (fault tests only). ``HorovodRunner._from_config`` runs one.
    """

    np: int
    driver_log_verbosity: str = "all"
    start_timeout: float | None = None  # None: $SPARKHVD_START_TIMEOUT, else 120
    log_dir: str | None = None
    network_interface: str | None = None
    max_restarts: int = 0
    min_np: int | None = None
    max_np: int | None = None
    commit_dir: str | None = None
    retry_on: tuple = ()  # the user's exception classes a run relaunches from its last commit, max_retries times
    max_retries: int | None = None  # None: 3 where retry_on names classes, else 0
    max_preemptions: int | None = None  # relaunches after Spark took back an executor of the run; None: no limit
    run_id: str | None = None  # names the run; with storage, a new driver with it resumes from its commits
    storage: str | None = None  # None: $SPARKHVD_STORAGE where run_id is given
    keep_commits: int = 0  # with storage: the newest commits of each state a successful run leaves there
    keep_best: tuple | None = None  # with storage: (field, "min" or "max"): each state's best commit is kept too
    layout: str = field(default="torchrun", kw_only=True)
    use_gpu: bool = field(default=True, kw_only=True)
    warn_unencrypted: bool = field(default=True, kw_only=True)
    one_rank_per_task: bool = field(default=False, kw_only=True)
    dataframe: object = field(default=None, kw_only=True, compare=False, repr=False)
    stall_tasks: frozenset = field(default=frozenset(), kw_only=True, repr=False)

    def __post_init__(self):
        self._check_np()
        if self.driver_log_verbosity not in VERBOSITIES:
            raise ValueError(f"driver_log_verbosity={self.driver_log_verbosity!r} is not one of "
                             f"{', '.join(map(repr, VERBOSITIES))}.")
        if self.start_timeout is None:
            self.start_timeout = settings.START_TIMEOUT.get()
        if not self.start_timeout > 0:
            raise ValueError(f"start_timeout={self.start_timeout!r} must be a positive number of seconds.")
        self._check_network_interface()
        self._check_elastic()
        self._check_retries()
        self._check_storage()
        if self.commit_dir is not None:
            check_commit_dir(self.commit_dir)
        self._check_drop_in_fields()

    def _check_retries(self) -> None:
        """retry_on, max_retries and max_preemptions."""
        classes = (self.retry_on,) if isinstance(self.retry_on, type) else self.retry_on
        if not isinstance(classes, (tuple, list)) or not all(isinstance(c, type) and issubclass(c, Exception)
                                                             for c in classes):
            raise ValueError(f"retry_on={self.retry_on!r} must be an exception class or a tuple of them, such as "
                             "retry_on=(OSError, TimeoutError): the exceptions a rank may raise that relaunch the run "
                             "from its last commit.")
        self.retry_on = tuple(classes)
        if self.max_retries is None:
            self.max_retries = DEFAULT_RETRIES if self.retry_on else 0
        if not _whole(self.max_retries) or self.max_retries < 0:
            raise ValueError(f"max_retries={self.max_retries!r} must be a whole number >= 0: how many times a rank's "
                             "exception of retry_on relaunches the run from its last commit.")
        if self.max_preemptions is not None and (not _whole(self.max_preemptions) or self.max_preemptions < 0):
            raise ValueError(f"max_preemptions={self.max_preemptions!r} must be a whole number >= 0 or None (no "
                             "limit): how many times a run relaunches its ranks after Spark decommissioned an "
                             "executor of theirs.")
        if self.max_retries and not self.retry_on:
            raise ValueError(f"max_retries={self.max_retries} retries the exceptions named by retry_on, and retry_on "
                             "is empty; pass retry_on=(OSError, ...) too, or leave max_retries unset.")

    def _check_storage(self) -> None:
        """run_id, storage and keep_commits."""
        if self.run_id is not None:
            check_run_id(self.run_id)
        if self.storage is None and self.run_id is not None:
            self.storage = settings.STORAGE.get()
        if self.storage is not None:
            if self.run_id is None:
                raise ValueError(f"storage={self.storage!r} keeps a run's commits under its run_id, so that a new "
                                 "driver resumes them; pass run_id='...' too.")
            if self.commit_dir is not None:
                raise ValueError(f"storage={self.storage!r} and commit_dir={self.commit_dir!r} both say where commits "
                                 "go; storage= also keeps them for the next driver: pass only storage=.")
            check_commit_dir(self.storage, "storage")
        if not _whole(self.keep_commits) or self.keep_commits < 0:
            raise ValueError(f"keep_commits={self.keep_commits!r} must be a whole number >= 0: how many of each "
                             "state's newest commits a run that ends well leaves in its storage.")
        best = self.keep_best
        if best is not None:
            if not (isinstance(best, (tuple, list)) and len(best) == 2 and isinstance(best[0], str) and best[0]
                    and best[1] in ("min", "max")):
                raise ValueError(f"keep_best={best!r} must be (field, 'min') or (field, 'max'), such as "
                                 "keep_best=('val_loss', 'min'): the plain field of the elastic state whose best commit "
                                 "the run keeps.")
            self.keep_best = tuple(best)
            if self.storage is None:
                raise ValueError(f"keep_best={best!r} keeps commits in the run's storage, and there is none; pass "
                                 "run_id= and storage= (or set SPARKHVD_STORAGE) too.")
        if self.keep_commits and self.storage is None:
            raise ValueError(f"keep_commits={self.keep_commits} keeps commits in the run's storage, and there is "
                             "none; pass run_id= and storage= (or set SPARKHVD_STORAGE) too.")

    def retry_names(self) -> tuple:
        """``module.qualname`` of each ``retry_on`` class: what the driver matches a rank's exception by."""
        return tuple(f"{c.__module__}.{c.__qualname__}" for c in self.retry_on)

    def _check_drop_in_fields(self) -> None:
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout={self.layout!r} is not one of {', '.join(map(repr, LAYOUTS))}.")
        for name in ("use_gpu", "warn_unencrypted", "one_rank_per_task"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} must be True or False.")
        tasks = self.stall_tasks
        if not isinstance(tasks, frozenset) or not all(_whole(t) and 0 <= t < abs(self.np) for t in tasks):
            raise ValueError(f"stall_tasks={tasks!r} must be a frozenset of task indices from 0 to {abs(self.np) - 1} "
                             f"(np={self.np}): the tasks whose agents never register.")

    def _check_np(self) -> None:
        if isinstance(self.np, bool) or not isinstance(self.np, numbers.Integral):
            raise ValueError(f"np must be a non-zero integer, got {self.np!r} ({type(self.np).__name__}); "
                             "use np=2 for 2 Spark tasks or np=-1 for one process on the driver.")
        self.np = int(self.np)
        if self.np == 0:
            raise ValueError("np=0 runs nothing; use np>0 for that many Spark tasks (one per GPU), "
                             "or np<0 for -np processes on the driver (np=-1 to debug).")

    def _check_network_interface(self) -> None:
        name = self.network_interface
        if name is not None and (not isinstance(name, str) or not name.strip() or any(c in name for c in ", \t")):
            raise ValueError(f"network_interface={name!r} must be the name of one network "
                             "interface, such as 'eth0', present on every host that runs a rank; leave it unset to "
                             "use the interface that routes to the driver.")

    def _check_elastic(self) -> None:
        """max_restarts, min_np and max_np."""
        if not _whole(self.max_restarts) or self.max_restarts < 0:
            raise ValueError(f"max_restarts={self.max_restarts!r} must be a whole number >= 0: how many times an "
                             "infrastructure failure (a lost rank, executor or host) restarts the run from its last "
                             "commit.")
        if self.min_np is not None and (not _whole(self.min_np) or not 1 <= self.min_np <= abs(self.np)):
            raise ValueError(f"min_np={self.min_np!r} must be a whole number from 1 to {abs(self.np)} (np={self.np}): "
                             "the fewest ranks a restart may go on with when Spark cannot give all np slots back.")
        if self.max_np is not None:
            if self.np < 0:
                raise ValueError(f"max_np={self.max_np!r} grows a Spark run when its cluster has free task slots; np="
                                 f"{self.np} runs a fixed {-self.np} process{'es' if self.np < -1 else ''} on the driver: "
                                 "leave max_np unset, or use np>0.")
            if not _whole(self.max_np) or self.max_np < self.np:
                raise ValueError(f"max_np={self.max_np!r} must be a whole number >= np={self.np}: the most ranks the "
                                 "run grows to at a commit when Spark has free task slots.")


def _whole(value) -> bool:
    """An integer, and not a bool."""
    return not isinstance(value, bool) and isinstance(value, numbers.Integral)
