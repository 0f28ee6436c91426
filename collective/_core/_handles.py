"""Handles of asynchronous collectives: ``poll`` and ``synchronize``.

An op's handle is the engine's (``collective/_engine/engine.py``); ``GroupHandle`` stands for several
(Horovod's grouped allgather and reducescatter, and the sparse allreduce's two allgathers).
"""

from __future__ import annotations

from typing import Callable

from .._engine.ops import Handle


class GroupHandle:
    """Several ops as one handle: ``synchronize`` gives ``finish()`` once every one has finished."""

    def __init__(self, handles: list, finish: Callable[[], object], kind: str):
        self._handles = handles
        self._finish = finish
        self._result = None
        self._done = False
        self.kind = kind

    def wait(self):
        if not self._done:
            failure = None
            for h in self._handles:  # every one, even after a failure: each frees its name once waited
                try:
                    h.wait()
                except Exception as exc:  # noqa: BLE001 - the first is raised once all are waited
                    failure = failure or exc
            if failure is not None:
                raise failure
            self._result = self._finish()
            self._done = True
        return self._result

    def is_completed(self) -> bool:
        return self._done or all(h.is_completed() for h in self._handles)

    def __call__(self):
        return self.wait()


def synchronize(handle):
    """Wait for an asynchronous operation and return its result."""
    if not isinstance(handle, (Handle, GroupHandle)):
        raise ValueError(f"synchronize takes a handle returned by an *_async function, got {type(handle).__name__}.")
    return handle.wait()  # the op's end in the timeline, if one records


def poll(handle) -> bool:
    """True if the operation has finished (``synchronize`` will not block)."""
    if not isinstance(handle, (Handle, GroupHandle)):
        raise ValueError(f"poll takes a handle returned by an *_async function, got {type(handle).__name__}.")
    return handle.is_completed()
