"""Which backend runs a run: the one place the choice is made (torch elastic's rendezvous registry)."""

from __future__ import annotations

from . import connect, spark
from .api import Backend
from .local import LocalBackend

#: For np > 0, asked in turn: each module's ``backend_for(config)`` returns a Backend, or None where it does not
#: apply. A new backend is its module plus one line here.
SPARK_BACKENDS = (
    connect.backend_for,  # the user's Spark Connect session, where one is active
    spark.backend_for,  # the active SparkContext, else an embedded local[np] session: always answers
)


def backend_for(config) -> Backend:
    """The backend for a ``RunnerConfig``: processes on the driver for np < 0, else the first of SPARK_BACKENDS
    that applies."""
    if config.np < 0:
        return LocalBackend()
    for candidate in SPARK_BACKENDS:
        backend = candidate(config)
        if backend is not None:
            return backend
    raise RuntimeError(f"no backend can run np={config.np}: {', '.join(c.__module__ for c in SPARK_BACKENDS)} "
                       "each declined; the last entry of SPARK_BACKENDS (runner/_backends/registry.py) must always "
                       "answer, as spark.backend_for does.")
