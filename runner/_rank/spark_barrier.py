"""``BarrierTaskContext.barrier()`` and ``allGather()`` in a rank, over the run's rendezvous store on the driver.

Spark's own go through its BarrierCoordinator, which a rank (a process of its own, not the Spark task) cannot reach.
These keep its semantics: every task of the stage makes the same calls in the same order, and the k-th call of each
is one sync (an "epoch"); a sync finishes once every task has reached it, ``allGather`` returning every task's
message in partition order; ``barrier()`` in one task and ``allGather()`` in another fail every task of the sync.

A sync is three requests per task and, for the last task to arrive, one per task more (O(n) for the stage):

- each task sets ``<prefix><epoch>/<partition>`` to its call and message, then adds 1 to ``<prefix><epoch>/count``;
- the task whose add makes it n reads the n entries, deletes them and the previous sync's keys (every task has
  read those: each has reached this sync), and sets ``<prefix><epoch>/done`` to the outcome;
- every task waits for ``done``.

The wait ends when the run does (the driver aborts it: RunAborted), or after ``timeout`` (Spark's default
``spark.barrier.sync.timeout``, 365 days). Before that, sparkhvd's stall check sees it as a collective in flight:
after ``HOROVOD_STALL_CHECK_TIME_SECONDS`` the driver names the ranks in it and what the others do instead, and
``HOROVOD_STALL_SHUTDOWN_TIME_SECONDS`` ends such a run.
"""

from __future__ import annotations

import json
import threading
from typing import Callable

from ..._common import driver_messages as dm
from ..._common import progress as _progress
from ..._common.client import ServiceClient, ServiceError

BARRIER, ALL_GATHER = "BARRIER", "ALL_GATHER"  # Spark's names for the two (RequestMethod)
CALLS = {BARRIER: "barrier()", ALL_GATHER: "allGather()"}
SYNC_TIMEOUT_S = 365 * 24 * 3600.0  # Spark's default spark.barrier.sync.timeout
LINK = -3  # the stall report's number for these syncs (process sets count from 0; hvd.init's rendezvous is -2)


class BarrierSyncError(RuntimeError):
    """A ``barrier()`` or ``allGather()`` that cannot finish: the tasks called different ones, or not all came."""


class SparkBarrier:
    """The syncs of one task of a barrier stage: ``sync`` is ``barrier()`` and ``allGather()``. Thread-safe: one sync
    at a time, as in Spark. ``connect``: a new connection to the driver service, made at the first sync."""

    def __init__(self, connect: Callable[[], ServiceClient], *, stage: int, partition: int, tasks: int,
                 timeout: float | None = SYNC_TIMEOUT_S):
        self._connect = connect
        self._client: ServiceClient | None = None
        self.stage, self.partition, self.tasks, self.timeout = stage, partition, tasks, timeout
        self._prefix = f"spark.barrier/{stage}/"
        self._epoch = 0
        self._lock = threading.Lock()

    def sync(self, method: str, message: str = "") -> list[str]:
        """Wait until every task of the stage has made its next sync; every task's message, by partition.

        Raises:
            BarrierSyncError: the tasks made different calls (barrier() and allGather()), or not every task came
                within ``timeout``.
            RunAborted: the run ended (another rank failed) while this task waited.
        """
        with self._lock:
            if self._client is None:
                self._client = self._connect()
            epoch, self._epoch = self._epoch, self._epoch + 1
            waiting = _progress.begin_check(f"BarrierTaskContext.{CALLS[method]}", None, None, LINK)
            try:
                outcome = self._sync(self._client, epoch, method, message)
            finally:
                _progress.end(waiting)
        methods = outcome["methods"]
        if len(set(methods)) > 1:
            raise BarrierSyncError(self._mixed(epoch, methods))
        return outcome["messages"]

    def _key(self, epoch: int, name) -> str:
        return f"{self._prefix}{epoch}/{name}"

    def _sync(self, client: ServiceClient, epoch: int, method: str, message: str) -> dict:
        client.ask(dm.StoreSet(key=self._key(epoch, self.partition)), json.dumps([method, message]).encode())
        arrived = dm.decode(dm.StoreValue, client.ask(dm.StoreAdd(key=self._key(epoch, "count"), amount=1)).meta).value
        if arrived == self.tasks:
            self._finish(client, epoch)
        try:
            return json.loads(client.ask(dm.StoreGet(key=self._key(epoch, "done"), timeout=self.timeout)).blob)
        except ServiceError as exc:  # the store's only refusal of a get: its timeout
            raise BarrierSyncError(self._late(client, epoch, method)) from exc

    def _finish(self, client: ServiceClient, epoch: int) -> None:
        """The last task to arrive: gather every task's entry, clear them and the previous sync, publish the outcome."""
        entries = [json.loads(client.ask(dm.StoreGet(key=self._key(epoch, p), timeout=self.timeout)).blob)
                   for p in range(self.tasks)]
        stale = [self._key(epoch, p) for p in range(self.tasks)]
        if epoch:
            stale += [self._key(epoch - 1, "count"), self._key(epoch - 1, "done")]
        for key in stale:
            client.ask(dm.StoreDelete(key=key))
        outcome = {"methods": [m for m, _ in entries], "messages": [text for _, text in entries]}
        client.ask(dm.StoreSet(key=self._key(epoch, "done")), json.dumps(outcome).encode())

    def _where(self, epoch: int) -> str:
        return f"sync {epoch} (the {_nth(epoch + 1)} barrier() or allGather() call) of Stage {self.stage}"

    def _mixed(self, epoch: int, methods: list) -> str:
        by_call: dict = {}
        for partition, method in enumerate(methods):
            by_call.setdefault(CALLS[method], []).append(partition)
        called = " and ".join(f"{_partitions(ps)} called {call}" for call, ps in by_call.items())
        return (f"Different barrier sync types found for {self._where(epoch)}: {called}. Please use the same barrier "
                "sync type within a single sync: every task of a barrier stage must make the same barrier() and "
                "allGather() calls, in the same order.")

    def _late(self, client: ServiceClient, epoch: int, method: str) -> str:
        came = [p for p in range(self.tasks)
                if dm.decode(dm.StoreValue, client.ask(dm.StoreCheck(keys=[self._key(epoch, p)])).meta).value]
        missing = [p for p in range(self.tasks) if p not in came]
        return (f"The coordinator didn't get all barrier sync requests for {self._where(epoch)} within "
                f"{self.timeout:g} second(s): {_partitions(came)} reached it, {_partitions(missing)} did not. Every "
                f"task of a barrier stage must call barrier() and allGather() the same number of times; "
                f"partition {self.partition} called {CALLS[method]} here.")


def _partitions(ps: list) -> str:
    return f"partition{'s' if len(ps) != 1 else ''} {','.join(map(str, ps)) or 'none'}"


def _nth(n: int) -> str:
    return f"{n}{'th' if 10 <= n % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"
