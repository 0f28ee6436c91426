"""An op as the backend describes it (``Op``), and as its caller holds it while it runs (``Handle``).

The backend (``collective/_core/``: ``_allreduce.py``, ...) describes each collective with an ``Op``: what must agree
across ranks, the bytes it sends inline, and ``launch``, which the engine calls with the
coordinator's ``Answer`` to start the data movement. ``Engine.submit`` turns it into the ``Request``
the coordinator sees and returns a ``Handle`` at once. Nothing here imports torch.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from dataclasses import dataclass
from typing import Callable

from ..._common import progress as _progress
from . import timeline as _timeline
from .messages import OK, Answer, Layout, Request

_scope = threading.local()  # .prefix, .count: names for this thread's unnamed ops (``named``)


@contextlib.contextmanager
def named(prefix: str):
    """Unnamed ops this thread submits inside get the names ``prefix.0``, ``prefix.1``, ...

    For TensorFlow graphs, whose threads run independent ops in any order: each graph op gets a
    prefix when the graph is built (alike on every rank), so its collectives pair by that name, not
    by the order in which the threads happened to run them.
    """
    previous = getattr(_scope, "prefix", None), getattr(_scope, "count", None)
    _scope.prefix, _scope.count = prefix, itertools.count()
    try:
        yield
    finally:
        _scope.prefix, _scope.count = previous


def in_named_scope() -> bool:
    """Whether this thread's unnamed ops are named by ``named`` now (``scoped_name``)."""
    return getattr(_scope, "prefix", None) is not None


def scoped_name() -> str:
    """The next name ``named`` gives this thread's unnamed ops (inside ``named`` only)."""
    return f"{_scope.prefix}.{next(_scope.count)}"


class HorovodInternalError(RuntimeError):
    """A collective failed on every rank: the ranks disagreed on it, or a peer failed (Horovod's class)."""


@dataclass(slots=True)
class Op:
    """One collective as the backend describes it to the engine (the fields of its ``Request``, and how to run it)."""

    kind: str
    name: str | None  # None: the engine names it (the n-th unnamed op of its kind on its set)
    signature: str  # equal on every rank (``Request.signature``)
    description: str  # what this rank passed, for the error when signatures differ
    rank_value: object = None  # this rank's own value that may differ (``Request.rank_value``)
    argument_error: str | None = None  # what is wrong with this rank's arguments (every member raises it)
    joinable: bool = False
    inline: object = None  # bytes-like that ride in the request, or None
    launch: Callable | None = None  # (Answer, inline result) -> (works, finish); in the engine thread
    nbytes: int = 0
    layout: Layout | None = None  # the data op, for the coordinator's inline reduction or a joined rank's zeros
    fusion_key: str | None = None  # ops of one key ready together may run as one data op
    launch_fused: Callable | None = None  # (ops, Answer) -> [(works, finish)] per op: them as one data op
    fusion_part: object = None  # the backend's own record of the op, with named fields, that ``launch_fused`` reads

    def request(self, name: str) -> Request:
        """What this rank asks the coordinator for, as the op ``name``."""
        inline = 0 if self.inline is None else memoryview(self.inline).nbytes
        fused = self.fusion_key is not None
        return Request(name, self.kind, self.signature, self.description, self.rank_value, self.argument_error,
                       self.joinable, inline, self.fusion_key, self.nbytes if fused else 0, self.layout)


