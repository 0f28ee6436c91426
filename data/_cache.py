"""The converter cache: which DataFrame plans this process has materialized, and where.

Petastorm's rule: a second ``make_spark_converter`` call on a DataFrame with the same plan
(and the same write options) reuses the first call's directory instead of writing again.
"Same plan" is Spark's ``DataFrame.sameSemantics``: the analyzed plans are equal once
canonicalized (expression ids normalized), so two DataFrames built by the same code match,
while a different query, different in-memory data or a different RDD does not;
``DataFrame.semanticHash`` narrows the candidates first. The key is compared in this process
only: a directory is never adopted from another process, whose plan we cannot compare and
whose write may still be running.

A directory is reused only while it is complete: the converter writes a marker file
(``_sparkhvd.json``, listing the data files) after Spark's write and the row count succeed,
and reuse checks the marker and every listed file. A directory being written by another
thread is never handed out: callers for the same key wait on the key's lock, then reuse.
As with Petastorm, a DataFrame over files that were rewritten since has the same plan, so it
reuses the old data: call ``converter.delete()`` after changing the source.

Reuse is within one SparkSession of one process: a slot keeps its DataFrame (the plan to
compare against, which keeps its session alive), and is dropped when its session has been
stopped, when its write failed, or when ``delete()`` removes its directory.
"""

from __future__ import annotations

import json
import posixpath
import threading
from dataclasses import dataclass, field
from typing import Any

import pyarrow.fs as pafs

from ._metadata import resolve_url

MARKER = "_sparkhvd.json"


@dataclass
class Slot:
    """One cache key: a DataFrame, its write options, and the directory written for them (if any)."""

    df: Any
    options: tuple
    semantic_hash: int
    lock: threading.Lock = field(default_factory=threading.Lock)
    url: str | None = None  # the directory written for this key, once written


def session_stopped(session) -> bool:
    """Whether ``session`` has been stopped: its SparkContext let go of the JVM's (or, under Spark Connect, it says so)."""
    context = getattr(session, "_sc", None)
    if context is not None:
        return getattr(context, "_jsc", None) is None  # SparkContext.stop() sets _jsc to None
    return bool(getattr(session, "is_stopped", False))


_slots: list[Slot] = []
_slots_lock = threading.Lock()


def slot_for(df, options: tuple) -> Slot:
    """The slot of ``df``'s plan with ``options``: an existing one when the plans match, else a new one."""
    semantic_hash = df.semanticHash()
    with _slots_lock:
        # Slots of stopped sessions can never match (nor compare plans): drop them, and their DataFrames.
        _slots[:] = [slot for slot in _slots if not session_stopped(slot.df.sparkSession)]
        for slot in _slots:
            if (slot.options == options and slot.semantic_hash == semantic_hash
                    and slot.df.sparkSession is df.sparkSession and df.sameSemantics(slot.df)):
                return slot
        slot = Slot(df, options, semantic_hash)
        _slots.append(slot)
        return slot


def forget(url: str) -> None:
    """Drop every slot whose directory is ``url`` (after ``delete()``)."""
    with _slots_lock:
        _slots[:] = [slot for slot in _slots if slot.url != url]


def drop(slot: Slot) -> None:
    """Drop ``slot``: its write failed, so it names no directory worth keeping its DataFrame for."""
    with _slots_lock:
        _slots[:] = [other for other in _slots if other is not slot]


def keep(slot: Slot) -> None:
    """Keep ``slot`` after its write succeeded (again, if a failed write of another thread dropped it meanwhile)."""
    with _slots_lock:
        if not any(other is slot for other in _slots):
            _slots.append(slot)


def slots_with_url(url: str) -> list[Slot]:
    """The slots whose directory is ``url``."""
    with _slots_lock:
        return [slot for slot in _slots if slot.url == url]


def write_marker(url: str, marker: dict) -> None:
    """Write the completion marker into the directory ``url``; the last step of a write."""
    fs, path = resolve_url(url)
    with fs.open_output_stream(posixpath.join(path, MARKER)) as out:
        out.write(json.dumps(marker, sort_keys=True).encode())


def read_complete_marker(url: str) -> dict | None:
    """The marker of ``url`` when the directory is complete (marker and every listed file present), else None."""
    fs, path = resolve_url(url)
    try:
        with fs.open_input_stream(posixpath.join(path, MARKER)) as f:
            marker = json.loads(f.read())
        infos = fs.get_file_info([posixpath.join(path, name) for name in marker["files"]])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if any(info.type != pafs.FileType.File for info in infos):
        return None
    return marker
