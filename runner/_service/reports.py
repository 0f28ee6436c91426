"""What the ranks report to the driver service: their output's lines, results, errors, exits and
heartbeats.

Part of ``DriverService`` (``_service/service.py``), whose state and lock these handlers use.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from ..._common.driver_messages import Error, Exit, Log, Progress, Result, encode
from ..._common.protocol import AuthenticatedChannel, Kind


@dataclass
class Failure:
    """A rank's exception, as its worker reported it."""

    rank: int
    type: str
    message: str
    traceback: str
    pickled: bytes = b""
    classes: tuple = ()  # module.qualname of its class and of each base (driver_messages.Error.classes)
    arrived: float = field(default_factory=time.monotonic)


class ReportHandlers:
    """LOG, RESULT, ERROR, PROGRESS and EXIT. Uses ``DriverService``'s ``cv``, ``results``, ``failures``, ``exits``,
    ``progress``, ``attempt``, ``_on_log`` and ``_on_metrics``."""

    def _log(self, channel: AuthenticatedChannel, log: Log, blob: bytes, peer: str) -> None:
        """Lines of a rank's output (one-way: never answered)."""
        self._on_log(log.rank, log.stream, log.lines, log.progress)

    def _result(self, channel: AuthenticatedChannel, result: Result, blob: bytes, peer: str) -> None:
        with self.cv:
            self.results[result.rank] = blob
            self.cv.notify_all()
        channel.send(Kind.OK)

    def _error(self, channel: AuthenticatedChannel, error: Error, blob: bytes, peer: str) -> None:
        with self.cv:
            self.failures.append(Failure(rank=error.rank, type=error.type, message=error.message,
                                         traceback=error.traceback, pickled=blob,
                                         classes=tuple(error.classes)))
            self.cv.notify_all()
        channel.send(Kind.OK)

    def _progress(self, channel: AuthenticatedChannel, beat: Progress, blob: bytes, peer: str) -> None:
        """A rank's heartbeat (one-way): kept as its meta for the stall report (``_policy/stall_report.py``)."""
        with self.cv:
            self.progress[beat.rank] = (encode(beat), time.monotonic())
        self._on_metrics(beat.rank, self.attempt, beat.metrics)

    def _exit(self, channel: AuthenticatedChannel, exit: Exit, blob: bytes, peer: str) -> None:
        with self.cv:
            self.exits[exit.rank] = exit.code
            self.cv.notify_all()
        channel.send(Kind.OK)
