"""A rank's output on its way to the driver: its stdout and stderr, split into lines and sent in LOG frames.

``forward_output`` runs in a thread of the agent per pipe; ``_Lines`` is its pure part, which splits bytes
into lines as a terminal shows them (a tqdm bar rewritten with ``\\r`` is one line, and its current state
goes along as the frame's ``progress``).
"""

from __future__ import annotations

import os
import select
import time

from ..._common.client import ServiceClient
from ..._common.driver_messages import Log
from ..._common.protocol import FLUSH_CHARS, MAX_LINE_BYTES, MAX_PROGRESS_CHARS

READ_BYTES = 64 * 1024  # a pipe's default capacity: one read takes all there is
# A LOG frame goes when this many characters of lines are pending, or this long after the oldest
# was read. Its JSON (at most 6 bytes a character, 12 for a pair of surrogates, plus a progress
# state of at most MAX_PROGRESS_CHARS) stays well under the protocol's MAX_META_BYTES.
FLUSH_S = 0.05
PROGRESS_S = 0.25  # a progress bar's state goes to the driver at most this often (4 a second)


class _Lines:
    """Splits a stream's bytes into lines as a terminal shows them (the pure part of ``forward_output``).

    A line rewritten with ``\\r`` (a tqdm bar) counts once, as its final state: the text after its
    last ``\\r``. While such a line is unfinished, ``progress()`` is its current state; only that
    state is held, so a bar updated forever costs no memory. Lines longer than ``MAX_LINE_BYTES``
    come out in pieces of that size.
    """

    def __init__(self):
        self._partial = b""  # the unfinished line
        self._live = False  # whether it has been rewritten with \r

    def feed(self, data: bytes) -> list:
        buf = self._partial + data
        end = buf.rfind(b"\n")
        lines = []
        if end >= 0:
            for raw in buf[:end].split(b"\n"):
                lines.extend(_pieces(_final(raw) if b"\r" in raw else raw))
            buf = buf[end + 1:]
            self._live = False
        if b"\r" in buf:
            self._live = True
            cut = buf.rstrip(b"\r").rfind(b"\r")
            buf = buf[cut + 1:]  # the current state, and a trailing \r that the next write overwrites
        while len(buf) > MAX_LINE_BYTES:
            lines.append(buf[:MAX_LINE_BYTES].decode("utf-8", errors="replace"))
            buf = buf[MAX_LINE_BYTES:]
        self._partial = buf
        return lines

    def progress(self) -> str | None:
        """The unfinished line's state if it is a bar (rewritten with ``\\r``), else None."""
        if not self._live:
            return None
        state = self._partial.rstrip(b"\r")[:MAX_PROGRESS_CHARS].decode("utf-8", errors="replace")
        return state or None

    def end(self) -> list:
        """The unfinished line, at the end of the stream."""
        lines = _pieces(_final(self._partial)) if self._partial else []
        self._partial, self._live = b"", False
        return lines


def _final(raw: bytes) -> bytes:
    """What a terminal leaves of a line rewritten with \\r: the text after the last one (before
    any trailing \\r, as in a Windows line end)."""
    raw = raw.rstrip(b"\r")
    return raw[raw.rfind(b"\r") + 1:]


def _pieces(raw: bytes) -> list:
    return [raw[i:i + MAX_LINE_BYTES].decode("utf-8", errors="replace")
            for i in range(0, max(len(raw), 1), MAX_LINE_BYTES)]


def forward_output(client: ServiceClient, rank: int, stream: str, pipe) -> None:
    """Forward a pipe's output to the driver as it comes, in batches: a LOG frame when
    ``FLUSH_CHARS`` are pending or ``FLUSH_S`` after the oldest pending line, and at the end. An
    unfinished ``\\r``-rewritten line goes along as the frame's ``progress``, at most every
    ``PROGRESS_S``."""
    fd = pipe.fileno()
    poller = select.poll()  # not select.select: an executor's descriptors may pass FD_SETSIZE
    poller.register(fd, select.POLLIN)
    out = _Batches(client, rank, stream)
    with pipe:
        while True:
            wait = out.wait_s()
            if poller.poll(None if wait is None else wait * 1000):
                data = os.read(fd, READ_BYTES)
                if not data:
                    break
                out.feed(data)
            out.send_due()
        out.end()


class _Batches:
    """One pipe's lines on their way to the driver: the batch not yet sent and the progress state last sent."""

    def __init__(self, client: ServiceClient, rank: int, stream: str):
        self.client, self.rank, self.stream = client, rank, stream
        self.lines = _Lines()
        self.batch: list = []
        self.pending = 0  # characters in batch
        self.oldest = 0.0  # when batch's first line was read
        self.shown: str | None = None  # the progress state last sent
        self.shown_at = -PROGRESS_S
        self.forward = True  # False once the driver has gone or refused: the pipe is still drained

    def wait_s(self) -> float | None:
        """How long to wait for more output before a frame is due; None: until there is some."""
        state = self.lines.progress()
        due = [self.oldest + FLUSH_S] if self.batch else []
        if state is not None and state != self.shown:
            due.append(self.shown_at + PROGRESS_S)
        return None if not due else max(0.0, min(due) - time.monotonic())

    def feed(self, data: bytes) -> None:
        for line in self.lines.feed(data):
            if self.pending + len(line) > FLUSH_CHARS:
                self.send(None)
            if not self.batch:
                self.oldest = time.monotonic()
            self.batch.append(line)
            self.pending += len(line) + 1

    def send_due(self) -> None:
        """Send the batch if it is full or old enough, or a changed progress state if the last is old enough."""
        now = time.monotonic()
        state = self.lines.progress()
        bar = state if state is not None and state != self.shown and now >= self.shown_at + PROGRESS_S else None
        if bar is not None or (self.batch and (self.pending >= FLUSH_CHARS or now >= self.oldest + FLUSH_S)):
            self.send(bar)

    def end(self) -> None:
        self.batch.extend(self.lines.end())
        self.send(None)

    def send(self, progress: str | None) -> None:
        if self.forward and (self.batch or progress is not None):
            try:
                self.client.tell(Log(rank=self.rank, stream=self.stream, lines=self.batch, progress=progress))
            except Exception:  # noqa: BLE001 - the driver has gone or refused: stop forwarding, not draining
                self.forward = False
        if self.batch:
            self.shown = None  # these lines may have finished the bar last shown
        if progress is not None:
            self.shown, self.shown_at = progress, time.monotonic()
        self.batch, self.pending = [], 0
