"""Launching training functions: ``HorovodRunner`` and what it returns or raises."""

from ._errors import HorovodRunError, StartTimeoutError
from ._java import JavaNotFoundError
from ._runner import HorovodRunner, RunResult, log_to_driver
from ._topology import Placement, assign_ranks

__all__ = [
    "HorovodRunner",
    "HorovodRunError",
    "JavaNotFoundError",
    "Placement",
    "RunResult",
    "StartTimeoutError",
    "assign_ranks",
    "log_to_driver",
]
