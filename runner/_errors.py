"""The exception a failed run raises on the driver."""

from __future__ import annotations


class HorovodRunError(RuntimeError):
    """A run failed: a rank raised, a rank died, a start timed out, or the launch failed.

    ``failures`` lists ``(rank, type name, message, traceback text)`` for each rank that raised,
    first failure first; ``log_dir`` holds each rank's full output (``rank-<r>.log``). Where the
    first failing rank's exception could be rebuilt on the driver it is ``__cause__``.
    """

    def __init__(self, message: str, *, failures=(), log_dir: str | None = None, run_id: str = ""):
        super().__init__(message)
        self.failures = list(failures)
        self.log_dir = log_dir
        self.run_id = run_id


class StartTimeoutError(HorovodRunError):
    """Some ranks did not register within ``start_timeout``."""


for _cls in (HorovodRunError, StartTimeoutError):
    _cls.__module__ = "sparkhvd.runner"  # tracebacks name the public path
