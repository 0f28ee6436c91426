"""A run's folder in its storage, which outlives the driver: ``HorovodRunner(run_id=, storage=)``.

Under ``<storage>/<run_id>/``:

    <key>-<seq>-<token>.pkl   each commit rank 0 wrote (``_common/commits.py``, as under ``commit_dir``)
    <key>-<seq>-<token>.dcp/  a sharded state's commit: every rank's shard (``collective/torch/_sharded.py``)
    manifest.json             the newest complete commits, each with the SHA-256 rank 0 checks before loading
    lease.json                which driver runs the run now, until when (renewed while it runs)

A commit counts once the manifest names it: rank 0 writes the commit's file first, the driver then
writes the manifest to a new name and moves it over the old one (a rename on a local or mounted
filesystem; on an object store, a copy that readers see whole or not at all). So a driver killed at
any moment leaves a manifest naming whole files only. A new driver with the same ``run_id`` reads it
and its ranks resume from those commits.

The lease keeps two drivers off one run: a driver takes it where there is none, where it expired
(its driver stopped renewing it), or where its driver's process is gone from this host; otherwise
the run is refused with a sentence. Between drivers on different hosts it is a best effort on an
object store (no atomic create there): the driver reads its lease back before starting.
"""

from __future__ import annotations

import json
import logging
import os
import re
import secrets
import socket
import threading
import time

from ..._common import settings
from ..._common.commits import _filesystem
from .._shared.errors import RunIdInUse

log = logging.getLogger("sparkhvd.storage")

MANIFEST = "manifest.json"
LEASE = "lease.json"
RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def check_run_id(run_id: str) -> str:
    """``run_id`` if it can name a folder everywhere; ValueError with the fix otherwise."""
    if not isinstance(run_id, str) or not RUN_ID.fullmatch(run_id):
        raise ValueError(f"run_id={run_id!r} must be 1 to 64 letters, digits, '.', '_' or '-', starting with a letter "
                         "or digit (it names the run's folder in the storage and its log folder), such as "
                         "run_id='resnet-2026-12-02'.")
    return run_id


class RunStorage:
    """The driver's side of one run's folder in the storage: its manifest and its lease."""

    def __init__(self, storage: str, run_id: str, *, lease_s: float | None = None, clock=time.time):
        self.url = storage.rstrip("/")
        self.run_id = run_id
        self.fs, root = _filesystem(storage)
        self.folder = f"{root.rstrip('/')}/{run_id}"
        self.lease_s = settings.LEASE_SECONDS.get() if lease_s is None else lease_s
        self.clock = clock
        self.token = secrets.token_hex(8)
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None
        self._lock = threading.Lock()

    # ---- the lease ----------------------------------------------------------------------------

    def claim(self) -> None:
        """Take the run's lease, and keep it renewed until ``release``; RunIdInUse where another driver holds it."""
        self.fs.create_dir(self.folder, recursive=True)
        held = self._read(LEASE)
        if held is not None and held.get("token") != self.token and self._alive(held):
            raise RunIdInUse(self._in_use(held))
        self._write_lease()
        mine = self._read(LEASE)
        if mine is None or mine.get("token") != self.token:  # another driver wrote it at the same moment
            raise RunIdInUse(self._in_use(mine or {}))
        self._renewer = threading.Thread(target=self._renew, daemon=True, name="sparkhvd-lease")
        self._renewer.start()

    def release(self) -> None:
        """Stop renewing the lease and remove it (where it is still this driver's)."""
        self._stop.set()
        if self._renewer is not None:
            self._renewer.join(5)
        held = self._read(LEASE)
        if held is not None and held.get("token") == self.token:
            self._delete(LEASE)

    def _alive(self, lease: dict) -> bool:
        """Whether the lease's driver may still run: it has not expired, and its process is not known to be gone."""
        if float(lease.get("expires", 0)) <= self.clock():
            return False
        if lease.get("host") == socket.gethostname() and isinstance(lease.get("pid"), int):
            try:
                os.kill(lease["pid"], 0)
            except ProcessLookupError:
                return False  # its driver died on this host: a notebook's kernel restarted, say
            except PermissionError:
                pass
        return True

    def _in_use(self, lease: dict) -> str:
        until = time.strftime("%H:%M:%S UTC", time.gmtime(float(lease.get("expires", 0))))
        return (f"run_id={self.run_id!r} is running under another driver (pid {lease.get('pid')} on host "
                f"{lease.get('host')}), whose lease in {self.url}/{self.run_id}/{LEASE} lasts until {until} unless it "
                "renews it; wait for that run to end (or for its lease to expire, where its driver died on another "
                "host), or give this run another run_id.")

    def _write_lease(self) -> None:
        self._write(LEASE, {"token": self.token, "host": socket.gethostname(), "pid": os.getpid(),
                            "expires": self.clock() + self.lease_s})

    def _renew(self) -> None:
        while not self._stop.wait(self.lease_s / 3):
            try:
                self._write_lease()
            except Exception as exc:  # noqa: BLE001 - a storage that hiccups: the next renewal may work
                log.warning("sparkhvd: could not renew run %s's lease in %s (%s: %s); another driver could take the "
                            "run once it expires.", self.run_id, self.url, type(exc).__name__, exc)

    # ---- the manifest -------------------------------------------------------------------------

    def commits(self) -> dict:
        """The manifest's commits, ``key -> [meta, ...]`` newest first; {} where the run has none yet."""
        manifest = self._read(MANIFEST)
        return {} if manifest is None else dict(manifest.get("commits") or {})

    def record(self, commits: dict) -> None:
        """Make ``commits`` (``key -> [meta, ...]``, newest first, each naming its file and digest) the manifest."""
        self._write(MANIFEST, {"run_id": self.run_id, "written": self.clock(), "commits": commits})

    def path_of(self, name: str) -> str:
        return f"{self.folder}/{name}"

    def remove_run(self) -> None:
        """Remove the run's whole folder (a run that ended well, keeping no commits)."""
        try:
            self.fs.delete_dir(self.folder)
        except FileNotFoundError:
            pass

    # ---- files --------------------------------------------------------------------------------

    def _read(self, name: str) -> dict | None:
        try:
            with self.fs.open_input_stream(self.path_of(name)) as f:
                return json.loads(f.read())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            if "not found" in str(exc).lower() or "no such file" in str(exc).lower():
                return None
            raise

    def _write(self, name: str, value: dict) -> None:
        """Write ``name`` whole: to a new file, then moved over the old one."""
        with self._lock:
            temporary = self.path_of(f".{name}.{self.token}.tmp")
            with self.fs.open_output_stream(temporary) as f:
                f.write(json.dumps(value).encode())
            self.fs.move(temporary, self.path_of(name))

    def _delete(self, name: str) -> None:
        self._delete_path(self.path_of(name))

    def _delete_path(self, path: str) -> None:
        try:
            self.fs.delete_file(path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.warning("sparkhvd: could not remove %s from run %s's storage: %s", path, self.run_id, exc)
