"""The rank's side of the driver's commit service: rank 0 sends each elastic commit off the ranks.

``state.commit()`` (``collective/_core/_elastic.py``) copies the state in the rank's memory, as
Horovod does; inside a HorovodRunner run, rank 0 then hands that copy to a ``Publisher``: a
thread that pickles it and sends it to the driver as one authenticated COMMIT frame, or, with
``HorovodRunner(commit_dir=URL)``, writes it to that pyarrow filesystem and sends the driver only
its path. Training does not wait for it; a newer commit replaces one not yet sent. The driver
keeps it (``runner/_service/commit_store.py``); a restarted run's rank 0 asks for it back (``fetch``).
"""

from __future__ import annotations

import enum
import hashlib
import os
import pickle
import secrets
import threading
import time

from . import context as _context
from . import settings
from .driver_messages import Commit, Committed, Restore, Restored, decode


class HostUpdateResult(enum.IntFlag):
    """What changed among the hosts (Horovod's values)."""

    no_update = 0
    removed = 1
    added = 2
    mixed = removed | added



class RanksChanged(Exception):
    """Leaves a HorovodRunner rank at a commit after ``HostsUpdatedInterrupt``: the driver relaunches every rank
    with the new number, or away from an executor Spark takes back, and they resume from that commit (not an error;
    the run goes on)."""

    def __init__(self):
        super().__init__("every rank leaves at this commit, and the driver relaunches them all: Spark has task "
                         "slots for more ranks, or is decommissioning an executor of the run")

def _safe(key: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in key)


def join_url(base: str, *parts: str) -> str:
    """``base`` (a path or URL) with ``parts`` appended to its path; a URL's query (s3://...?endpoint_override=...,
    for an S3-compatible store) stays at its end, where pyarrow reads it."""
    tail = "/".join(part.strip("/") for part in parts)
    if "://" not in base:
        return f"{base.rstrip('/')}/{tail}"
    head, sep, query = base.partition("?")  # by hand: urllib writes hdfs:///x back as hdfs:/x
    return f"{head.rstrip('/')}/{tail}{sep}{query}"


def _filesystem(url: str):
    from pyarrow import fs

    return fs.FileSystem.from_uri(url) if "://" in url else (fs.LocalFileSystem(), os.path.abspath(url))


class Publisher:
    """Rank 0's thread that sends each commit off the rank; per state, the newest waiting commit wins."""

    def __init__(self, ctx):
        self._ctx = ctx
        self._client = None
        self._token = secrets.token_hex(4)  # this process's commit_dir files: never another attempt's names
        self._pending: dict[str, tuple] = {}  # state key -> its newest commit not yet taken, oldest key first
        self._busy = False
        self._cv = threading.Condition()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="sparkhvd-commits")
        self._thread.start()

    def submit(self, meta: dict, snapshot, on_hosts_updated=None) -> None:
        with self._cv:
            # Replaces this state's commit not yet taken (only the newest matters), never another state's.
            replaced = self._pending.get(str(meta["key"]))
            self._pending[str(meta["key"])] = (meta, snapshot, on_hosts_updated)
            self._cv.notify_all()
        if replaced is not None:
            remove_shards(replaced[0].get("shards"))  # its shards were written, but no manifest will name them

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every submitted commit has reached the driver; True if it has."""
        with self._cv:
            return self._cv.wait_for(lambda: not self._pending and not self._busy, timeout)

    def _loop(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: bool(self._pending))
                meta, snapshot, on_hosts_updated = self._pending.pop(next(iter(self._pending)))
                self._busy = True
            try:
                update = self._send(meta, snapshot)
                if update and on_hosts_updated is not None:
                    global growing
                    growing = True
                    on_hosts_updated(*update)  # Spark has room for more ranks: the state resizes at its next commit
            except Exception as exc:  # noqa: BLE001 - the run goes on; the previous commit stays in force
                # Its shards stay: the driver may have named them before the answer was lost; the run's folder goes
                # with the run.
                self._drop_client()  # the next commit reconnects: a broken link must not lose every later one
                print(f"sparkhvd: rank 0 could not send commit {meta.get('seq')} of {meta.get('key')} off the rank: "
                      f"{type(exc).__name__}: {exc}; the previous commit stays the one a restart resumes from.",
                      flush=True)
            finally:
                with self._cv:
                    self._busy = False
                    self._cv.notify_all()

    def _drop_client(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            try:
                client.close()
            except OSError:
                pass

    def _send(self, meta: dict, snapshot) -> list | None:
        """Send one commit; returns the driver's ``[timestamp, HostUpdateResult]`` when ranks can be added."""
        blob = pickle.dumps(snapshot, protocol=pickle.HIGHEST_PROTOCOL)
        meta = dict(meta, bytes=len(blob))
        commit_dir = settings.COMMIT_DIR.get()
        if commit_dir:
            fs, root = _filesystem(commit_dir)
            folder = f"{root.rstrip('/')}/{self._ctx.run_id}"
            fs.create_dir(folder, recursive=True)
            path = f"{folder}/{_safe(meta['key'])}-{meta['seq']}-{self._token}.pkl"
            with fs.open_output_stream(path) as f:
                f.write(blob)
            meta["sha256"] = hashlib.sha256(blob).hexdigest()  # the driver's authenticated copy, checked before loading
            meta["path"] = join_url(commit_dir, path[len(root.rstrip("/")):]) if "://" in commit_dir else path
            blob = b""
        if self._client is None:
            self._client = self._ctx.new_client()
        reply = self._client.ask(Commit(**meta), blob)  # ERR raises ServiceError
        answer = decode(Committed, reply.meta)
        if not answer.kept:
            remove_shards(meta.get("shards"))  # an older attempt's, say: nothing will name them
        return answer.hosts_updated


