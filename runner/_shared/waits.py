"""Waits on the driver: a start-up deadline that names its setting, and a note said once when a wait is long."""

from __future__ import annotations

import time


class Deadline:
    """One start-up deadline whose message names the setting to raise."""

    def __init__(self, seconds: float, setting: str, clock=time.monotonic):
        self.seconds = seconds
        self.setting = setting
        self._clock = clock
        self._end = clock() + seconds

    def expired(self) -> bool:
        return self._clock() >= self._end

    def message(self, what: str) -> str:
        return f"{what} within {self.seconds:g} s; raise {self.setting}"


WAIT_NOTE_S = 5.0  # a wait with no progress for this long is said once on the driver


class WaitNote:
    """Says once, on the driver, what a wait is waiting for, when it has seen no progress for ``WAIT_NOTE_S``."""

    def __init__(self, verbose: bool, clock=time.monotonic):
        self.verbose = verbose
        self.said = False
        self._clock = clock
        self._seen = object()
        self._since = clock()

    def progress(self, seen, text) -> None:
        """``seen``: what changes on progress (a count); ``text()``: the line to print, built only when due."""
        now = self._clock()
        if seen != self._seen:
            self._seen, self._since = seen, now
        elif self.verbose and not self.said and now - self._since >= WAIT_NOTE_S:
            self.said = True
            print(f"[sparkhvd] {text()}", flush=True)
