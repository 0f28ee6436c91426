"""Handles of asynchronous collectives: ``poll`` and ``synchronize``."""

from __future__ import annotations

from typing import Callable

from .. import _progress
from . import _timeline

_in_flight: dict = {}  # (kind, name) -> Handle, for this rank's unfinished named operations


class Handle:
    """An operation in flight: c10d works to wait for, then a step that produces the result."""

    __slots__ = ("_works", "_finish", "_result", "_done", "name", "kind", "nbytes", "started", "_op")

    def __init__(self, works: list, finish: Callable[[], object], name: str | None = None, *, kind: str = "op",
                 nbytes: int = 0):
        self._works = works
        self._finish = finish
        self._result = None
        self._done = False
        self.name = name
        self.kind = kind
        self.nbytes = nbytes
        self.started = _timeline.now_us()
        self._op = _progress.take_op()  # the checked op whose data this waits for (stall report)

    def wait(self):
        if not self._done:
            if self._works:  # an op whose data rode in its check has nothing to wait for
                entry = _progress.begin_data(self._op, self.kind, self.name)
                try:
                    for work in self._works:
                        work.wait()
                finally:
                    _progress.end(entry)
            self._result = self._finish()
            self._done = True
            _timeline.record(self.kind, self.name, self.started, self.nbytes)
        return self._result

    def __call__(self):
        """The result, as ``synchronize(handle)`` (Horovod's sparse_allreduce_async returns a function)."""
        return synchronize(self)

    def is_completed(self) -> bool:
        return self._done or all(work.is_completed() for work in self._works)

    def __repr__(self) -> str:
        state = "done" if self._done else "in flight"
        return f"<sparkhvd handle {self.name or ''} {state}>"


def name_problem(name: str | None, kind: str) -> str | None:
    """Why ``name`` cannot start another op of ``kind`` now (checked before the op starts), or None.

    Names are per kind of op, as Horovod prefixes them with the op ("allreduce.x", "broadcast.x").
    """
    if name is not None and (kind, name) in _in_flight:
        return (f"another {kind} named {name!r} is already in flight on this rank; synchronize it before reusing "
                "the name, or give this one another name.")
    return None


def register(handle: Handle) -> Handle:
    """Track a named handle; a name may have one operation of each kind in flight at a time."""
    if handle.name is not None:
        problem = name_problem(handle.name, handle.kind)  # callers check first; this keeps the registry honest
        if problem is not None:
            raise ValueError(problem)
        _in_flight[handle.kind, handle.name] = handle
    return handle


def synchronize(handle: Handle):
    """Wait for an asynchronous operation and return its result."""
    if not isinstance(handle, Handle):
        raise ValueError(f"synchronize takes a handle returned by an *_async function, got {type(handle).__name__}.")
    try:
        return handle.wait()
    finally:
        if handle.name is not None and _in_flight.get((handle.kind, handle.name)) is handle:
            del _in_flight[handle.kind, handle.name]


def poll(handle: Handle) -> bool:
    """True if the operation has finished (``synchronize`` will not block)."""
    if not isinstance(handle, Handle):
        raise ValueError(f"poll takes a handle returned by an *_async function, got {type(handle).__name__}.")
    return handle.is_completed()
