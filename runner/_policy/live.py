"""The live view of a run: what each rank does now, redrawn about once a second while the run goes on.

- **In a notebook** (an IPython kernel): one output area, an IPython display handle updated in place, holds a
  table with a row per rank: its host, steps/s, the share of its time in collectives and in waiting for
  sparkhvd's readers, its GPU's use and memory (NVML), and its last line of output. The same table as text goes
  with it, for a frontend that shows no HTML.
- **In a terminal**: one status line at the bottom, rewritten in place: the ranks' steps/s (the slowest rank
  named), the shares and the GPUs' use. Every other line the driver prints goes above it: while the line shows,
  ``sys.stdout`` and ``sys.stderr`` clear it before each write and draw it again at the next flush. A rank's
  progress bar (tqdm) hides it until the bar's line ends.

There is no view under ``driver_log_verbosity="log_callback_only"``, where the driver's output is neither a
notebook nor a terminal, or with ``SPARKHVD_LIVE_VIEW=off``. The figures come from the ranks' heartbeats'
metrics (``_common/metrics.py``), over the last ``WINDOW_S``; while a view is on, the ranks beat every
``HEARTBEAT_S`` unless ``SPARKHVD_HEARTBEAT_SECONDS`` says otherwise.
"""

from __future__ import annotations

import html
import shutil
import sys
import threading
import time
import warnings

from ..._common import settings
from .._service.metrics import Beats, change, steps_source

REDRAW_S = 1.0  # how often the view is drawn again
WINDOW_S = 3.0  # the rates are over about the last this many seconds of each rank's heartbeats
HEARTBEAT_S = 1.0  # the ranks' heartbeat while a view is on (unless SPARKHVD_HEARTBEAT_SECONDS is set)
LINE_CHARS = 80  # of a rank's last line, in the notebook's table
COLUMNS = ("rank", "host", "steps", "steps/s", "collectives", "data wait", "GPU", "last line")
_NUMBERS = range(2, 7)  # the columns aligned right
CLEAR = "\r\x1b[K"  # the cursor to the line's start, and the line erased


def live_view(run_id: str, verbosity: str, logs, *, out=None):
    """The run's view where its output has one (a ``NotebookView`` or a ``TerminalView``), else None."""
    if settings.LIVE_VIEW.get() == "off" or verbosity != "all":
        return None
    if _in_notebook():
        return NotebookView(run_id, logs)
    stream = out or sys.stdout
    if _isatty(stream):
        return TerminalView(run_id, logs, stream)
    return None


def _in_notebook() -> bool:
    ipython = sys.modules.get("IPython")  # a kernel has imported it; nothing else needs to
    shell = ipython.get_ipython() if ipython is not None and hasattr(ipython, "get_ipython") else None
    return shell is not None and getattr(shell, "kernel", None) is not None


