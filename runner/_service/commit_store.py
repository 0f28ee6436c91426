"""Elastic commits kept off the ranks, so that losing any rank (rank 0 included) loses no committed work.

``state.commit()`` (``collective/_core/_elastic.py``) copies the state in the rank's memory, as
Horovod does; inside a HorovodRunner run, rank 0 then hands that copy to a ``Publisher``: a
thread that pickles it and sends it to the driver as one authenticated COMMIT frame, or, with
``HorovodRunner(commit_dir=URL)``, writes it to that pyarrow filesystem and sends the driver only
its path. Training does not wait for it; a newer commit replaces one not yet sent. A commit counts
once the driver has it: a rank lost while sending one leaves the previous commit in force, which
is as good, since every commit is a point of the uninterrupted run.

The rank's side (``Publisher``, ``publish``, ``fetch``) is ``_common/commits.py``. On the driver a ``CommitStore`` keeps the newest commit of each state, in memory up to
``SPARKHVD_COMMIT_MEMORY_BYTES`` (default 256 MiB) and in a file beyond it, across the restarts
of one run. It never unpickles what it keeps: only ranks do, from authenticated frames. Every
commit is removed when the run ends.

With a ``RunStorage`` (``HorovodRunner(run_id=, storage=)``, ``runner/_service/run_storage.py``)
rank 0 writes each commit into the run's folder there, and the store records the newest
``keep`` of each state in the folder's manifest; it starts from the commits an earlier driver's
manifest names, and at the end keeps them where the run failed (or was killed), or removes them
where it succeeded (keeping the newest ``keep`` where that is above 0). ``keep_best=(field, "min" or
"max")`` also keeps, of each state, the commit whose plain field (``state.val_loss``, say) is best.

When a restarted run reaches ``hvd.elastic.run``, rank 0 asks for the newest commit (RESTORE)
and loads it; ``state.sync()`` then gives it to the other ranks.
"""

from __future__ import annotations

import itertools
import logging
import os
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass

from ..._common import settings
from ..._common.commits import _filesystem, _safe, remove_shards

log = logging.getLogger("sparkhvd.commits")



@dataclass
class Commit:
    """The newest commit of one state, as the driver keeps it.

    ``meta``: the rank's description (``key``, ``seq``, ``fields``: the state's plain values such
    as epoch and batch, ``size``: the ranks it was made with, ``bytes``, and ``path`` where it lives
    in a ``commit_dir`` with ``sha256``, the digest rank 0 checks before unpickling the file), plus
    the driver's ``attempt`` (the launch that sent it) and ``at``; ``blob``: the pickled state, None
    where it is spilled or in a commit_dir.
    """

    meta: dict
    blob: bytes | None = None
    spilled: str | None = None  # the file holding the blob on the driver

    def data(self) -> bytes:
        if self.blob is not None:
            return self.blob
        if self.spilled is not None:
            with open(self.spilled, "rb") as f:
                return f.read()
        return b""


