"""``sparkhvd.report(metrics, checkpoint=)`` and ``sparkhvd.get_checkpoint()``: Ray Train's reporting, on the
commits' path (``_common/commits.py``).

Each report is a commit of the state ``report`` (``report-metrics`` for one without a checkpoint, so that it never
drops the newest checkpoint): its metrics are the commit's fields, so ``keep_commits`` and
``keep_best=("val_loss", "min")`` keep reports as they keep an elastic state's commits, and ``RunResult.commits``
and ``sparkhvd run`` list them. Rank 0's report is the one kept (Ray Train keeps rank 0's metrics too); its
checkpoint, a folder the function wrote, is copied:

- with a folder for commits (``commit_dir=``, or ``run_id=`` with ``storage=``), to
  ``<folder>/<run_id>/report-<seq>-<token>.ckpt/``, each file's SHA-256 sent to the driver with the metrics;
- without one, to the driver, its files' bytes in the commit (a frame holds 2 GiB).

A restarted run, or a new driver's with the same ``run_id``, gets the newest kept report's checkpoint back from
``get_checkpoint()``, its files checked against the digests first. ``report`` blocks until the copy is done, as
Ray Train's does until its upload is.
"""

from __future__ import annotations

import contextlib
import numbers
import os
import secrets
import shutil
import tempfile

from ..._common import commits as _commits
from ..._common import context as _context
from ..._common.commits import _filesystem

KEY = "report"  # the reports with a checkpoint
METRICS_KEY = "report-metrics"  # those without: kept apart, so that one never drops the newest checkpoint
_FLUSH_S = 600.0  # a driver that does not answer: the run goes on, and the next report tries again
_FIELD_TYPES = (str, bool, int, float, type(None))
_state = {"seq": 0, "token": secrets.token_hex(4), "asked": set()}  # "asked": the keys this process fetched


class Checkpoint:
    """A folder of files a training function saved (Ray Train's ``Checkpoint``): ``Checkpoint.from_directory(path)``
    to report one, ``get_checkpoint()`` to get the newest back. ``metrics`` are those reported with it."""

    def __init__(self, path: str | None, *, metrics: dict | None = None, _files: dict | None = None):
        self.path = path  # a local folder or a filesystem URL; None where the driver holds the files
        self.metrics = dict(metrics or {})
        self._files = _files

    @classmethod
    def from_directory(cls, path) -> Checkpoint:
        return cls(os.fspath(path))

    @contextlib.contextmanager
    def as_directory(self):
        """A local folder holding the checkpoint's files: its own where it is local, else a copy removed after."""
        if self.path is not None and "://" not in self.path:
            yield self.path
            return
        folder = tempfile.mkdtemp(prefix="sparkhvd-checkpoint-")
        try:
            yield self.to_directory(folder)
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    def to_directory(self, path=None) -> str:
        """Copy the checkpoint's files into ``path`` (default: a new temp folder, the caller's to remove)."""
        path = os.fspath(path) if path is not None else tempfile.mkdtemp(prefix="sparkhvd-checkpoint-")
        os.makedirs(path, exist_ok=True)
        if self._files is not None:
            for name, data in self._files.items():
                target = os.path.join(path, name)
                os.makedirs(os.path.dirname(target), exist_ok=True)
                with open(target, "wb") as f:
                    f.write(data)
        elif self.path is not None:
            from pyarrow import fs

            source_fs, source = _filesystem(self.path)
            fs.copy_files(source, os.path.abspath(path), source_filesystem=source_fs,
                          destination_filesystem=fs.LocalFileSystem())
        return path

    def __repr__(self) -> str:
        return f"Checkpoint(path={self.path!r}, metrics={self.metrics!r})"


