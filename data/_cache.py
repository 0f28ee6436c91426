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
    marker: dict | None = None  # the marker of the directory written for this key
    url: str | None = None


_slots: list[Slot] = []
_slots_lock = threading.Lock()


def slot_for(df, options: tuple) -> Slot:
    """The slot of ``df``'s plan with ``options``: an existing one when the plans match, else a new one."""
    semantic_hash = df.semanticHash()
    with _slots_lock:
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