def remove_shards(shards: dict | None) -> None:
    """Remove a sharded commit's folder (``collective/torch/_sharded.py``) that nothing names any more; best effort."""
    if not shards or not shards.get("path"):
        return
    try:
        fs, path = _filesystem(shards["path"])
        fs.delete_dir(path)
    except Exception:  # noqa: BLE001 - left behind, it goes with the run's folder
        pass


def run_folder() -> str | None:
    """Where this run's commits go (``commit_dir=`` or the storage, then the run's id), as a path or URL; None
    outside a run or where the run has no such folder."""
    ctx = _context.current()
    root = settings.COMMIT_DIR.get()
    if ctx is None or not root:
        return None
    return join_url(root, ctx.run_id)


def files_under(path: str) -> list:
    """The files under local folder ``path``, by their names relative to it, sorted."""
    return sorted(os.path.relpath(os.path.join(root, name), path)
                  for root, _, names in os.walk(path) for name in names)


def folder_meta(url: str, digests: dict) -> dict:
    """A commit's ``shards``: the folder ``url`` of its files, each file's (SHA-256, size), and their total size."""
    return {"path": url, "sha256": digests, "bytes": sum(n for _, n in digests.values())}


def file_digest(url: str, name: str) -> tuple[str, int]:
    """The SHA-256 and size of file ``name`` in folder ``url`` (a path or a pyarrow filesystem URL)."""
    fs, path = _filesystem(join_url(url, name))
    digest, count = hashlib.sha256(), 0
    with fs.open_input_stream(path) as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
            count += len(chunk)
    return digest.hexdigest(), count


def changed_files(url: str, digests: dict, names: list | None = None) -> list:
    """Of ``names`` (default: every file of ``digests``, name -> (sha256, size)), those in folder ``url`` whose digest
    is not the recorded one, each as ``name (its digest, or missing)``."""
    wrong = []
    for name in sorted(digests) if names is None else names:
        try:
            found = file_digest(url, name)[0]
        except FileNotFoundError:
            found = "missing"
        except Exception as exc:  # noqa: BLE001 - unreadable: the callers gather it, so every rank says so together
            found = f"unreadable: {type(exc).__name__}: {exc}"
        if found != digests[name][0]:
            wrong.append(f"{name} ({found})")
    return wrong


_publisher: Publisher | None = None
growing = False  # the driver said the run can grow: HostsUpdatedInterrupt relaunches every rank
_publisher_lock = threading.Lock()


def publish(meta: dict, snapshot, on_hosts_updated=None) -> bool:
    """Send ``snapshot`` off this rank as its state's newest commit; False outside a HorovodRunner run.

    ``on_hosts_updated(timestamp, update)`` is called when the driver answers that the run can grow.
    """
    global _publisher
    ctx = _context.current()
    if ctx is None:
        return False
    with _publisher_lock:
        if _publisher is None:
            _publisher = Publisher(ctx)
    _publisher.submit(meta, snapshot, on_hosts_updated)
    return True


_writers: set = set()  # threads still writing a sharded commit's shards (collective/torch/_sharded.py)


def writing(thread: threading.Thread) -> None:
    """Count ``thread`` (not yet started) among this rank's commits on their way until it ends: ``flush`` waits."""
    _writers.add(thread)


def written(thread: threading.Thread) -> None:
    _writers.discard(thread)


def flush(timeout: float | None = None) -> bool:
    """Wait for this rank's commits to reach the driver, shards first (True at once where none were sent)."""
    start = time.monotonic()
    written_by = None if timeout is None else start + timeout / 2  # a writer stuck on a lost peer leaves the rest
    for thread in list(_writers):
        thread.join(None if written_by is None else max(0.0, written_by - time.monotonic()))
    writing = any(thread.is_alive() for thread in list(_writers))
    sent = _publisher is None or _publisher.flush(None if timeout is None else
                                                   max(0.0, start + timeout - time.monotonic()))
    return sent and not writing


def fetch(key: str, *, data: bool = True):
    """The driver's newest commit of ``key`` as ``(meta, snapshot)``; ``(meta, None)`` with ``data=False``;
    None when there is none or this process is not in a HorovodRunner run."""
    ctx = _context.current()
    if ctx is None:
        return None
    reply = ctx.client.ask(Restore(key=key, data=data))
    restored = decode(Restored, reply.meta)
    if not restored.found:
        return None
    meta = restored.commit
    if not data:
        return meta, None
    blob = reply.blob
    if meta.get("path"):
        fs, path = _filesystem(meta["path"])
        with fs.open_input_stream(path) as f:
            blob = f.read()
        digest = hashlib.sha256(blob).hexdigest()
        if digest != meta.get("sha256"):
            raise ValueError(
                f"the commit file {meta['path']} is not the one rank 0 wrote (its SHA-256 is {digest}, the driver "
                f"recorded {meta.get('sha256')}); something else wrote to commit_dir: give each run a commit_dir that "
                "only it writes to. Nothing was loaded from it.")
    return meta, pickle.loads(blob)  # from an authenticated frame, or a file whose digest came in one