def report(metrics: dict, checkpoint=None) -> None:
    """Record ``metrics`` (plain values by name) and, optionally, ``checkpoint`` (a folder, or a ``Checkpoint``) as
    the run's newest report. Call it on every rank or on rank 0: rank 0's is kept. Outside a HorovodRunner run it
    only checks its arguments."""
    fields = _fields(metrics)
    folder = None
    if checkpoint is not None:
        folder = checkpoint.path if isinstance(checkpoint, Checkpoint) else os.fspath(checkpoint)
        if folder is None or not os.path.isdir(folder):
            raise FileNotFoundError(f"sparkhvd.report: checkpoint={folder!r} is not a folder on this host; save the "
                                    "checkpoint's files into a local folder first and pass its path (or "
                                    "Checkpoint.from_directory(path)).")
    ctx = _context.current()
    if ctx is None or ctx.placement.rank != 0:
        return
    seq = _next_seq()
    meta = {"key": KEY if folder is not None else METRICS_KEY, "seq": seq, "size": ctx.placement.size,
            "fields": fields}
    snapshot = {"metrics": fields}
    if folder is not None:
        where = _commits.run_folder()
        if where:
            meta["shards"] = _copy(folder, _commits.join_url(where, f"report-{seq}-{_state['token']}.ckpt"))
        else:
            snapshot["files"] = _read(folder)
    _commits.publish(meta, snapshot)
    if not _commits.flush(_FLUSH_S):  # as Ray Train's report: the checkpoint is kept when this returns
        print(f"sparkhvd: report {seq} had not reached the driver after {_FLUSH_S:.0f} s; the run goes on, and a "
              "restart resumes from the report before it.", flush=True)


def get_checkpoint() -> Checkpoint | None:
    """The newest kept report's checkpoint, in a restarted run or a new driver's with the same ``run_id``; None where
    there is none (a first run, a report without a checkpoint, or outside a HorovodRunner run)."""
    found = _commits.fetch(KEY)
    _state["asked"].add(KEY)
    if found is None:
        return None
    meta, snapshot = found
    _state["seq"] = max(_state["seq"], int(meta["seq"]))
    metrics = dict(meta.get("fields") or {})
    shards = meta.get("shards")
    if shards:
        wrong = _commits.changed_files(shards["path"], shards["sha256"])
        if wrong:
            raise ValueError(f"the checkpoint {shards['path']} is not the one rank 0 reported: {', '.join(wrong)} "
                             "do not match the SHA-256 the driver recorded; something else wrote to the run's folder. "
                             "Give each run a folder only it writes to (or a new run_id). Nothing was read from it.")
        return Checkpoint(shards["path"], metrics=metrics)
    if snapshot.get("files") is not None:
        return Checkpoint(None, metrics=metrics, _files=snapshot["files"])
    return None


def _fields(metrics) -> dict:
    if not isinstance(metrics, dict):
        raise TypeError(f"sparkhvd.report: metrics must be a dict of plain values by name, such as "
                        f"{{'val_loss': 0.25}}; got {type(metrics).__name__}.")
    fields = {}
    for name, value in metrics.items():
        if hasattr(value, "item") and not isinstance(value, _FIELD_TYPES):  # a one-element tensor or NumPy scalar
            try:
                value = value.item()
            except (ValueError, RuntimeError):
                pass
        if isinstance(value, numbers.Integral) and not isinstance(value, bool):
            value = int(value)
        elif isinstance(value, numbers.Real) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(name, str) or not isinstance(value, _FIELD_TYPES):
            raise TypeError(f"sparkhvd.report: metric {name!r} is a {type(value).__name__}; report numbers, strings, "
                            "booleans or None by name (a tensor of one value with .item()), and keep other results "
                            "in the checkpoint's files.")
        fields[name] = value
    return fields


def _next_seq() -> int:
    # The first report of this process goes on from the run's newest one (in a restarted attempt, or a new driver's).
    for key in (KEY, METRICS_KEY):
        if key not in _state["asked"]:
            found = _commits.fetch(key, data=False)
            _state["asked"].add(key)
            if found is not None:
                _state["seq"] = max(_state["seq"], int(found[0]["seq"]))
    _state["seq"] += 1
    return _state["seq"]


def _copy(folder: str, url: str) -> dict:
    """Copy ``folder``'s files to ``url``; its ``shards`` meta (the folder, each file's SHA-256 and size)."""
    from pyarrow import fs

    target_fs, target = _filesystem(url)
    target_fs.create_dir(target, recursive=True)
    fs.copy_files(os.path.abspath(folder), target, source_filesystem=fs.LocalFileSystem(),
                  destination_filesystem=target_fs)
    return _commits.folder_meta(url, {name: _commits.file_digest(url, name) for name in _commits.files_under(folder)})


def _read(folder: str) -> dict:
    files = {}
    for name in _commits.files_under(folder):
        with open(os.path.join(folder, name), "rb") as f:
            files[name] = f.read()
    return files

