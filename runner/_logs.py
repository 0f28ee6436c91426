"""Where the ranks' output goes on the driver: live to stdout, and a file per rank."""

from __future__ import annotations

import collections
import os
import sys
import threading

VERBOSITIES = ("all", "log_callback_only")


class LogRouter:
    """Receives log lines from the driver service.

    With ``verbosity="all"`` every line of every rank is printed as ``[rank] line``; with
    ``"log_callback_only"`` only what ranks send through ``log_to_driver`` is. Every line is
    also written to ``<log_dir>/rank-<rank>.log``, and the last lines of each rank are kept
    for error messages.
    """

    def __init__(self, log_dir: str, verbosity: str, out=None, tail_lines: int = 20):
        self.log_dir = log_dir
        self.verbosity = verbosity
        self._out = out
        self._files: dict[int, object] = {}
        self._tails: dict[int, collections.deque] = {}
        self._tail_lines = tail_lines
        self._lock = threading.Lock()
        self._closed = False

    def path(self, rank: int) -> str:
        return os.path.join(self.log_dir, f"rank-{rank}.log")

    def __call__(self, rank: int, stream: str, lines: list) -> None:
        out = self._out or sys.stdout
        with self._lock:
            if self._closed:
                return  # a frame that arrived after the run ended
            f = self._files.get(rank)
            if f is None:
                f = self._files[rank] = open(self.path(rank), "a", encoding="utf-8", buffering=1)
                self._tails[rank] = collections.deque(maxlen=self._tail_lines)
            for line in lines:
                f.write(f"{line}\n")
                self._tails[rank].append(line)
                if self.verbosity == "all" or stream == "driver":
                    out.write(f"[{rank}] {line}\n")
            out.flush()

    def note(self, line: str) -> None:
        """Write ``line`` into every rank's log file (where one run's restarts begin)."""
        with self._lock:
            for f in self._files.values():
                f.write(f"{line}\n")

    def tail(self, rank: int) -> list:
        with self._lock:
            return list(self._tails.get(rank, ()))

    def paths(self) -> dict:
        with self._lock:
            return {rank: self.path(rank) for rank in sorted(self._files)}

    def close(self) -> None:
        with self._lock:
            self._closed = True
            for f in self._files.values():
                f.close()
            self._files.clear()
