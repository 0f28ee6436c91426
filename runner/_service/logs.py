"""Where the ranks' output goes on the driver: live to stdout, a file per rank, and which
runs' log folders are kept.

A run without ``log_dir=`` writes into a folder of its own under the log root
(``$SPARKHVD_LOG_ROOT``, default ``<tempdir>/sparkhvd-logs-<user>``, made with mode 0o700).
At the end of each run its folder is marked successful or failed; of the successful runs' folders
the newest ``$SPARKHVD_KEEP_LOGS`` (default 5) are kept, of the failed runs' the newest
``$SPARKHVD_KEEP_FAILED_LOGS`` (default 20), and older ones are removed (0 keeps none). Folders of
runs still going (or whose driver died) carry no mark and are kept. A folder given as
``log_dir=`` is never touched.
"""

from __future__ import annotations

import collections
import getpass
import logging
import os
import shutil
import sys
import tempfile
import threading
import time

from ..._common import settings
from ..._common.protocol import FILE_ONLY
from .notices import notice

VERBOSITIES = ("all", "log_callback_only")
SUCCEEDED = ".succeeded"  # marks a finished, successful run's folder
FAILED = ".failed"  # marks a finished, failed run's folder; only folders with one of these marks are ever removed

log = logging.getLogger("sparkhvd.logs")


class LogRouter:
    """Receives log lines from the driver service.

    With ``verbosity="all"`` every line of every rank is printed as ``[rank] line``; with
    ``"log_callback_only"`` only what ranks send through ``log_to_driver`` is. Every line is
    also written to ``<log_dir>/rank-<rank>.log``, and the last lines of each rank are kept
    for error messages. Each call writes its whole batch with one write and one flush.

    A stream's unfinished ``\\r``-rewritten line (a tqdm bar; ``progress`` in a LOG frame) is
    shown as one line rewritten in place, ``\\r[rank] text``, ended by a newline before any other
    line; it reaches the log file only as its final state, the stream's next line (or, if none
    ever comes, its last state at ``close``).
    """

    def __init__(self, log_dir: str, verbosity: str, out=None, tail_lines: int = 20):
        self.log_dir = log_dir
        self.verbosity = verbosity
        self._out = out
        self._files: dict[int, object] = {}
        self._tails: dict[int, collections.deque] = {}
        self._tail_lines = tail_lines
        self._bars: dict[tuple, str] = {}  # (rank, stream) -> its unfinished progress line's latest state
        self._open: tuple | None = None  # the (rank, stream) whose progress line the cursor is at the end of
        self._width = 0  # how many characters of that line's text are shown
        self._lock = threading.Lock()
        self._closed = False
        self._notices_shown: set = set()  # the start-up notices already shown in this run

    def path(self, rank: int) -> str:
        return os.path.join(self.log_dir, f"rank-{rank}.log")

    def __call__(self, rank: int, stream: str, lines: list, progress: str | None = None) -> None:
        out = self._out or sys.stdout
        key = (rank, stream)
        shown = self.verbosity == "all" or stream == "driver"
        parts = []
        with self._lock:
            if self._closed:
                return  # a frame that arrived after the run ended
            f = self._file(rank)
            if stream == FILE_ONLY:
                if lines:
                    _write(f, lines)
                return
            if lines:
                self._bars.pop(key, None)  # the first line is the bar's final state
                _write(f, lines)
                self._tails[rank].extend(lines[-self._tail_lines:])
                if shown:
                    parts += self._screen_lines(key, lines)
            if progress:
                self._bars[key] = progress
                if shown:
                    parts += self._screen_bar(key, progress)
            if parts:
                out.write("".join(parts))
                out.flush()

    def _file(self, rank: int):
        """The rank's log file, opened (and its tail started) at its first line; under the lock."""
        f = self._files.get(rank)
        if f is None:
            f = self._files[rank] = open(self._file_path(rank), "a", encoding="utf-8")
            self._tails[rank] = collections.deque(maxlen=self._tail_lines)
        return f

    def _file_path(self, rank: int) -> str:
        """Where the rank's log file is written: ``path(rank)`` (runner/_policy/hosted.py writes elsewhere)."""
        return self.path(rank)

    def _screen_lines(self, key: tuple, lines: list) -> list:
        """What the stream ``key`` = (rank, stream)'s new ``lines`` put on screen: the final state of its bar
        rewritten in place where the cursor is at the end of it, a newline ending another stream's bar, then a
        ``[rank] line`` per line shown; under the lock."""
        rank, stream = key
        parts = []
        rewrite = self._open == key  # the first line is the final state of the bar on screen
        visible = [line for line in lines[1 if rewrite else 0:] if self._shows(stream, line)]
        if rewrite:  # rewrite the bar in place with its final state
            parts.append(f"\r[{rank}] {_padded(lines[0], self._width)}\n")
            self._open = None
        elif visible and self._open is not None:
            parts.append("\n")
            self._open = None
        parts.extend(f"[{rank}] {line}\n" for line in visible)
        return parts

    def _screen_bar(self, key: tuple, progress: str) -> list:
        """What the stream ``key`` = (rank, stream)'s unfinished line ``progress`` puts on screen: the line
        rewritten in place, on a line of its own if another stream's bar is open; under the lock."""
        parts = []
        if self._open not in (None, key):
            parts.append("\n")  # another stream's bar stays on its own line
        width = self._width if self._open == key else 0
        parts.append(f"\r[{key[0]}] {_padded(progress, width)}")
        self._open, self._width = key, len(progress)
        return parts

    def _shows(self, stream: str, line: str) -> bool:
        """Whether ``line`` goes on screen: not a start-up notice (runner/_service/notices.py) already shown in this run."""
        if stream != "stderr":
            return True
        name = notice(line)
        if name is None:
            return True
        if name in self._notices_shown:
            return False
        self._notices_shown.add(name)
        return True

    def note(self, line: str) -> None:
        """Write ``line`` into every rank's log file (where one run's restarts begin)."""
        with self._lock:
            for f in self._files.values():
                f.write(f"{line}\n")
                f.flush()

    def tail(self, rank: int) -> list:
        with self._lock:
            return list(self._tails.get(rank, ()))

    def last_line(self, rank: int) -> str:
        """What the rank printed last: the state of a progress bar it is drawing, else its last line ("" before any)."""
        with self._lock:
            bars = [state for (r, _), state in self._bars.items() if r == rank]
            if bars:
                return bars[-1]
            tail = self._tails.get(rank)
            return tail[-1] if tail else ""

    def paths(self) -> dict:
        with self._lock:
            return {rank: self.path(rank) for rank in sorted(self._files)}

    def close(self) -> None:
        with self._lock:
            self._closed = True
            for (rank, _), state in self._bars.items():  # a bar whose process ended before its line did
                self._files[rank].write(f"{state}\n")
                self._tails[rank].append(state)
            self._bars.clear()
            if self._open is not None:
                out = self._out or sys.stdout
                out.write("\n")
                out.flush()
                self._open = None
            for f in self._files.values():
                f.close()
            self._files.clear()


