"""Databricks' ``sparkdl.HorovodRunner`` and ``sparkdl.horovod.log_to_driver``, run by sparkhvd.

After ``import sparkhvd.migrate``, ``from sparkdl import HorovodRunner`` gets this module's
``HorovodRunner`` (runner/_rank/aliases.py), so a notebook written for Databricks runs as it is. It is
a thin layer over ``sparkhvd.HorovodRunner``: the same launch, logs, errors and restarts.
"""

from __future__ import annotations

import numbers
import warnings

from .._horovod_runner import HorovodRunner as _Runner
from .._rank.log import log_to_driver
from .._service.logs import VERBOSITIES

__all__ = ["HorovodRunner", "log_to_driver"]


class HorovodRunner:
    """``sparkdl.HorovodRunner(*, np, driver_log_verbosity="log_callback_only")``, with Databricks' meaning.

    ``np > 0``: ``np`` Spark barrier tasks, one per task slot (a GPU where the cluster has them).
    ``np < 0``: ``-np`` processes on the driver; their stdout and stderr always go to the cell output,
    as on Databricks. ``np = 0``: one rank per task slot of the active SparkContext, counted when
    ``run`` starts (Databricks deprecated it; a ``FutureWarning`` says how many).

    ``driver_log_verbosity`` (``np > 0``): ``"all"`` prints every rank's output on the driver;
    ``"log_callback_only"`` (the default) only what ranks send with ``sparkdl.horovod.log_to_driver``
    (or ``LogCallback``). Either way each rank's whole output is kept in its log file.
    """

    def __init__(self, *, np, driver_log_verbosity: str = "log_callback_only"):
        if driver_log_verbosity not in VERBOSITIES:
            raise ValueError(f"driver_log_verbosity={driver_log_verbosity!r} is not one of sparkdl's "
                             f"{', '.join(map(repr, VERBOSITIES))}; pass 'all' to see every rank's output on the "
                             "driver.")
        self.num_processor = np
        self.driver_log_verbosity = driver_log_verbosity
        every_slot = isinstance(np, numbers.Integral) and not isinstance(np, bool) and np == 0
        self._runner = None if every_slot else self._runner_for(np)  # checks np now, as sparkhvd's does

    def _runner_for(self, np: int) -> _Runner:
        driver_only = isinstance(np, numbers.Real) and np < 0  # Databricks shows these ranks' output in the cell
        verbosity = "all" if driver_only else self.driver_log_verbosity
        return _Runner(np, driver_log_verbosity=verbosity)

    def run(self, main, **kwargs):
        """Run ``main(**kwargs)`` on every rank (cloudpickled, as on Databricks); return rank 0's value."""
        runner = self._runner or self._runner_for(_every_task_slot())
        return runner.run(main, **kwargs)


def _every_task_slot() -> int:
    """``np=0``: the active SparkContext's task slots, now."""
    from pyspark import SparkContext

    from .._backends.spark import task_slots

    sc = SparkContext._active_spark_context
    if sc is None:
        raise ValueError("HorovodRunner(np=0) runs one rank per task slot of the active SparkContext, and there is "
                         "none; start a SparkSession first, or pass np=N (np=-N for N processes on the driver).")
    slots = task_slots(sc)
    warnings.warn(f"HorovodRunner(np=0) is deprecated (by Databricks too): it runs np={slots}, every task slot "
                  f"{sc.master} has now; pass np={slots} to say so.", FutureWarning, stacklevel=3)
    return slots