def _isatty(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


class Rates:
    """Each rank's rates over about the last ``WINDOW_S`` of its heartbeats, from ``RunStatus.progress``."""

    def __init__(self, window: float = WINDOW_S):
        self.window = window
        self.beats = Beats(keep=window)
        self._first: dict = {}  # rank -> the beat before its first step: the whole run's rates (``of(whole=True)``)

    def update(self, status) -> None:
        self.beats.update(status.progress)  # at most one new beat per rank: a poll holds each rank's latest
        for rank, history in self.beats.by_rank.items():
            if rank not in self._first and history[-1][1].get(steps_source(history[-1][1])):
                self._first[rank] = history[-2] if len(history) > 1 else history[-1]

    def restart(self) -> None:
        """A new attempt: its ranks' clocks and totals start again."""
        self.beats.clear()
        self._first.clear()

    def of(self, rank: int, whole: bool = False) -> dict:
        """``steps``, ``steps_per_s``, ``collectives`` and ``data_wait`` (shares of the rank's time) and ``gpu`` (its
        latest NVML reading), each None where not known yet; over the last window, or (``whole``) since the beat
        before the rank's first step."""
        history = self.beats.by_rank.get(rank) or []
        last = history[-1][1] if history else {}
        source = steps_source(last)
        rates = {"steps": last.get(source) or 0 if last else None, "steps_per_s": None,
                 "collectives": None, "data_wait": None, "gpu": last.get("gpu")}
        if whole and rank in self._first and history and self._first[rank][0] < history[-1][0]:
            span = self._first[rank], history[-1]
        else:
            span = self.beats.span(rank, self.window)
        if span is None:
            return rates
        (t0, first), (t1, last) = span
        elapsed = t1 - t0
        rates["steps_per_s"] = max(0.0, change(first, last, source)) / elapsed
        rates["collectives"] = min(1.0, max(0.0, change(first, last, "negotiation_s", "transfer_s") / elapsed))
        rates["data_wait"] = min(1.0, max(0.0, change(first, last, "data_wait_s") / elapsed))
        return rates


class LiveView:
    """What both views share: ``check(status)`` on each poll of a running attempt draws the view at most once per
    ``REDRAW_S``; ``close(ok)`` draws its final state."""

    def __init__(self, run_id: str, logs, clock=time.monotonic):
        self.run_id, self.logs, self.clock = run_id, logs, clock
        self.started = clock()
        self.rates = Rates()
        self.drawn_at: float | None = None
        self.attempt: int | None = None
        self._rows: list = []
        self._status = None

    def check(self, status, attempt: int = 0) -> None:
        if attempt != self.attempt:
            self.attempt = attempt
            self.rates.restart()
        self.rates.update(status)
        self._status = status
        now = self.clock()
        if self.drawn_at is not None and now - self.drawn_at < REDRAW_S:
            return
        self.drawn_at = now
        self._rows = self.rows(status)
        self.draw(self._rows, ending=None)

    def rows(self, status, whole: bool = False) -> list:
        """A row per rank: ``rank``, ``host``, the rates (``Rates.of``) and its ``line``, the last it printed."""
        registrations = status.by_rank()
        rows = []
        for rank in sorted(registrations):
            reg = registrations[rank]
            rows.append({"rank": rank, "host": reg.host, "gpus": tuple(reg.gpus or ()), **self.rates.of(rank, whole),
                         "line": self.logs.last_line(rank)})
        return rows

    def close(self, ok: bool) -> None:
        """The run ended (``ok``: it returned): the view's last state. A failure here is a warning, never the run's."""
        try:
            if self._status is not None:  # the rates of the whole attempt, not of its last seconds
                self._rows = self.rows(self._status, whole=True)
            self.draw(self._rows, ending="finished" if ok else "failed")
        except Exception as exc:  # noqa: BLE001 - the run's own outcome (or error) goes on
            warnings.warn(f"sparkhvd run {self.run_id}: the live view failed to draw its last state "
                          f"({type(exc).__name__}: {exc}); please report it with the run's logs.", RuntimeWarning,
                          stacklevel=2)

    def elapsed(self) -> str:
        return f"{self.clock() - self.started:.0f} s"

    def draw(self, rows: list, ending: str | None) -> None:
        raise NotImplementedError


def cells(row: dict) -> list:
    """A row's columns (``COLUMNS``) as text."""
    gpu = row.get("gpu") or {}
    if gpu:
        memory = gpu.get("memory_bytes")
        gpu_text = f"{gpu.get('util_pct', '?')}%" + (f" {memory / 2**30:.1f} GiB" if memory is not None else "")
    else:
        gpu_text = ",".join(str(g) for g in row.get("gpus") or ()) or "-"
    steps = row.get("steps")
    return [str(row["rank"]), str(row["host"]), "-" if steps is None else str(steps), _number(row.get("steps_per_s")),
            _share(row.get("collectives")), _share(row.get("data_wait")), gpu_text, row.get("line") or ""]


def _number(value) -> str:
    return "-" if value is None else f"{value:.1f}"


def _share(value) -> str:
    return "-" if value is None else f"{value:.0%}"


class NotebookView(LiveView):
    """The table in one output area of the cell: an IPython display handle, updated in place."""

    def __init__(self, run_id: str, logs, clock=time.monotonic):
        super().__init__(run_id, logs, clock)
        self._handle = None

    def title(self, rows: list, ending: str | None) -> str:
        state = ending or "running"
        attempt = f", attempt {self.attempt + 1}" if self.attempt else ""
        return f"sparkhvd run {self.run_id}: {_ranks(len(rows))}, {state}{attempt}, {self.elapsed()}"

    def text(self, rows: list, ending: str | None) -> str:
        table = [list(COLUMNS)] + [cells(row) for row in rows]
        for row in table:
            row[-1] = row[-1][:LINE_CHARS]
        widths = [max(len(row[i]) for row in table) for i in range(len(COLUMNS) - 1)]
        lines = ["  ".join(c.rjust(w) if i in _NUMBERS else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths)))
                 + "  " + row[-1] for row in table]
        return "\n".join([self.title(rows, ending)] + [line.rstrip() for line in lines])

    def html(self, rows: list, ending: str | None) -> str:
        def style(i: int) -> str:  # inline: a notebook's sanitizer may drop a <style> block
            return f'style="padding:0 0.7em;text-align:{"right" if i in _NUMBERS else "left"}"'

        head = "".join(f"<th {style(i)}>{html.escape(c)}</th>" for i, c in enumerate(COLUMNS))
        body = "".join("<tr>" + "".join(f"<td {style(i)}>{html.escape(c[:LINE_CHARS] if i == len(COLUMNS) - 1 else c)}"
                                        "</td>" for i, c in enumerate(cells(row))) + "</tr>" for row in rows)
        return (f'<div class="sparkhvd-live" style="font-family:monospace;font-size:0.9em">'
                f"<b>{html.escape(self.title(rows, ending))}</b>"
                f'<table style="border-collapse:collapse"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'
                "</div>")

    def draw(self, rows: list, ending: str | None) -> None:
        if not rows and self._handle is None:
            return  # no rank has its place yet: nothing to show
        bundle = {"text/plain": self.text(rows, ending), "text/html": self.html(rows, ending)}
        from IPython.display import display

        if self._handle is None:
            self._handle = display(bundle, raw=True, display_id=True)
        else:
            self._handle.update(bundle, raw=True)


