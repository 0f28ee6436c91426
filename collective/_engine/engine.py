"""The background engine: one thread per process negotiates every collective by name, then starts it.

Any thread submits an op (user code, autograd hooks, TensorFlow's threads) and gets a ``Handle``
at once (``ops.py``). The engine thread sends the op's ``Request`` to its set's coordinator (the
set's lowest rank, ``coordinator.py``; ``negotiate.Table`` decides there), receives the
``Answer``s, and carries them out in the order the coordinator gave, so every member starts the
same data ops (c10d, asynchronous) in the same order, whatever order they were submitted in.
``Handle.wait`` waits for the answer, then for the data. Control traffic is a star: each member
talks only to its coordinator, so an op costs 2(n-1) small frames across a set of n, not n(n-1).

Small reductions ride in the control frames (inline): the coordinator reduces the members' bytes
in rank order and sends every member the same result, so no data op runs at all; in a set of two
each member works them out itself (``pair.py``). Ops that are ready together with one fusion key
run as one data op (``fusion.py``); with a cycle time the coordinator answers at most once per
cycle, so more of them are ready together. Ranks inside ``join()`` stand in with zeros
(``join.py``). This module is the thread loop: submitting, the turns, reading and sending frames,
carrying out answers, and failing every op of a set whose links broke. Nothing here imports torch.
"""

from __future__ import annotations

import selectors
import socket
import threading
import time
import traceback
from typing import Callable

from ..._common import progress as _progress
from ..._common.op_names import JOIN
from . import coordinator, pair
from . import timeline as _timeline
from .channel import PeerChannel
from .fusion import carry_out_fused
from .join import finish_join, stand_in
from .link import Link, Missing
from .mesh import MeshError
from .messages import ERROR, VALUE, Answer, Request, decode_frame, encode_frame
from .ops import Handle, HorovodInternalError, Op, fail, in_named_scope, launch, scoped_name


