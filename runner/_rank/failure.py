"""Telling the driver that this rank failed, so that the run's error shows the cause and nothing else.

The rank's output shows one line (runner/_shared/collateral.py: ``failure_line``); the whole traceback goes to the
rank's log file only; the driver's error shows the traceback without sparkhvd's frames (``user_traceback``).
So a rank that only stopped because another failed never prints a traceback that a reader could take for the
cause.
"""

from __future__ import annotations

import os
import sys
import traceback

import cloudpickle

from ..._common.client import RunAborted, ServiceClient
from ..._common.driver_messages import Error, Log
from ..._common.protocol import FILE_ONLY, FLUSH_CHARS, MAX_LINE_BYTES
from .._shared.collateral import failure_line
from .._shared.package import PACKAGE_DIR
from .exit import reported

_OURS = tuple(os.path.join(PACKAGE_DIR, part) for part in ("_common" + os.sep, "runner" + os.sep, "collective" + os.sep,
                                                         "data" + os.sep, "__init__.py"))


def report_failure(client: ServiceClient, rank: int, exc: BaseException, quiet: bool = False) -> None:
    """Tell the driver that this rank failed with ``exc``; ``quiet``: it leaves at a commit, one line says so."""
    if quiet:
        sys.stderr.write(f"sparkhvd: rank {rank} leaves at this commit: {exc}\n")
    else:
        whole = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        if not _to_log_file(client, rank, whole):
            sys.stderr.write(whole)  # the driver did not take it: the whole traceback, in the rank's output
        sys.stderr.write(failure_line(rank, type(exc).__name__, str(exc)) + "\n")
    sys.stderr.flush()
    reported.set()  # an abort from here on ends the process without another line: this one said why
    text = user_traceback(exc)
    try:
        pickled = cloudpickle.dumps(exc)
    except Exception:  # noqa: BLE001 - the text is enough
        pickled = b""
    try:
        client.ask(Error(rank=rank, type=type(exc).__name__, message=str(exc), traceback=text,
                         classes=class_names(type(exc))), pickled)
    except (OSError, ConnectionError, RunAborted):
        pass


def class_names(cls: type) -> list:
    """``module.qualname`` of ``cls`` and every class it derives from, most derived first (``retry_on`` matches
    these on the driver, where the rank's exception may not unpickle)."""
    return [f"{c.__module__}.{c.__qualname__}" for c in cls.__mro__]


def _to_log_file(client: ServiceClient, rank: int, text: str) -> bool:
    """Send ``text`` to this rank's log file on the driver, not to its screen; False where it could not be sent.

    In frames of at most ``FLUSH_CHARS`` characters of lines of at most ``MAX_LINE_BYTES`` characters, as the
    agent sends the rank's output (runner/_agent/output.py), so that each frame's metadata stays under the
    protocol's limit. Sent on the connection the error report follows on: the driver has written it before it
    hears of the failure."""
    lines = [line[i:i + MAX_LINE_BYTES] for line in text.splitlines() for i in range(0, max(len(line), 1),
                                                                                       MAX_LINE_BYTES)]
    try:
        batch: list = []
        size = 0
        for line in lines:
            if batch and size + len(line) > FLUSH_CHARS:
                client.tell(Log(rank=rank, stream=FILE_ONLY, lines=batch))
                batch, size = [], 0
            batch.append(line)
            size += len(line) + 1
        if batch:
            client.tell(Log(rank=rank, stream=FILE_ONLY, lines=batch))
    except (OSError, ConnectionError):
        return False
    return True


def user_traceback(exc: BaseException) -> str:
    """``exc``'s traceback without sparkhvd's own frames (those stay in the rank's log)."""
    formatted = traceback.TracebackException(type(exc), exc, exc.__traceback__)
    hidden = 0
    seen = set()
    chain = [formatted]
    while chain:
        te = chain.pop()
        if id(te) in seen:
            continue
        seen.add(id(te))
        kept = [frame for frame in te.stack if not frame.filename.startswith(_OURS)]
        hidden += len(te.stack) - len(kept)
        te.stack = traceback.StackSummary.from_list(kept)
        chain += [t for t in (te.__cause__, te.__context__) if t is not None]
    text = "".join(formatted.format())
    if hidden:
        text += (f"({hidden} frame{'s' if hidden > 1 else ''} inside sparkhvd hidden; the whole traceback is in "
                 "this rank's log)\n")
    return text
