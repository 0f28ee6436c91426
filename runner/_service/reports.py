"""What the ranks report to the driver service: their output's lines, results, errors, exits and
heartbeats.

Part of ``DriverService`` (``_service/service.py``), whose state and lock these handlers use.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from ..._common.protocol import AuthenticatedChannel, Kind, Message, check_log_meta

log = logging.getLogger("sparkhvd.service")

BAD_LOGS_LOGGED = 5  # malformed LOG frames logged per run; the rest are counted in bad_logs


@dataclass
class Failure:
    """A rank's exception, as its worker reported it."""

    rank: int
    type: str
    message: str
    traceback: str
    pickled: bytes = b""
    arrived: float = field(default_factory=time.monotonic)


class ReportHandlers:
    """LOG, RESULT, ERROR, PROGRESS and EXIT. Uses ``DriverService``'s ``cv``, ``np``, ``results``,
    ``failures``, ``exits``, ``progress``, ``bad_logs`` and ``_on_log``."""

    def _log(self, channel: AuthenticatedChannel, msg: Message, peer: str) -> None:
        """Lines of a rank's output (one-way, so a malformed frame is logged and dropped, never answered:
        an answer would be read as the reply to that connection's next request)."""
        try:
            rank, stream, lines, progress = check_log_meta(msg.meta, self.np)
        except ValueError as exc:
            with self.cv:
                self.bad_logs += 1
                count = self.bad_logs
            if count <= BAD_LOGS_LOGGED:
                log.warning("sparkhvd driver service: refused a LOG frame from %s because %s; its lines are dropped "
                            "and the connection stays open. The task that sent it runs another sparkhvd version "
                            "than the driver: install the same version on the driver and the executors.%s", peer,
                            exc, " Further malformed LOG frames are counted, not logged." if count == BAD_LOGS_LOGGED
                            else "")
            return
        self._on_log(rank, stream, lines, progress)

    def _result(self, channel: AuthenticatedChannel, msg: Message, peer: str) -> None:
        with self.cv:
            self.results[int(msg.meta["rank"])] = msg.blob
            self.cv.notify_all()
        channel.send(Kind.OK)

    def _error(self, channel: AuthenticatedChannel, msg: Message, peer: str) -> None:
        meta = msg.meta
        with self.cv:
            self.failures.append(Failure(rank=int(meta["rank"]), type=str(meta.get("type")),
                                         message=str(meta.get("message")),
                                         traceback=str(meta.get("traceback", "")), pickled=msg.blob))
            self.cv.notify_all()
        channel.send(Kind.OK)

    def _progress(self, channel: AuthenticatedChannel, msg: Message, peer: str) -> None:
        """A rank's heartbeat (one-way): kept for the stall report, read by ``_policy/stall_report.py``."""
        rank = int(msg.meta["rank"])
        with self.cv:
            if 0 <= rank < self.np:
                self.progress[rank] = (msg.meta, time.monotonic())

    def _exit(self, channel: AuthenticatedChannel, msg: Message, peer: str) -> None:
        with self.cv:
            self.exits[int(msg.meta["rank"])] = int(msg.meta["code"])
            self.cv.notify_all()
        channel.send(Kind.OK)
