"""The background engine: one thread per process negotiates every collective by name, then starts it.

Any thread submits an op (user code, autograd hooks, TensorFlow's threads) and gets a ``Handle``
at once. The engine thread sends the op's request to its set's coordinator (the set's lowest
rank; ``_negotiate.Table`` decides there), receives the answers, and carries them out in the
order the coordinator gave, so every member starts the same data ops (c10d, asynchronous) in
the same order, whatever order they were submitted in. ``Handle.wait`` waits for the answer,
then for the data. Control traffic is a star: each member talks only to its coordinator, so an
op costs 2(n-1) small frames across a set of n, not n(n-1).

Small reductions ride in the control frames (``inline``): the coordinator reduces the members'
bytes in rank order and sends every member the same result, so no data op runs at all. In a set
of two, the coordinator sends its own small reductions' requests and bytes to the other member
as it takes them, and the other member reduces the pair itself, in the same order with the same
function, wherever the two requests agree (``_negotiate.pairable``); the coordinator then sends
no answer for it. Each member waits for the other's bytes only, one trip instead of two. Ops that
are ready together with one fusion key run as one data op (``Op.launch_fused``); with a cycle time
the coordinator answers at most once per cycle, so more of them are ready together.

The backend (``collective/_core/_ops.py``) describes each op with an ``Op``: its request, the
bytes it sends inline, and ``launch``, which the engine calls with the answer to start the
data movement. Nothing here imports torch.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import os
import selectors
import socket
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Callable

from ..._common import progress as _progress
from ..._common.op_names import JOIN
from . import timeline as _timeline
from .channel import PeerChannel
from .mesh import MeshError
from .negotiate import RequestCache, Table, pairable

_scope = threading.local()  # .prefix, .count: names for this thread's unnamed ops (``named``)


@contextlib.contextmanager
def named(prefix: str):
    """Unnamed ops this thread submits inside get the names ``prefix.0``, ``prefix.1``, ...

    For TensorFlow graphs, whose threads run independent ops in any order: each graph op gets a
    prefix when the graph is built (alike on every rank), so its collectives pair by that name, not
    by the order in which the threads happened to run them.
    """
    previous = getattr(_scope, "prefix", None), getattr(_scope, "count", None)
    _scope.prefix, _scope.count = prefix, itertools.count()
    try:
        yield
    finally:
        _scope.prefix, _scope.count = previous


class HorovodInternalError(RuntimeError):
    """A collective failed on every rank: the ranks disagreed on it, or a peer failed (Horovod's class)."""


@dataclass
class Op:
    """One collective as the backend describes it to the engine."""

    kind: str
    name: str | None
    signature: str
    description: str
    fact: object = None  # this rank's own fact (``_negotiate``'s ``x``)
    problem: str | None = None
    joinable: bool = False
    inline: object = None  # bytes-like that ride in the request, or None
    launch: Callable | None = None  # (item, inline result) -> (works, finish); in the engine thread
    nbytes: int = 0
    request: dict = field(default_factory=dict)
    fuse: str | None = None  # fusion key: ops of one key ready together may run as one data op
    launch_fused: Callable | None = None  # (ops, item) -> [(works, finish)] per op: them as one data op
    data: object = None  # the backend's own (what ``launch_fused`` reads)


class Handle:
    """An op in flight: negotiated (``_answered``), then its data works, then ``finish`` gives the result."""

    __slots__ = ("op", "name", "kind", "nbytes", "started", "trace", "_answered", "_error", "_works", "_finish",
                 "_result", "_done", "_check", "_link", "_engine", "_waiting", "_out_at", "__weakref__")

    def __init__(self, op: Op, link, engine=None):
        self.op = op
        self.name = op.name
        self.kind = op.kind
        self.nbytes = op.nbytes
        self.started = time.perf_counter() * 1e6  # microseconds, as the timeline counts
        self.trace = f"{op.kind}.{op.name}" if op.name is not None else op.kind  # its name in the timeline
        self._answered = threading.Event()
        self._error: BaseException | None = None
        self._works: list = []
        self._finish: Callable | None = None
        self._result = None
        self._done = False
        self._check = None  # the stall report's entry while the op is negotiated
        self._link = link
        self._engine = engine
        self._waiting = threading.Lock()  # one waiter finishes the op; others then read its result
        self._out_at = float("inf")  # a worker's request has left once its channel's ``sent`` reaches this

    def _fail(self, error: BaseException) -> None:
        self._error = error
        self._settle()

    def _settle(self) -> None:
        """The answer is in (the engine's side): wake whoever waits."""
        if self._answered.is_set():
            return
        if self._engine is not None:
            self._engine._settled()
        _timeline.negotiate_end(self.trace, self.kind)
        self._answered.set()

    def wait(self):
        """The op's result; raises what failed it. The op's name is free again once it is answered: a wait
        interrupted before (Ctrl-C) leaves it taken, since the op is still being negotiated."""
        if self._done:
            return self._result
        with self._waiting:  # ``finish`` scales and copies in place: it must run once, whoever else waits
            if self._done:
                return self._result
            try:
                return self._wait()
            finally:
                if self._link is not None and self._answered.is_set():
                    self._link.in_flight.discard(self.op.request.get("n"))
                _timeline.end(self.trace, self.nbytes)

    def _wait(self):
        if not self._answered.is_set():
            if self._engine is not None:
                self._engine.drive(self)
            self._answered.wait()
        if self._error is not None:
            raise self._error
        if self._works:
            entry = _progress.begin_data(self._check_op(), self.kind, self.name)
            try:
                for work in self._works:
                    work.wait()
            finally:
                _progress.end(entry)
        self._result = self._finish() if self._finish is not None else None
        self._done = True
        return self._result

    def _check_op(self):
        check = self._check
        return None if check is None else tuple(check[:5])

    def is_completed(self) -> bool:
        if self._done:
            return True
        if not self._answered.is_set():
            return False
        return self._error is not None or all(work.is_completed() for work in self._works)

    def __call__(self):
        return self.wait()

    def __repr__(self) -> str:
        state = "done" if self._done else "answered" if self._answered.is_set() else "negotiating"
        return f"<sparkhvd handle {self.op.request.get('n')} {state}>"


class _Link:
    """This rank's side of one set's negotiation: its channels, its ops awaiting answers, and, on the
    coordinator, the table."""

    def __init__(self, link_id: int, members: list, me: int, channels: dict, ranks, fusion_threshold: int,
                 cache_capacity: int):
        self.link_id = link_id
        self.members = members
        self.me = me
        self.ranks = ranks  # the set's ranks for the stall report (None: every rank)
        self.channels = channels  # peer -> PeerChannel: every worker on the coordinator, the coordinator elsewhere
        self.coordinator = members[0]
        self.table = Table(members, fusion_threshold) if me == self.coordinator else None
        self.cache = RequestCache(cache_capacity)  # shortens this worker's requests, or expands the workers'
        self.waiting: dict = {}  # name -> Handle, submitted and not answered yet
        self.outbox: list = []  # (handle, inline bytes) to send to the coordinator
        self.mirrors: list = []  # works this rank started while joined (zeros in the others' reductions)
        self.broken: str | None = None
        self.group = None
        self.unnamed = collections.defaultdict(itertools.count)  # kind -> numbers for its unnamed ops
        self.in_flight: set = set()  # names submitted and not yet synchronized (a name is one op at a time)
        self.next_answer = 0.0  # on the coordinator with a cycle time: the earliest time of its next answer
        self.paired = len(members) == 2  # small reductions are worked out by both members (the pair path)
        self.peer_out: list = []  # on the coordinator of a pair: (request, inline bytes) of its own, to send
        self.peer_in: dict = {}  # on the other member: name -> (coordinator's request, bytes) not yet paired
        self.pair_now: list = []  # on the other member: (handle, request, bytes) to pair once its own request is out
        self.peer_cache = RequestCache(cache_capacity)  # shortens the coordinator's requests to the other member

    def missing(self, name: str):
        return self.table.waiting_for(name) if self.table is not None else None


class Engine:
    """The process's engine thread and every set's negotiation."""

    def __init__(self, rank: int, max_payload: int, *, mirror: Callable, reduce: Callable, device=None,
                 fusion_threshold: int = 0, cycle_time: float = 0.0, cache_capacity: int = 1024):
        self.rank = rank
        self._cache_capacity = cache_capacity  # request definitions a link keeps (``RequestCache``)
        self._fusion_threshold = fusion_threshold  # bytes; the coordinators fuse ready ops up to it
        self._cycle = cycle_time  # seconds: a coordinator answers a set at most once per cycle (0: at once)
        self._deferred: float | None = None  # the earliest time a coordinator's deferred answer is due
        self._sending = False  # a link has queued bytes its socket has not taken yet
        self._device = device  # the CUDA device the engine thread starts NCCL ops on (None: no GPU)
        self._max_payload = max_payload
        self._mirror = mirror  # (item, group of the set) -> works: a joined rank's part in the others' op
        self._reduce = reduce  # (request, payloads in set order) -> bytes: the coordinator's inline reduction
        self._links: dict = {}
        self.paired = 0  # small reductions this rank worked out itself, in a set of two (``_pair``)
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)  # the engine thread waits here while nothing is in flight
        self._turn_lock = threading.Lock()  # held by the one thread doing the engine's work (``_turn``)
        self._unanswered = 0  # ops submitted and not answered yet
        self._queue: list = []  # (link, handle) submitted, not yet taken by a turn
        self._woken = False
        self._closed: str | None = None
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._thread = threading.Thread(target=self._main, name="sparkhvd-engine", daemon=True)
        self._thread.start()

    # ---- any thread --------------------------------------------------------------------------

    def add_link(self, link_id: int, members: list, sockets: dict, ranks, group=None) -> None:
        """Hand the engine one set's links (made by ``_mesh.Endpoint``); ``group`` is its c10d group."""
        channels = {peer: PeerChannel(sock, peer, self._max_payload) for peer, sock in sockets.items()}
        link = _Link(link_id, list(members), self.rank, channels, ranks, self._fusion_threshold,
                     self._cache_capacity)
        link.group = group
        with self._lock:
            self._links[link_id] = link
            self._queue.append((link, None))  # the next turn registers its channels
            self._work.notify()
        self._wake()

    def remove_link(self, link_id: int) -> None:
        with self._lock:
            link = self._links.get(link_id)
            if link is not None:
                self._queue.append((link, "remove"))
                self._work.notify()
        self._wake()

    def submit(self, link_id: int, op: Op, *, sync: bool = False) -> Handle:
        """Queue ``op`` on a set; the handle is answered when every member has submitted its name.

        ``sync``: the caller waits for it at once, and does the engine's work itself meanwhile when no
        other thread is doing it (``drive``): no hand-off to the engine thread and back.
        """
        link = self._links.get(link_id)
        if link is None:
            raise MeshError(f"{op.kind} cannot run: its process set's control links are closed (hvd.shutdown() ran, "
                            "or the set was removed).")
        if op.name is None and getattr(_scope, "prefix", None) is not None:
            op.name = f"{_scope.prefix}.{next(_scope.count)}"
        base = f"{op.kind}.{op.name}" if op.name is not None else None
        handle = Handle(op, link, None)
        with self._lock:  # a failed link fails the op in synchronize, as any failure of a peer does
            if self._closed is not None:
                handle._fail(MeshError(f"{op.kind} cannot run: {self._closed}"))
                return handle
            if link.broken is not None:
                handle._fail(MeshError(f"{op.kind} cannot run: the control links broke in an earlier collective "
                                       f"({link.broken}); restart the job."))
                return handle
            handle._engine = self
            full = JOIN if op.kind == JOIN else base if base is not None else f"{op.kind}.noname.{next(link.unnamed[op.kind])}"
            if full in link.in_flight:
                raise ValueError(f"another {op.kind} named {op.name!r} is already in flight on this rank; synchronize "
                                 "it before reusing the name, or give this one another name.")
            link.in_flight.add(full)
            op.request.update(n=full, k=op.kind, s=op.signature, d=op.description, x=op.fact, p=op.problem,
                              j=op.joinable, i=0 if op.inline is None else memoryview(op.inline).nbytes)
            handle.trace = full
            _timeline.negotiate_start(full, op.kind, handle.started)
            if op.fuse is not None:
                op.request.update(f=op.fuse, b=op.nbytes)
            handle._check = _progress.begin_check(op.kind, op.name, link.ranks, link_id, full)
            _progress.attach(handle._check, _Missing(link, full))
            self._queue.append((link, handle))
            self._unanswered += 1
            if not sync:
                self._work.notify()
        if not sync:
            self._wake()
        return handle

    def drive(self, handle: Handle) -> None:
        """Wait for ``handle``'s answer, doing the engine's work in this thread unless another thread is."""
        if self._turn_lock.acquire(blocking=False):
            try:
                while not handle._answered.is_set():
                    if self._turn():
                        break
            except BaseException:  # Ctrl-C (or a signal handler's exception) while this thread waited in select:
                self._turn_lock.release()  # the engine thread goes on with the turns
                with self._work:
                    self._work.notify()
                self._wake()
                raise
            self._turn_lock.release()
        with self._work:  # async work left (or none of ours done): the engine thread goes on with it
            if self._busy():
                self._work.notify()
        if not handle._answered.is_set():
            self._wake()  # the thread in a turn takes our op from the queue
            handle._answered.wait()

    def drain(self, timeout: float) -> None:
        """Wait (up to ``timeout`` seconds) until every frame queued for a peer has left this process: an op done
        here may still owe a peer its bytes (an answer, or in a pair this rank's request), which a process exit
        would drop. The engine thread sends them; a broken link drops its own."""
        deadline = time.monotonic() + timeout
        while self._closed is None and time.monotonic() < deadline:
            links = list(self._links.values())
            if not any(link.broken is None and channel.pending() for link in links for channel in link.channels.values()):
                return
            time.sleep(0.005)

    def _busy(self) -> bool:
        """Whether the engine has work: ops to take or to answer, frames still to send (an answer larger than
        the socket's buffer goes out over several turns, after every op of this rank is answered), or closing."""
        return bool(self._queue or self._unanswered or self._closed or self._sending)

    def _settled(self) -> None:
        with self._lock:
            self._unanswered -= 1

    def close(self, why: str) -> None:
        """Stop the engine: ops still waiting fail with ``why``."""
        with self._lock:
            if self._closed is not None:
                return
            self._closed = why
            self._work.notify()
        self._wake()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=10)

    def _wake(self) -> None:
        if not self._woken:
            self._woken = True
            try:
                self._wake_w.send(b"\0")
            except OSError:
                pass

    # ---- the engine thread -------------------------------------------------------------------

    def _main(self) -> None:
        try:
            if self._device is not None:
                import torch  # only where there is a GPU: the current device is per thread

                torch.cuda.set_device(self._device)
            closed = False
            while not closed:
                with self._work:
                    while not self._busy():
                        self._work.wait()
                with self._turn_lock:
                    while not closed:
                        closed = self._turn()
                        with self._lock:
                            if not self._busy():
                                break
        except BaseException as exc:  # noqa: BLE001 - a bug here must fail every op, not hang them
            traceback.print_exc()  # on the rank's stderr, which the driver shows
            self._closed = f"the sparkhvd engine thread failed ({type(exc).__name__}: {exc})"
        finally:
            with self._turn_lock:
                with self._lock:  # ops submitted but not taken yet fail too
                    queue, self._queue = self._queue, []
                for _, handle in queue:
                    if isinstance(handle, Handle):
                        handle._fail(MeshError(f"{handle.kind} cannot run: {self._closed or 'hvd.shutdown() ran'}"))
                for link in list(self._links.values()):
                    self._break(link, self._closed or "hvd.shutdown() ran", notify=False)
                    for channel in link.channels.values():
                        channel.close()
                self._selector.close()
                self._wake_r.close()
                self._wake_w.close()

    def _turn(self) -> bool:
        """One round of the engine's work, by whichever thread holds ``_turn_lock``: wait for frames (not while
        submitted ops wait to be taken), read them, take the submitted ops, send and answer what can be.
        True once the engine is closed (every op waiting has failed)."""
        if self._queue or self._closed:  # closing: take it now (the wake byte may have been read already)
            timeout = 0
        else:
            timeout = None if self._deferred is None else max(0.0, self._deferred - time.monotonic())
        self._deferred = None
        for key, mask in self._selector.select(timeout):
            link = key.data
            if link is None:
                self._drain_wake()
            else:
                self._serve(link, key.fileobj, mask)
        if self._take():
            for link in list(self._links.values()):
                self._break(link, self._closed, notify=False)
            return True
        sending = False
        for link in list(self._links.values()):
            if link.broken is None:
                self._progress(link)
                sending = sending or any(channel.pending() for channel in link.channels.values())
        self._sending = sending
        return False

    def _drain_wake(self) -> None:
        # Read the bytes first, then clear the flag, then (in ``_take``) read the queue: an op queued after
        # the flag is cleared sends a byte of its own, and one queued before is in the queue ``_take`` reads.
        try:
            while self._wake_r.recv(4096):
                pass
        except BlockingIOError:
            pass
        self._woken = False

    def _take(self) -> bool:
        """Move submitted ops into their sets; True when the engine must stop."""
        with self._lock:
            queue, self._queue = self._queue, []
            closed = self._closed
        for link, handle in queue:
            if handle is None:
                for channel in link.channels.values():
                    self._selector.register(channel.sock, selectors.EVENT_READ, link)
                    channel.events = selectors.EVENT_READ
            elif handle == "remove":
                self._break(link, "its process set was removed", notify=False)
                for channel in link.channels.values():
                    self._selector.unregister(channel.sock)
                    channel.close()
                with self._lock:
                    self._links.pop(link.link_id, None)
            elif link.broken is not None:
                handle._fail(MeshError(f"{handle.kind} cannot run: the control links broke in an earlier "
                                       f"collective ({link.broken}); restart the job."))
            else:
                self._accept(link, handle)
        return closed is not None

    def _accept(self, link: _Link, handle: Handle) -> None:
        request = handle.op.request
        link.waiting[request["n"]] = handle
        if link.table is not None:
            link.table.add(self.rank, request)
            if link.paired and handle.op.inline is not None and not request.get("p"):
                link.peer_out.append((request, handle.op.inline))
        else:
            link.outbox.append((handle, handle.op.inline))
            peer = link.peer_in.pop(request["n"], None)
            if peer is not None:
                self._claim(link, handle, *peer)

    def _serve(self, link: _Link, sock, mask: int) -> None:
        if link.broken is not None:
            return
        channel = next(c for c in link.channels.values() if c.sock is sock)
        try:
            if mask & selectors.EVENT_WRITE:
                channel.flush()
            if mask & selectors.EVENT_READ:
                for meta, payload in channel.receive():
                    if link.table is not None:
                        self._requests(link, channel.peer, meta, payload)
                    else:
                        self._answers(link, meta, payload)
        except MeshError as exc:
            self._break(link, str(exc), notify=True)

    def _requests(self, link: _Link, peer: int, meta: dict, payload) -> None:
        offset = 0
        for request in meta.get("r", ()):
            request = link.cache.expand(peer, request)
            size = request.get("i") or 0
            request["_payload"] = payload[offset:offset + size]
            offset += size
            link.table.add(peer, request)

    def _progress(self, link: _Link) -> None:
        """Send what waits to be sent; on the coordinator, answer what is ready."""
        try:
            if link.table is not None:
                items = self._decide(link)
                if items or link.peer_out:
                    self._answer_members(link, items)
            else:
                channel = link.channels[link.coordinator]
                if link.outbox:
                    outbox, link.outbox = link.outbox, []
                    requests = [link.cache.shorten(h.op.request) for h, _ in outbox]
                    blob = b"".join(bytes(memoryview(data).cast("B")) for _, data in outbox if data is not None)
                    channel.send({"r": requests}, blob)
                    for handle, _ in outbox:
                        handle._out_at = channel.queued
                i = 0
                while i < len(link.pair_now):  # a claimed op once its own request has left: the coordinator needs
                    handle, request, data = link.pair_now[i]  # its bytes (not this rank's later requests, which
                    if channel.sent >= handle._out_at:        # the coordinator may not read before this op is done)
                        del link.pair_now[i]
                        self._pair(link, handle, request, data)
                    else:
                        i += 1
            for channel in link.channels.values():
                events = selectors.EVENT_READ | (selectors.EVENT_WRITE if channel.pending() else 0)
                if events != channel.events:  # a system call each: only when it changes
                    self._selector.modify(channel.sock, events, link)
                    channel.events = events
        except MeshError as exc:
            self._break(link, str(exc), notify=True)

    def _decide(self, link: _Link) -> list:
        """The coordinator's answers due now: at once, or with a cycle time, at most one batch per cycle (ops that
        become ready within it wait for its end, and are answered, and fused, together)."""
        if not self._cycle:
            return link.table.decide()
        now = time.monotonic()
        if now < link.next_answer:
            self._deferred = link.next_answer if self._deferred is None else min(self._deferred, link.next_answer)
            return []
        items = link.table.decide()
        if items:
            link.next_answer = now + self._cycle
        return items

    def _answer_members(self, link: _Link, items: list) -> None:
        """The coordinator sends the ready ops' answers, and in a pair its own new small reductions, then carries
        the answers out itself. The other member of a pair gets no answer for an op it works out itself."""
        results = self._inline_results(link, items)
        paired = self._paired_items(items) if link.paired else [False] * len(items)
        for item in items:  # the requests the table kept for an item do not travel
            item.pop("_requests", None)
        blob = bytearray().join(r for r in results if r is not None)
        if not link.paired:
            for channel in link.channels.values():
                channel.send({"b": items}, blob)
        else:
            peers, link.peer_out = link.peer_out, []
            meta: dict = {"q": [link.peer_cache.shorten(r) for r, _ in peers]} if peers else {}
            theirs = [(item, r) for item, r, mine in zip(items, results, paired) if not mine]
            if theirs:
                meta["b"] = [item for item, _ in theirs]
            if meta:  # a copy of the bytes: carrying out the answers below writes the tensors they view
                payload = bytearray().join([*(data for _, data in peers), *(r for _, r in theirs if r is not None)])
                link.channels[link.members[1]].send(meta, payload)
        if items:
            self._answers(link, {"b": items}, memoryview(blob))

    @staticmethod
    def _paired_items(items: list) -> list:
        """Which answers the other member of a pair has worked out itself (``_pair``)."""
        return [item["a"] == "ok" and len(item["n"]) == 1 and len(item.get("_requests") or ()) == 2
                and pairable(*item["_requests"]) for item in items]

    def _inline_results(self, link: _Link, items: list) -> list:
        """Reduce each ready inline op's payloads (in set order, the members that submitted it) with this rank's
        own op's reducer: each item's result bytes, or None."""
        results = []
        for item in items:
            requests = item.get("_requests")
            if "m" in item:
                item["m"] = {k: v for k, v in item["m"].items() if not k.startswith("_")}
            if item["a"] != "ok" or not any(q is not None and q.get("i") for q in requests):
                results.append(None)
                continue
            mine = link.waiting.get(item["n"][0])
            payloads = [mine.op.inline if r == self.rank else q["_payload"]
                        for r, q in zip(link.members, requests) if q is not None]
            first = next(q for q in requests if q is not None)
            result = self._reduce(first, payloads)
            item["i"] = len(result)
            results.append(result)
        return results

    @staticmethod
    def _claim(link: _Link, handle: Handle, request: dict, data) -> None:
        """The other member of a pair holds the coordinator's request and its own for one name: where the two agree,
        the op is this rank's to work out (``_pair``), once its own request has left (the coordinator needs its
        bytes, and carrying the op out writes the tensor they view); else the coordinator's answer decides."""
        if pairable(request, handle.op.request):
            link.waiting.pop(handle.op.request["n"], None)  # the name's next "q" is then for its next op
            link.pair_now.append((handle, request, data))

    def _pair(self, link: _Link, handle: Handle, request: dict, data) -> None:
        """Work out a claimed small reduction from the coordinator's request and bytes and this rank's own, as the
        coordinator does (``_inline_results``): the same function, in set order."""
        mine = handle.op.request
        item = {"n": [mine["n"]], "a": "ok", "x": [request.get("x"), mine.get("x")]}
        try:
            result = self._reduce(request, [data, handle.op.inline])
            works, finish = handle.op.launch(item, result)
        except BaseException as exc:  # noqa: BLE001 - the caller's synchronize raises it
            self._end_check(handle)
            handle._fail(exc)
            return
        self.paired += 1
        self._answered(handle, works, finish)

    def _answers(self, link: _Link, meta: dict, payload) -> None:
        """Carry out the coordinator's answers, in its order."""
        if "abort" in meta:
            self._break(link, meta["abort"], notify=False)
            return
        _timeline.cycle()
        offset = 0
        for request in meta.get("q", ()):  # the coordinator's small reductions, in a pair
            request = link.peer_cache.expand(link.coordinator, request)
            size = request["i"]
            data, offset = payload[offset:offset + size], offset + size
            handle = link.waiting.get(request["n"])
            if handle is None:  # not submitted here yet: ``_accept`` pairs it
                link.peer_in[request["n"]] = (request, data)
            else:
                self._claim(link, handle, request, data)
        for item in meta.get("b", ()):
            size = item.get("i") or 0
            result = payload[offset:offset + size] if size else None
            offset += size
            for name in item["n"]:  # answered without pairing (the two disagree, or this rank stood in)
                link.peer_in.pop(name, None)
            self._carry_out(link, item, result)

    def _carry_out(self, link: _Link, item: dict, result) -> None:
        action = item["a"]
        if action == JOIN:
            handle = link.waiting.pop(JOIN, None)
            for work in link.mirrors:
                work.wait()
            link.mirrors = []
            if handle is not None:
                self._answered(handle, [], lambda last=item["x"]: last)
            return
        if len(item["n"]) > 1:
            self._carry_out_fused(link, item)
            return
        handle = link.waiting.pop(item["n"][0], None)
        if action == "err":
            if handle is not None:
                error_class = ValueError if item.get("t") == "value" else HorovodInternalError
                self._end_check(handle)
                handle._fail(error_class(item["e"]))
            return
        if handle is None:
            if self.rank in item.get("J", ()):
                link.mirrors.extend(self._mirror(item, link.group))
            return
        try:
            works, finish = handle.op.launch(item, result)
        except BaseException as exc:  # noqa: BLE001 - the caller's synchronize raises it
            self._end_check(handle)
            handle._fail(exc)
            return
        self._answered(handle, works, finish)

    def _carry_out_fused(self, link: _Link, item: dict) -> None:
        """Ops the coordinator fused (one key, so one backend's kind): one data op for them all."""
        handles = [link.waiting.pop(name) for name in item["n"]]
        try:
            launched = handles[0].op.launch_fused([h.op for h in handles], item)
        except BaseException as exc:  # noqa: BLE001 - each caller's synchronize raises it
            for handle in handles:
                self._end_check(handle)
                handle._fail(exc)
            return
        for handle, (works, finish) in zip(handles, launched):
            self._answered(handle, works, finish)

    def _answered(self, handle: Handle, works: list, finish) -> None:
        self._end_check(handle)
        handle._works, handle._finish = works, finish
        handle._settle()

    @staticmethod
    def _end_check(handle: Handle) -> None:
        if handle._check is not None:
            _progress.end(handle._check)

    def _break(self, link: _Link, why: str, *, notify: bool) -> None:
        """The set's links failed: every op waiting on them fails, and the coordinator tells the others."""
        if link.broken is None:
            link.broken = why
            if notify and link.table is not None:
                for channel in link.channels.values():
                    try:
                        channel.send({"abort": why})
                    except MeshError:
                        pass
        for handle in [*link.waiting.values(), *(claimed for claimed, _, _ in link.pair_now)]:
            self._end_check(handle)
            handle._fail(MeshError(f"{handle.kind} failed: {link.broken}"))
        link.waiting.clear()
        link.peer_in.clear()
        link.pair_now.clear()
        link.peer_out.clear()


class _Missing:
    """The stall report's ``waiting_for``: the members the coordinator has not heard from for a name."""

    __slots__ = ("_link", "_name")

    def __init__(self, link: _Link, name: str):
        self._link, self._name = link, name

    def waiting_for(self):
        return self._link.missing(self._name)


def max_payload() -> int:
    """The largest inline payload of one control frame (the sum of a response's results)."""
    return int(os.environ.get("SPARKHVD_MAX_CONTROL_PAYLOAD", str(64 << 20)))


def run_local(op: Op) -> Handle:
    """``op`` on a set of one: nothing to negotiate, so it starts now, in the caller's thread."""
    if op.problem:
        raise ValueError(op.problem)
    handle = Handle(op, None)
    _timeline.negotiate_start(handle.trace, op.kind, handle.started)
    works, finish = op.launch({"n": [op.name], "a": "ok", "x": [op.fact]}, None)
    handle._works, handle._finish = works, finish
    handle._settle()
    return handle