class CommitStore:
    """The driver's newest commit of each elastic state, across one run's restarts. Thread-safe."""

    def __init__(self, *, memory_bytes: int | None = None, commit_dir: str | None = None, run_id: str = "",
                 storage=None, keep: int = 0, keep_best: tuple | None = None):
        self.memory_bytes = settings.COMMIT_MEMORY_BYTES.get() if memory_bytes is None else memory_bytes
        self.storage = storage  # a RunStorage: the commits outlive the driver
        self.commit_dir = commit_dir if storage is None else storage.url
        self.run_id = run_id
        self.keep = keep  # with storage: the newest commits of each state kept (at least 1 while the run goes on)
        self.keep_best = keep_best  # with storage: (field, "min" or "max"): each state's best commit is kept too
        self.count = 0  # commits received in the whole run
        self._commits: dict[str, Commit] = {}
        self._older: dict[str, list] = {}  # with storage: key -> the metas of its kept older commits, newest first
        #: with storage: the newest commit of each state that an earlier driver left (what this run resumes from)
        self.inherited: dict[str, dict] = {}
        self._final: dict | None = None  # with storage: what the folder keeps once the run has ended
        if storage is not None:
            for key, metas in storage.commits().items():
                if metas:
                    self.inherited[key] = metas[0]
                    self._commits[key] = Commit(meta=dict(metas[0], attempt=-1, at=0.0))
                    self._older[key] = list(metas[1:])
        self._spill_dir: str | None = None
        self._spills = itertools.count()  # spill files are never reused, so removing an old one never hits a new one
        self._lock = threading.Lock()
        self._closed = False

    def put(self, meta: dict, blob: bytes, *, attempt: int = 0) -> bool:
        """Keep ``meta``'s commit of its state instead of the one before it; False (and nothing kept) when it is
        not newer: a commit of the same attempt with no higher ``seq``, or any commit once the store is closed.

        OSError where a spill file cannot be written (a full disk): the previous commit stays in force.
        """
        key = str(meta["key"])
        seq = int(meta.get("seq", 0))
        with self._lock:
            old = self._commits.get(key)
            if self._closed or (old is not None and old.meta.get("attempt") == attempt and old.meta.get("seq", 0) >= seq):
                return False
        meta = dict(meta, at=time.monotonic(), attempt=attempt)
        spilled = None
        if len(blob) > self.memory_bytes:
            spilled = self._spill(key, seq, blob)
            blob = None
        with self._lock:
            current = self._commits.get(key)
            if self._closed or current is not old:  # closed, or a newer one was kept meanwhile
                keep = False
            else:
                self._commits[key] = Commit(meta=meta, blob=blob, spilled=spilled)
                self.count += 1
                keep = True
        if not keep:
            _remove_file(spilled)
            return False
        if self.storage is not None and meta.get("path"):
            self._record(key, old)
        elif old is not None:
            _remove_file(old.spilled)
            if old.meta.get("path") and old.meta.get("path") != meta.get("path"):
                remove_commit(old.meta)
        return True

    def _record(self, key: str, old: Commit | None) -> None:
        """Storage: ``old`` joins the state's older commits, those past ``keep`` are removed, and the manifest names
        the rest. Its file goes after the manifest stops naming it, so the manifest never names a missing file."""
        with self._lock:
            older = self._older.setdefault(key, [])
            if old is not None and old.meta.get("path"):
                older.insert(0, _stored(old.meta))
            newest = _stored(self._commits[key].meta)
            kept, dropped = self._retained([newest, *older], max(self.keep, 1))
            older[:] = kept[1:]
            manifest = self._manifest()
        try:
            self.storage.record(manifest)
        except Exception as exc:  # noqa: BLE001 - the commit stays in force in this driver; a later one may record
            log.warning("sparkhvd: could not write run %s's manifest in %s (%s: %s); a new driver would resume from "
                        "an older commit.", self.run_id, self.storage.url, type(exc).__name__, exc)
            return
        for meta in dropped:
            remove_commit(meta)

    def _retained(self, metas: list, n: int) -> tuple[list, list]:
        """Of one state's commits (newest first): the newest ``n`` and the best by ``keep_best``, and the rest."""
        best = None
        if self.keep_best is not None:
            field, mode = self.keep_best
            scored = [m for m in metas if isinstance((m.get("fields") or {}).get(field), (int, float))]
            if scored:
                pick = min if mode == "min" else max
                best = pick(scored, key=lambda m: m["fields"][field])
        kept = [m for i, m in enumerate(metas) if i < n or m is best]
        return kept, [m for m in metas if not any(m is k for k in kept)]

    def _manifest(self) -> dict:
        """``key -> [meta, ...]``, newest first (under the lock)."""
        return {key: [_stored(c.meta), *self._older.get(key, [])]
                for key, c in self._commits.items() if c.meta.get("path")}

    def kept(self) -> list:
        """With storage: every commit kept, newest of each state first (``RunResult.commits``)."""
        with self._lock:
            manifest = self._manifest() if self._final is None else self._final
            return [meta for metas in manifest.values() for meta in metas]

    def attempt_of(self, key: str) -> int | None:
        """The attempt whose commit of ``key`` is kept; None when there is none."""
        with self._lock:
            commit = self._commits.get(key)
            return None if commit is None else commit.meta.get("attempt", 0)

    def get(self, key: str) -> Commit | None:
        with self._lock:
            return self._commits.get(key)

    def newest_each(self) -> list:
        """``(meta, data, attempt)`` of each state's newest commit: what a hosted attempt's task 0 starts from
        (runner/_policy/hosted.py)."""
        with self._lock:
            commits = list(self._commits.values())
        return [({k: v for k, v in c.meta.items() if k not in ("at", "attempt")}, c.data(), c.meta.get("attempt", 0))
                for c in commits]

    def newest(self) -> Commit | None:
        """The commit received last, of any state (what a restart resumes from, for its message)."""
        with self._lock:
            return max(self._commits.values(), key=lambda c: c.meta.get("at", 0), default=None)

    def close(self, succeeded: bool = True) -> None:
        """Remove every commit: the spilled files and the run's folder in ``commit_dir``. With storage: a run that
        failed keeps its commits for the next driver; one that succeeded keeps its newest ``keep`` of each state."""
        if self.storage is not None:
            return self._close_storage(succeeded)
        with self._lock:
            commits, self._commits = list(self._commits.values()), {}
            self._closed = True
        for commit in commits:
            _remove_file(commit.spilled)
        if self._spill_dir is not None:
            shutil.rmtree(self._spill_dir, ignore_errors=True)
        if self.commit_dir:
            try:
                fs, root = _filesystem(self.commit_dir)
                fs.delete_dir(f"{root.rstrip('/')}/{self.run_id}")
            except FileNotFoundError:
                pass
            except Exception as exc:  # noqa: BLE001 - a store the driver cannot reach: say so, keep going
                log.warning("sparkhvd: could not remove run %s's commits from %s: %s", self.run_id,
                            self.commit_dir, exc)

    def _close_storage(self, succeeded: bool) -> None:
        with self._lock:
            self._closed = True
            kept = self._final = self._manifest()
        try:
            self.storage.release()
            if not succeeded:
                return
            if not self.keep and self.keep_best is None:
                self._final = {}
                self.storage.remove_run()
                return
            for key in kept:
                kept[key], dropped = self._retained(kept[key], self.keep)
                for meta in dropped:
                    remove_commit(meta)
            self.storage.record(kept)
        except Exception as exc:  # noqa: BLE001 - a store the driver cannot reach: say so, keep going
            log.warning("sparkhvd: could not end run %s's folder in %s: %s", self.run_id, self.storage.url, exc)

    def _spill(self, key: str, seq: int, blob: bytes) -> str:
        if self._spill_dir is None:
            self._spill_dir = tempfile.mkdtemp(prefix=f"sparkhvd-{self.run_id}-commits-")
        path = os.path.join(self._spill_dir, f"{_safe(key)}-{seq}-{next(self._spills)}.pkl")
        with open(path, "wb") as f:
            f.write(blob)
        return path