class Handle:
    """An op in flight: negotiated (``_answered``), then its data works, then ``finish`` gives the result."""

    __slots__ = ("op", "request", "name", "kind", "nbytes", "started", "trace", "_answered", "_error", "_works",
                 "_finish", "_result", "_done", "_check", "_link", "_engine", "_waiting", "_out_at", "__weakref__")

    def __init__(self, op: Op, link, engine=None):
        self.op = op
        self.request: Request | None = None  # what this rank sent the coordinator (None: a set of one)
        self.name = op.name
        self.kind = op.kind
        self.nbytes = op.nbytes
        self.started = time.perf_counter() * 1e6  # microseconds, as the timeline counts
        self.trace = f"{op.kind}.{op.name}" if op.name is not None else op.kind  # its name in the timeline
        self._answered = threading.Event()
        self._error: BaseException | None = None
        self._works: list = []
        self._finish: Callable | None = None
        self._result = None
        self._done = False
        self._check = None  # the stall report's entry while the op is negotiated
        self._link = link
        self._engine = engine
        self._waiting = threading.Lock()  # one waiter finishes the op; others then read its result
        self._out_at = float("inf")  # a worker's request has left once its channel's ``sent`` reaches this

    def _fail(self, error: BaseException) -> None:
        self._error = error
        self._settle()

    def _settle(self) -> None:
        """The answer is in (the engine's side): wake whoever waits."""
        if self._answered.is_set():
            return
        if self._engine is not None:
            self._engine._settled()
        _timeline.negotiate_end(self.trace, self.kind)
        self._answered.set()

    def wait(self):
        """The op's result; raises what failed it. The op's name is free again once it is answered: a wait
        interrupted before (Ctrl-C) leaves it taken, since the op is still being negotiated."""
        if self._done:
            return self._result
        with self._waiting:  # ``finish`` scales and copies in place: it must run once, whoever else waits
            if self._done:
                return self._result
            try:
                return self._wait()
            finally:
                if self.request is not None and self._answered.is_set():
                    self._link.in_flight.discard(self.request.name)
                _timeline.end(self.trace, self.nbytes)

    def _wait(self):
        if not self._answered.is_set():
            if self._engine is not None:
                self._engine.drive(self)
            self._answered.wait()
        if self._error is not None:
            raise self._error
        if self._works:
            entry = _progress.begin_data(self._check_op(), self.kind, self.name)
            try:
                for work in self._works:
                    work.wait()
            finally:
                _progress.end(entry)
        self._result = self._finish() if self._finish is not None else None
        self._done = True
        return self._result

    def _check_op(self):
        check = self._check
        return None if check is None else tuple(check[:5])

    def is_completed(self) -> bool:
        if self._done:
            return True
        if not self._answered.is_set():
            return False
        return self._error is not None or all(work.is_completed() for work in self._works)

    def __call__(self):
        return self.wait()

    def __repr__(self) -> str:
        state = "done" if self._done else "answered" if self._answered.is_set() else "negotiating"
        return f"<sparkhvd handle {self.trace} {state}>"


# ---- the engine's side: an answered op starts, or fails ------------------------------------------------------

def settle(handle: Handle, works: list, finish) -> None:
    """The op is agreed and its data ops started (``works``); ``finish`` gives its result once they are done."""
    end_check(handle)
    handle._works, handle._finish = works, finish
    handle._settle()


def fail(handle: Handle, error: BaseException) -> None:
    """The op failed: its caller's ``synchronize`` raises ``error``."""
    end_check(handle)
    handle._fail(error)


def end_check(handle: Handle) -> None:
    """The op's wait for its peers is over (the stall report's entry)."""
    if handle._check is not None:
        _progress.end(handle._check)


def launch(handle: Handle, answer: Answer, result) -> None:
    """Start the op's data movement as ``answer`` says (``result``: the inline result's bytes, or None)."""
    try:
        works, finish = handle.op.launch(answer, result)
    except BaseException as exc:  # noqa: BLE001 - the caller's synchronize raises it
        fail(handle, exc)
        return
    settle(handle, works, finish)


def run_local(op: Op) -> Handle:
    """``op`` on a set of one: nothing to negotiate, so it starts now, in the caller's thread."""
    if op.argument_error:
        raise ValueError(op.argument_error)
    handle = Handle(op, None)
    _timeline.negotiate_start(handle.trace, op.kind, handle.started)
    works, finish = op.launch(Answer([op.name], OK, [op.rank_value]), None)
    handle._works, handle._finish = works, finish
    handle._settle()
    return handle
