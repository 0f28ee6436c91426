"""The exception a failed run raises on the driver."""

from __future__ import annotations


class HorovodRunError(RuntimeError):
    """A run failed: a rank raised, a rank died, a start timed out, or the launch failed.

    ``failures`` lists ``(rank, type name, message, traceback text)`` for each rank that raised,
    first failure first; ``log_dir`` holds each rank's full output (``rank-<r>.log``). Where the
    first failing rank's exception could be rebuilt on the driver it is ``__cause__``.

    ``retryable``: the cause is the infrastructure's (a rank process killed, an executor or host
    lost, a peer gone silent, a stall), which ``HorovodRunner(max_restarts=)`` restarts from the last
    commit; a user's exception is not, unless it is one of ``HorovodRunner(retry_on=)``'s classes: then
    ``retry_on`` names that class (``module.qualname``), and ``max_retries`` relaunches it. ``cause``: the
    headline's cause, one line. ``attempts``: after restarts, the error of every attempt in order, this one last.
    """

    retry_on: str | None = None

    def __init__(self, message: str, *, failures=(), log_dir: str | None = None, run_id: str = "",
                 retryable: bool = False, cause: str = ""):
        super().__init__(message)
        self.failures = list(failures)
        self.log_dir = log_dir
        self.run_id = run_id
        self.retryable = retryable
        self.cause = cause or message.split("\n", 1)[0].split(" failed: ", 1)[-1]
        self.attempts = [self]


class StartTimeoutError(HorovodRunError):
    """Some ranks did not register within ``start_timeout``."""


class RunIdInUse(RuntimeError):
    """Another driver runs this ``run_id`` now: it holds the run's lease in the storage."""


for _cls in (HorovodRunError, StartTimeoutError, RunIdInUse):
    _cls.__module__ = "sparkhvd.runner"  # tracebacks name the public path