def _write(f, lines: list) -> None:
    """Append ``lines`` to the log file ``f`` with one write, and flush it."""
    f.write("\n".join(lines) + "\n")
    f.flush()


def _padded(text: str, width: int) -> str:
    """``text``, with spaces over what is left of a ``width``-character line it rewrites."""
    return text + " " * (width - len(text))


# ---- which log folders are kept ------------------------------------------------------------


def keep_logs() -> int:
    """How many successful runs' log folders are kept: ``$SPARKHVD_KEEP_LOGS``, default 5."""
    return settings.KEEP_LOGS.get()


def keep_failed_logs() -> int:
    """How many failed runs' log folders are kept: ``$SPARKHVD_KEEP_FAILED_LOGS``, default 20."""
    return settings.KEEP_FAILED_LOGS.get()


def log_root() -> str:
    """The folder every run without ``log_dir=`` keeps its logs under (made if missing)."""
    root = settings.LOG_ROOT.get()
    if root:
        os.makedirs(root, mode=0o700, exist_ok=True)
        return root
    try:
        user = getpass.getuser()
    except (KeyError, OSError, ImportError):  # no passwd entry (some containers)
        user = str(os.getuid())
    root = os.path.join(tempfile.gettempdir(), f"sparkhvd-logs-{user}")
    os.makedirs(root, mode=0o700, exist_ok=True)
    # A shared temp dir: a folder or link another user put there must not receive our logs.
    info = os.lstat(root)
    what = ("a link" if os.path.islink(root)  # (a file there already failed makedirs, with its own clear error)
            else f"owned by uid {info.st_uid}, not by you ({os.getuid()})" if info.st_uid != os.getuid() else None)
    if what is not None:
        raise PermissionError(f"The sparkhvd log folder {root} is {what}; remove it, set {settings.LOG_ROOT.name} to "
                              "a folder of your own, or pass log_dir=.")
    return root


def run_log_dir(run_id: str, log_dir: str | None = None) -> str:
    """A run's log folder, at its start: ``log_dir`` as given (made if missing), or a new folder
    ``<log_root()>/<date>-<time>-<run_id>-*`` (mode 0o700)."""
    if log_dir:
        os.makedirs(log_dir, exist_ok=True)
        return log_dir
    keep_logs(), keep_failed_logs()  # a bad setting fails the run before it starts, not at its end
    return tempfile.mkdtemp(prefix=f"{time.strftime('%Y%m%d-%H%M%S')}-{run_id}-", dir=log_root())


def end_run_logs(log_dir: str, *, succeeded: bool, given: bool) -> list:
    """At a run's end: mark its folder successful or failed (unless ``given`` by the user), then remove all but
    the newest ``keep_logs()`` successful and the newest ``keep_failed_logs()`` failed folders under the log root.
    Folders of runs still going and anything else there are kept. Returns the folders removed; never raises (a
    run's outcome matters more than its old logs)."""
    if given:
        return []
    try:
        root = os.path.dirname(os.path.abspath(log_dir))
        with open(os.path.join(log_dir, SUCCEEDED if succeeded else FAILED), "w") as f:
            f.write(f"{time.time()}\n")
        removed = []
        for mark, keep in ((SUCCEEDED, keep_logs()), (FAILED, keep_failed_logs())):
            ended = []
            for name in os.listdir(root):
                try:
                    ended.append((os.stat(os.path.join(root, name, mark)).st_mtime_ns, name))
                except OSError:
                    continue  # not a folder of a run that ended this way
            ended.sort(reverse=True)
            for _, name in ended[keep:]:
                path = os.path.join(root, name)
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
        return removed
    except (OSError, ValueError) as exc:
        log.warning("sparkhvd: could not clean up old log folders next to %s (%s: %s); remove them by hand, or set "
                    "%s to a folder you can write.", log_dir, type(exc).__name__, exc, settings.LOG_ROOT.name)
        return []
