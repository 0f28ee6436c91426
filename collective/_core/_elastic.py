"""Horovod's elastic state, the same for every framework (``horovod/common/elastic.py``).

A ``State`` holds what training must not lose: ``commit()`` saves it, ``restore()`` goes back to
the last commit, ``sync()`` makes every rank equal to rank 0. ``run`` wraps the training loop:
it syncs the state, then runs the loop.

A commit is kept in this process's memory, as in Horovod, and inside a HorovodRunner run rank 0
also sends it off the ranks, to the driver or a ``commit_dir`` (``_common/commits.py``). A failed
collective (``HorovodInternalError``) ends this attempt: instead of Horovod's shutdown and init in the
same processes, HorovodRunner(max_restarts=) relaunches every rank, and ``run`` in the new processes
loads the newest commit on rank 0 before its first sync (``_resume``).
"""

from __future__ import annotations

import copy
import functools
import itertools
import queue

from ..._common import commits as _commits
from ..._common import context as _context
from ..._common import metrics as _metrics
from ..._common.commits import HostUpdateResult, RanksChanged
from ._basics import init, shutdown, size

_keys = itertools.count()  # states in the order this process creates them: the same in every attempt
_FIELD_TYPES = (bool, int, float, str)


class HostsUpdatedInterrupt(RuntimeError):
    """Hosts were added or removed: every rank leaves the loop at the same commit and resets (Horovod's class).

    ``skip_sync``: only hosts were removed, so the remaining ranks' state is already in sync.
    """

    def __init__(self, skip_sync: bool = False, *, relaunch: bool = False):
        super().__init__("hosts were added or removed; every rank resets at this commit")
        self.skip_sync = skip_sync
        self.relaunch = relaunch  # the HorovodRunner driver said it can grow the run: it relaunches every rank


class State:
    """What training must keep: saved by ``commit()``, put back by ``restore()``, made equal by ``sync()``.

    ``bcast_object(obj)`` returns rank 0's ``obj`` on every rank; ``get_rank()`` is this rank.
    """

    def __init__(self, bcast_object, get_rank):
        self._bcast_object = bcast_object
        self._rank = get_rank
        self._host_messages: queue.Queue = queue.Queue()
        self._last_updated_timestamp = 0
        self._reset_callbacks: list = []
        self._key = f"{type(self).__name__}-{next(_keys)}"  # which commit off the ranks is this state's
        self._seq = 0  # commits made, in every attempt of the run
        self._resumed = False
        self._deferred = (0, 0)  # (timestamp, update) of a relaunch heard outside a commit: it waits for the next

    def register_reset_callbacks(self, callbacks) -> None:
        """Functions to call after a reset (ranks added or removed), e.g. to rescale the learning rate."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        self._host_messages = queue.Queue()
        self.reset()
        for callback in self._reset_callbacks:
            callback()

    def on_hosts_updated(self, timestamp: float, update: int) -> None:
        """A message that hosts changed (``update``: a ``HostUpdateResult``)."""
        self._host_messages.put((timestamp, update))

    def commit(self) -> None:
        """Save the state, then check for host changes (``HostsUpdatedInterrupt``, on every rank at once).

        A commit copies the state, from the GPU too: commit every few batches rather than every one.
        """
        self.save()
        _metrics.committed()
        self._publish()
        self._check_host_updates(at_commit=True)

    def _publish(self) -> None:
        """Inside a HorovodRunner run, send rank 0's commit off the ranks (``_common/commits.py``)."""
        self._seq += 1
        if _context.current() is None:
            return
        self._send({"key": self._key, "seq": self._seq, "size": size(), "fields": self._fields(),
                    "before_resume": not self._resumed})

    def _send(self, meta: dict) -> None:
        """Every rank: send this commit off the ranks; rank 0 sends it (a sharded state's ranks write theirs)."""
        if self._rank() == 0:
            _commits.publish(meta, self._snapshot(), self.on_hosts_updated)

    def _settle(self) -> None:
        """Every rank, the loop ended or leaves for new ranks: wait for this state's commits still being written."""

    def _read_shards(self, meta: dict) -> None:
        """Every rank: load its part of a sharded commit (what ``_send`` wrote)."""

    def _fields(self) -> dict:
        """Plain values to name a commit by in the driver's messages (epoch, batch)."""
        return {}

    def _snapshot(self) -> dict:
        """What ``save()`` kept, picklable; ``_load`` puts it back."""
        return {}

    def _load(self, snapshot: dict) -> None:
        """Make ``snapshot`` (from ``_snapshot``, maybe in another process) what ``save()`` kept, then restore it."""
        self.restore()

    def check_host_updates(self) -> None:
        """Raise ``HostsUpdatedInterrupt`` on every rank if rank 0 has heard that hosts changed since the last check.

        A collective: every rank calls it at the same point (``commit`` does). When the HorovodRunner
        driver is growing the run, every rank leaves for new processes that resume from the last
        commit, so that interrupt waits for the next ``commit()``: leaving here would lose the work
        done since it.
        """
        self._check_host_updates(at_commit=False)

    def _check_host_updates(self, *, at_commit: bool) -> None:
        last, update = self._deferred
        previous = self._last_updated_timestamp
        last = max(last, previous)
        update = HostUpdateResult(update)
        while not self._host_messages.empty():
            timestamp, change = self._host_messages.get()
            if timestamp > last:
                last = timestamp
                update |= change
        previous, last, update, relaunch = self._bcast_object((previous, last, update, _commits.growing))
        if last <= previous:
            return
        if relaunch and not at_commit:
            self._deferred = (last, update)  # the same on every rank: rank 0's values
            return
        self._last_updated_timestamp, self._deferred = last, (0, 0)
        # only removed: the remaining ranks are in sync already; added ones must sync
        raise HostsUpdatedInterrupt(skip_sync=update == HostUpdateResult.removed, relaunch=relaunch)

    def save(self) -> None:
        """Keep a copy of the state (the commit)."""
        raise NotImplementedError

    def restore(self) -> None:
        """Go back to the last commit, undoing what changed since."""
        raise NotImplementedError

    def sync(self) -> None:
        """Make every rank's state rank 0's."""
        raise NotImplementedError

    def reset(self) -> None:
        """Called after ranks were added or removed, before the next sync."""


