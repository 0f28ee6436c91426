"""What the ranks report to the driver service: their output's lines, results, errors, exits and
heartbeats.

Part of ``DriverService`` (``_service/service.py``), whose state and lock these handlers use.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

from ..._common.driver_messages import (
    Clock,
    ClockReading,
    Error,
    Exit,
    Log,
    Progress,
    Refusal,
    Result,
    Timeline,
    encode,
)
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
    """LOG, RESULT, ERROR, PROGRESS, TIMELINE and EXIT. Uses ``DriverService``'s ``cv``, ``results``, ``failures``,
    ``exits``, ``progress``, ``attempt``, ``_on_log``, ``_on_metrics`` and ``_on_timeline``."""

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

    def _clock(self, channel: AuthenticatedChannel, message: Clock, blob: bytes, peer: str) -> None:
        channel.send(Kind.OK, encode(ClockReading(int(time.time() * 1e6))))

    def _timeline(self, channel: AuthenticatedChannel, message: Timeline, blob: bytes, peer: str) -> None:
        """A rank's timeline traces (JSON, never unpickled), with its clock's offset from this one's."""
        try:
            segments = json.loads(blob)
        except ValueError as exc:
            channel.send(Kind.ERR, encode(Refusal(f"rank {message.rank}'s timeline is not JSON ({exc}), so the run's "
                                                  "merged timeline goes without it; please report it with the run's "
                                                  "logs.")))
            return
        if isinstance(segments, list):
            with self.cv:  # where the rank ran, to name its process in the merged trace
                tasks = {p.rank: task for task, p in enumerate(self.placements or ())}
                reg = self.registrations.get(tasks.get(message.rank))
            self._on_timeline(message.rank, self.attempt, segments, message.offset_us,
                              None if reg is None else reg.host, () if reg is None else tuple(reg.gpus or ()),
                              error_us=message.error_us)
        channel.send(Kind.OK)

    def _exit(self, channel: AuthenticatedChannel, exit: Exit, blob: bytes, peer: str) -> None:
        with self.cv:
            self.exits[exit.rank] = exit.code
            self.cv.notify_all()
        channel.send(Kind.OK)
