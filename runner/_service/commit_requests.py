"""Elastic commits through the driver service: rank 0 commits its state, a restarted attempt restores
it (``_service/commit_store.py`` keeps them), and rank 0 learns with each commit that the run can grow.

Part of ``DriverService`` (``_service/service.py``), whose state and lock these handlers use.
"""

from __future__ import annotations

import logging
import time

from ..._common.commits import HostUpdateResult
from ..._common.driver_messages import Commit, Committed, Restore, Restored, encode
from ..._common.protocol import AuthenticatedChannel, Kind

log = logging.getLogger("sparkhvd.service")


class CommitHandlers:
    """COMMIT and RESTORE, ``announce_growth`` and ``announce_preemption``. Uses ``DriverService``'s ``cv``, ``commits``, ``attempt``,
    ``hosts_updated``, ``finished`` and ``_on_restore``."""

    def announce_growth(self) -> None:
        """Tell rank 0, in the answer to its next commit, that the run can have more ranks (Horovod's hosts added)."""
        with self.cv:
            if self.hosts_updated is None:
                self.hosts_updated = [time.time(), int(HostUpdateResult.added)]

    def announce_preemption(self) -> None:
        """Tell rank 0, in the answer to its next commit, that hosts are going (Horovod's hosts removed): every
        rank leaves at the commit after it, for the driver to relaunch them on the executors Spark keeps."""
        with self.cv:
            stamp, update = self.hosts_updated or (time.time(), 0)
            self.hosts_updated = [stamp, int(HostUpdateResult(update) | HostUpdateResult.removed)]

    def _commit(self, channel: AuthenticatedChannel, commit: Commit, blob: bytes, peer: str) -> None:
        key = commit.key
        with self.cv:
            if self.finished:  # a frame received as the attempt ended: the next attempt's commits must not meet it
                return self._refuse(channel, f"commit {commit.seq} of {key} arrived after this attempt had "
                                             "ended, so it was not kept.")
            # A restarted attempt's commit made before rank 0 loaded the previous one (a commit before
            # hvd.elastic.run) must not replace it: the RESTORE would resume from the start. Rank 0 says so in the
            # commit, as the frame may arrive after another rank's RESTORE, or after rank 0's own.
            stale = commit.before_resume and self.commits.attempt_of(key) not in (None, self.attempt)
            update = self.hosts_updated
        if stale:
            return channel.send(Kind.OK, encode(Committed(kept=False)))
        try:
            meta = encode(commit)
            del meta["before_resume"]  # how the commit came, not what it is: not kept, listed or written
            kept = self.commits.put(meta, blob, attempt=self.attempt)
        except OSError as exc:
            log.warning("sparkhvd driver service: could not keep commit %s of %s: %s", commit.seq, key, exc)
            return self._refuse(channel, f"the driver could not keep commit {commit.seq} of {key} "
                                         f"({len(blob)} bytes): {exc}; free space there, or pass "
                                         "HorovodRunner(commit_dir=URL) to keep commits on shared storage.")
        channel.send(Kind.OK, encode(Committed(kept=kept, hosts_updated=update or None)))

    def _restore(self, channel: AuthenticatedChannel, restore: Restore, blob: bytes, peer: str) -> None:
        commit = self.commits.get(restore.key)
        if restore.data:
            on_restore, self._on_restore = self._on_restore, None
            if on_restore is not None:
                on_restore(None if commit is None else commit.meta)
        if commit is None:
            return channel.send(Kind.OK, encode(Restored(found=False)))
        channel.send(Kind.OK, encode(Restored(found=True, commit=commit.meta)), commit.data() if restore.data else b"")