def _stored(meta: dict) -> dict:
    """A commit's meta as the manifest keeps it: without this driver's ``at`` and ``attempt``."""
    return {k: v for k, v in meta.items() if k not in ("at", "attempt")}


def _remove_file(path: str | None) -> None:
    if path:
        try:
            os.remove(path)
        except OSError:
            pass


def remove_commit(meta: dict) -> None:
    """Remove a commit's file and, for a sharded state, its folder of shards."""
    _remove_path(meta["path"])
    remove_shards(meta.get("shards"))


def _remove_path(url: str) -> None:
    try:
        fs, path = _filesystem(url)
        fs.delete_file(path)
    except Exception:  # noqa: BLE001 - an older commit left behind is removed with the run's folder
        pass




def check_commit_dir(url: str, name: str = "commit_dir") -> None:
    """Fail on the driver, before launching, when ``commit_dir`` (or ``storage``: ``name``) is not a filesystem
    pyarrow can open."""
    try:
        _filesystem(url)
    except Exception as exc:  # noqa: BLE001 - pyarrow's own words name the problem
        raise ValueError(f"{name}={url!r} is not a filesystem pyarrow can open ({exc}); pass a local path "
                         "every host can reach or a URL such as hdfs://namenode/path or s3://bucket/path.") from None