class ObjectState(State):
    """State of plain Python values, each a keyword argument and then an attribute (``state.epoch``)."""

    def __init__(self, bcast_object, get_rank, **kwargs):
        self._bcast_object = bcast_object
        self._saved_state = kwargs
        self._set_attrs()
        super().__init__(bcast_object=bcast_object, get_rank=get_rank)

    def save(self) -> None:
        self._saved_state = {name: getattr(self, name) for name in self._saved_state}

    def _fields(self) -> dict:
        return {k: v for k, v in self._saved_state.items() if isinstance(v, _FIELD_TYPES) and len(str(v)) <= 40}

    def _snapshot(self) -> dict:
        # A copy: rank 0's Publisher pickles it on its own thread while training changes a list or dict in the state.
        try:
            return {"values": copy.deepcopy(self._saved_state)}
        except Exception:  # noqa: BLE001 - not copyable, so not picklable either: the Publisher says so
            return {"values": dict(self._saved_state)}

    def _load(self, snapshot: dict) -> None:
        self._saved_state = dict(snapshot["values"])
        super()._load(snapshot)

    def restore(self) -> None:
        self._set_attrs()

    def sync(self) -> None:
        if self._saved_state:
            self._saved_state = self._bcast_object(self._saved_state)
            self._set_attrs()

    def _set_attrs(self) -> None:
        for name, value in self._saved_state.items():
            setattr(self, name, value)


def run(func):
    """Run the training loop ``func(state, ...)`` with ``state`` synced from rank 0 first (every API's ``hvd.elastic.run``).

    The loop must not start with a collective of its own: a rank that joins late syncs first.
    ``HostsUpdatedInterrupt`` (raised by ``state.commit()`` on every rank together) resets
    (``shutdown()``, ``init()``) and runs the loop again from the committed state; an exception
    from the user's code ends the run.
    """
    return run_fn(func, _reset)


def _reset() -> None:
    shutdown()
    init()




_RESIZE_FLUSH_S = 300.0  # the commit the relaunched ranks resume from must reach the driver first


def _resume(state: State) -> None:
    """In a restarted HorovodRunner run: rank 0 loads the newest commit made off the ranks, before the first sync.

    Once per state and process: a second ``run`` of the same state goes on from where the first left it;
    a commit made before the first ``run`` does not stop it (the driver keeps the previous attempt's
    commit until this RESTORE). Where the commit was made with another number of ranks, every rank
    runs the reset callbacks (to rescale the learning rate, as after Horovod's reset).
    """
    if state._resumed:
        return
    state._resumed = True
    found = _commits.fetch(state._key, data=state._rank() == 0)
    if found is None:
        return
    meta, snapshot = found
    state._seq = max(state._seq, int(meta["seq"]))
    if meta.get("shards"):
        state._read_shards(meta)
    if snapshot is not None:
        state._load(snapshot)
    if int(meta.get("size", size())) != size():
        state.on_reset()


def run_fn(func, reset):
    """``func(state, ...)`` with ``state`` synced first; after ``HostsUpdatedInterrupt``, ``reset()`` and again."""

    @functools.wraps(func)
    def wrapper(state, *args, **kwargs):
        if not isinstance(state, State):
            raise TypeError(f"hvd.elastic.run: the wrapped function's first argument must be an hvd.elastic state "
                            f"(TorchState, ObjectState, ...), got {type(state).__name__}; call it as loop(state).")
        _resume(state)
        skip_sync = False
        while True:
            try:
                if not skip_sync:
                    state.sync()
                result = func(state, *args, **kwargs)
                state._settle()  # the last commit's shards are written before the loop's caller goes on
                return result
            except HostsUpdatedInterrupt as interrupt:
                state._settle()  # every rank raised it together: the shards on their way are all written
                if interrupt.relaunch:  # every rank leaves here; this commit reaches the driver first
                    _commits.flush(_RESIZE_FLUSH_S)
                    raise RanksChanged() from None
                skip_sync = interrupt.skip_sync
            reset()
            state.on_reset()

    return wrapper