class TerminalView(LiveView):
    """One status line at the bottom of the terminal (``LiveStreams``)."""

    def __init__(self, run_id: str, logs, out, clock=time.monotonic):
        super().__init__(run_id, logs, clock)
        self.streams = LiveStreams(out)

    def line(self, rows: list) -> str:
        rates = [r for r in rows if r.get("steps_per_s") is not None]
        steps = max((r.get("steps") or 0 for r in rows), default=0)
        parts = [f"[sparkhvd] run {self.run_id}: {_ranks(len(rows))} " + (f"at step {steps}" if steps else "starting")]
        if rates and steps:
            parts.append(f"{_mean(rates, 'steps_per_s'):.1f} steps/s")
            parts.append(f"{_mean(rates, 'collectives'):.0%} in collectives")
            parts.append(f"{_mean(rates, 'data_wait'):.0%} waiting for data")
        gpus = [r["gpu"]["util_pct"] for r in rows if isinstance(r.get("gpu"), dict) and "util_pct" in r["gpu"]]
        if gpus:
            parts.append(f"GPU {sum(gpus) / len(gpus):.0f}%")
        parts.append(self.elapsed())
        width = max(20, shutil.get_terminal_size((100, 24)).columns - 1)  # never wraps: a wrapped line is not erased
        return ", ".join(parts)[:width]

    def draw(self, rows: list, ending: str | None) -> None:
        if ending is not None:
            self.streams.stop()  # the run's own last line follows
        elif rows:
            self.streams.show(self.line(rows))


def _ranks(n: int) -> str:
    return f"{n} rank{'s' if n != 1 else ''}"


def _mean(rows: list, name: str) -> float:
    values = [r[name] for r in rows if r.get(name) is not None]
    return sum(values) / len(values) if values else 0.0


class LiveStreams:
    """While a status line shows: ``sys.stdout`` and ``sys.stderr`` are ``_Stream`` proxies that clear it before
    every write, and draw it again at a flush that leaves the cursor at a line's start."""

    def __init__(self, out):
        self.out = out
        self.lock = threading.RLock()
        self.line = ""
        self.shown = False
        self.at_start = True  # the cursor is at a line's start: the status line can be drawn there
        self._saved = None

    def show(self, line: str) -> None:
        with self.lock:
            if self._saved is None:
                self._saved = (sys.stdout, sys.stderr)
                sys.stdout = _Stream(self, sys.stdout)
                if _isatty(sys.stderr):
                    sys.stderr = _Stream(self, sys.stderr)
            self.line = line
            self.draw()

    def draw(self) -> None:
        if self.line and self.at_start:
            self.out.write(CLEAR + self.line)
            self.out.flush()
            self.shown = True

    def clear(self) -> None:
        if self.shown:
            self.out.write(CLEAR)
            self.out.flush()
            self.shown = False

    def stop(self) -> None:
        """The line erased, and the streams put back (where nobody replaced them since)."""
        with self.lock:
            self.clear()
            self.line = ""
            if self._saved is not None:
                if isinstance(sys.stdout, _Stream) and sys.stdout._live is self:
                    sys.stdout = self._saved[0]
                if isinstance(sys.stderr, _Stream) and sys.stderr._live is self:
                    sys.stderr = self._saved[1]
                self._saved = None


class _Stream:
    """A text stream whose writes go under the status line (``LiveStreams``); the rest is the stream's own."""

    def __init__(self, live: LiveStreams, stream):
        self._live, self._stream = live, stream

    def write(self, text: str) -> int:
        if not text:
            return 0
        with self._live.lock:
            self._live.clear()
            written = self._stream.write(text)
            self._live.at_start = text.endswith("\n")
            return written

    def writelines(self, lines) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        with self._live.lock:
            self._stream.flush()
            if not self._live.shown:
                self._live.draw()

    def __getattr__(self, name):
        return getattr(self._stream, name)