class Engine:
    """The process's engine thread and every set's negotiation."""

    def __init__(self, rank: int, max_payload: int, *, zeros_for_joined_rank: Callable, reduce: Callable,
                 device=None, fusion_threshold: int = 0, cycle_time: float = 0.0, cache_capacity: int = 1024):
        self.rank = rank
        self._cache_capacity = cache_capacity  # request definitions a link keeps (``RequestCache``)
        self._fusion_threshold = fusion_threshold  # bytes; the coordinators fuse ready ops up to it
        self._cycle = cycle_time  # seconds: a coordinator answers a set at most once per cycle (0: at once)
        self._deferred: float | None = None  # the earliest time a coordinator's deferred answer is due
        self._sending = False  # a link has queued bytes its socket has not taken yet
        self._device = device  # the CUDA device the engine thread starts NCCL ops on (None: no GPU)
        self._max_payload = max_payload
        self._zeros_for_joined_rank = zeros_for_joined_rank  # (Layout, c10d group) -> works: a joined rank's part
        self._reduce = reduce  # (Layout, payloads in set order) -> bytes: an inline op's reduction
        self._links: dict = {}
        self.paired_reductions = 0  # small reductions this rank worked out itself, in a set of two (``pair.py``)
        self.fast_path = True  # blocking small reductions in a set of two may skip the turns (``pair_now``)
        self.reduced_now = 0  # how many did (``pair_now``)
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
        """Hand the engine one set's links (made by ``mesh.Endpoint``); ``group`` is its c10d group."""
        channels = {peer: PeerChannel(sock, peer, self._max_payload) for peer, sock in sockets.items()}
        link = Link(link_id, list(members), self.rank, channels, ranks, self._fusion_threshold, self._cache_capacity)
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
        if op.name is None and in_named_scope():
            op.name = scoped_name()
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
            full = JOIN if op.kind == JOIN else base if base is not None else link.unnamed(op.kind)
            if full in link.in_flight:
                raise ValueError(f"another {op.kind} named {op.name!r} is already in flight on this rank; synchronize "
                                 "it before reusing the name, or give this one another name.")
            link.in_flight.add(full)
            handle.request = op.request(full)
            handle.trace = full
            _timeline.negotiate_start(full, op.kind, handle.started)
            handle._check = _progress.begin_check(op.kind, op.name, link.ranks, link_id, full)
            _progress.attach(handle._check, Missing(link, full))
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

    def pair_now(self, link_id: int, kind: str, name: str | None, template: Request, data, build_op: Callable):
        """A blocking small reduction in a set of two, done in this thread where the engine has nothing else to do
        (``pair.py``): send this rank's request and bytes as the turns would, wait for the other member's, and
        reduce the two in set order. Returns the result's bytes; or a ``Handle`` the engine took over (``build_op()``
        made its ``Op``) when anything else came first, which the caller synchronizes; or None where the path does
        not apply (the caller submits the op as usual): not with a cycle time (whose answers wait for their cycle),
        nor while a timeline records. ``template``: the op's request, named afresh here."""
        link = self._links.get(link_id)
        if (not self.fast_path or self._cycle or link is None or not link.is_pair or _timeline.recording()
                or in_named_scope()
                or (name is not None and f"{kind}.{name}" in link.in_flight)  # the usual path refuses it
                or not self._turn_lock.acquire(blocking=False)):
            return None
        try:
            if self._woken:
                self._drain_wake()  # a byte left over from earlier work: from now on one means another thread's op
            with self._lock:
                full = f"{kind}.{name}" if name is not None else link.unnamed(kind, take=False)
                if self._busy() or not pair.idle(link, full):
                    return None
                if name is None:
                    link.unnamed(kind)
                link.in_flight.add(full)
            request, check, frames, sent = template.instance(full, None, template.inline), None, [], False
            try:  # from here on the op is this rank's to finish: the engine takes it over on any exception
                check = _progress.begin_check(kind, name, link.ranks, link_id, full)
                channel, encoder, decoder = pair.other(link)
                meta = encode_frame([encoder.encode(request)])
                channel.send(meta, bytes(data))  # a copy: the result overwrites the tensor ``data`` views
                sent = True
                out_at = channel.queued
                if channel.pending():  # the socket took part of the frame: the engine's turns send the rest
                    theirs = None
                elif (held := pair.held(link, full)) is not None:  # the other member's, read with an earlier frame
                    theirs = pair.take(link, request, held)
                else:
                    frames = pair.await_other(link, channel, self._wake_r, pair.WAIT, check)
                    theirs = pair.matching(link, frames, request, decoder) if frames else None
            except MeshError as exc:
                handle = self._adopt(link, build_op(), request, check, frames, sent)
                self._break(link, str(exc), notify=True)
                return handle
            except BaseException:  # Ctrl-C: the engine carries the op on, as ``drive`` leaves it
                self._adopt(link, build_op(), request, check, frames, sent)
                raise
            if theirs is None:
                return self._adopt(link, build_op(), request, check, frames, sent, out_at)
            try:
                mine_first = link.table is not None
                return self._reduce(request.layout, [data, theirs] if mine_first else [theirs, data])
            finally:
                _progress.end(check)
                link.in_flight.discard(full)
                self.reduced_now += 1
                if len(frames) > 1:  # the other member's next frames: the engine's, as if a turn had read them
                    self._received(link, channel, frames[1:])
        finally:
            self._turn_lock.release()

    def _adopt(self, link: Link, op: Op, request: Request, check, frames: list, sent: bool,
               out_at: float = float("inf")) -> Handle:
        """The engine takes over an op of ``pair_now``, with the frames read since: its request sent (as if a turn
        had taken and sent it), or, interrupted before, not (as if submitted). Returns its handle."""
        handle = Handle(op, link, self)
        if check is None:
            check = _progress.begin_check(op.kind, op.name, link.ranks, link.link_id, request.name)
        handle.request, handle.trace, handle._check, handle._out_at = request, request.name, check, out_at
        _progress.attach(check, Missing(link, request.name))
        with self._lock:
            self._unanswered += 1
            self._work.notify()
        if not sent:
            self._accept(link, handle)
            return handle
        link.waiting[request.name] = handle
        if link.table is not None:
            link.table.add(self.rank, request, op.inline)
        else:
            peer = link.peer_in.pop(request.name, None)  # the coordinator's, held: the two disagree
            if peer is not None:
                pair.claim(link, handle, *peer)
        channel, _, _ = pair.other(link)
        self._received(link, channel, frames)
        if link.broken is None:
            self._progress(link)  # what a turn does after taking an op: answer what is ready, send what waits
            with self._lock:
                self._sending = self._sending or channel.pending()
        return handle

    def _received(self, link: Link, channel: PeerChannel, frames: list) -> None:
        """Frames read from ``channel``, into the set's negotiation."""
        try:
            for meta, payload in frames:
                frame = decode_frame(meta)
                if link.table is not None:
                    coordinator.take_requests(link, channel.peer, frame.requests, payload)
                else:
                    self._answers(link, frame, payload)
        except MeshError as exc:
            self._break(link, str(exc), notify=True)

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
            if link.broken is None and link.registered:  # a set added since ``_take``: its channels on the next turn
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
                link.registered = True
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

    def _accept(self, link: Link, handle: Handle) -> None:
        request = handle.request
        link.waiting[request.name] = handle
        if link.table is not None:
            link.table.add(self.rank, request, handle.op.inline, _timeline.wall_us() if _timeline.recording() else None)
            if link.is_pair and handle.op.inline is not None and not request.argument_error:
                link.peer_out.append((request, handle.op.inline))
        else:
            link.outbox.append(handle)
            peer = link.peer_in.pop(request.name, None)
            if peer is not None:
                pair.claim(link, handle, *peer)

    def _serve(self, link: Link, sock, mask: int) -> None:
        if link.broken is not None:
            return
        channel = next(c for c in link.channels.values() if c.sock is sock)
        try:
            if mask & selectors.EVENT_WRITE:
                channel.flush()
            if mask & selectors.EVENT_READ:
                self._received(link, channel, channel.receive())
        except MeshError as exc:
            self._break(link, str(exc), notify=True)

    def _progress(self, link: Link) -> None:
        """Send what waits to be sent; on the coordinator, answer what is ready."""
        try:
            if link.table is not None:
                ready, due_at = coordinator.due(link, self._cycle)
                if due_at is not None:
                    self._deferred = due_at if self._deferred is None else min(self._deferred, due_at)
                if ready or link.peer_out:
                    answers = coordinator.answer(link, ready, self._reduce)
                    if answers:
                        _timeline.cycle()
                        for answer, result in answers:
                            self._carry_out(link, answer, result)
            else:
                channel = link.channels[link.coordinator]
                if link.outbox:
                    outbox, link.outbox = link.outbox, []
                    requests = [link.cache.encode(h.request) for h in outbox]
                    blob = b"".join(bytes(memoryview(h.op.inline).cast("B")) for h in outbox if h.op.inline is not None)
                    channel.send(encode_frame(requests), blob)
                    for handle in outbox:
                        handle._out_at = channel.queued
                if link.pair_now:
                    self.paired_reductions += pair.work_out_claimed(link, channel, self._reduce)
            for channel in link.channels.values():
                events = selectors.EVENT_READ | (selectors.EVENT_WRITE if channel.pending() else 0)
                if events != channel.events:  # a system call each: only when it changes
                    self._selector.modify(channel.sock, events, link)
                    channel.events = events
        except MeshError as exc:
            self._break(link, str(exc), notify=True)

    def _answers(self, link: Link, frame, payload) -> None:
        """On a member: carry out the coordinator's answers, in its order (in a pair, first take its requests)."""
        if frame.abort is not None:
            self._break(link, frame.abort, notify=False)
            return
        _timeline.cycle()
        offset = pair.take_from_coordinator(link, frame.requests, payload) if frame.requests else 0
        for answer in frame.answers:
            size = answer.result
            result = payload[offset:offset + size] if size else None
            offset += size
            for name in answer.names:  # answered without pairing (the two disagree, or this rank stood in)
                link.peer_in.pop(name, None)
            self._carry_out(link, answer, result)

    def _carry_out(self, link: Link, answer: Answer, result) -> None:
        if answer.ready_us is not None:
            for name in answer.names:
                _timeline.ready(name, answer.ready_us, link.members[0])
        action = answer.action
        if action == JOIN:
            finish_join(link, answer)
            return
        if len(answer.names) > 1:
            carry_out_fused(link, answer)
            return
        handle = link.waiting.pop(answer.names[0], None)
        if action == ERROR:
            if handle is not None:
                error_class = ValueError if answer.error_type == VALUE else HorovodInternalError
                fail(handle, error_class(answer.error))
            return
        if handle is None:
            if answer.joined and self.rank in answer.joined:
                stand_in(link, answer, self._zeros_for_joined_rank)
            return
        launch(handle, answer, result)

    def _break(self, link: Link, why: str, *, notify: bool) -> None:
        """The set's links failed: every op waiting on them fails, and the coordinator tells the others."""
        if link.broken is None:
            link.broken = why
            if notify and link.table is not None:
                for channel in link.channels.values():
                    try:
                        channel.send(encode_frame(abort=why))
                    except MeshError:
                        pass
        for handle in [*link.waiting.values(), *(claimed for claimed, _, _ in link.pair_now)]:
            fail(handle, MeshError(f"{handle.kind} failed: {link.broken}"))
        link.waiting.clear()
        link.peer_in.clear()
        link.pair_now.clear()
        link.peer_out.clear()
