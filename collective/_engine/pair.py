"""The pair path: in a set of two, each member works out small reductions itself.

The coordinator sends its own small reductions' requests and bytes to the other member as it takes
them (``send_to_other``). The other member reduces the two itself, in set order with the same
function as the coordinator, wherever the two requests agree (``pairable``), so both get the same
bits; the coordinator sends it no answer for them. Each member waits for the other's bytes only:
one trip instead of two. Where the two disagree, the coordinator's answer decides, as for any op.

The other member may send a name's next op before the coordinator has decided the first; the
coordinator's table holds it back until then (``negotiate.Table``).

In the steady state the calling thread does it all (``Engine.pair_now``): where the engine has nothing else to
do, a blocking small reduction sends the frame the turns would send, waits for the other member's, and reduces
the two, with no ``Op``, ``Handle``, queue, table or turn. The frames are the pair path's own, so the other member
needs no help to take part, on either path; anything else that arrives hands the op to the engine as if it had
been sent there (``Engine._adopt``).
"""

from __future__ import annotations

import select
import time

from ..._common import progress as _progress
from . import timeline as _timeline
from .link import Missing
from .messages import OK, Answer, Request, encode_frame
from .ops import Handle, fail, settle


def pairable(first: Request | None, second: Request | None) -> bool:
    """Whether two requests of a set of two make a small reduction that each member can work out alone: both
    inline, of one kind and signature, without an argument error. Then the coordinator's answer, once it has
    both, is OK with both payloads in set order, and it sends none."""
    return (first is not None and second is not None and bool(first.inline) and bool(second.inline)
            and first.kind == second.kind and first.signature == second.signature and not first.argument_error
            and not second.argument_error)


def worked_out_by_other(ready) -> bool:
    """Whether the other member works out the coordinator's ``Ready`` answer itself (so it is not sent)."""
    answer = ready.answer
    return (answer.action == OK and len(answer.names) == 1 and len(ready.requests) == 2
            and pairable(*ready.requests))


def send_to_other(link, ready: list, results: list) -> None:
    """On the coordinator: the other member gets the coordinator's new small reductions (requests and bytes),
    and the answers it does not work out itself."""
    own, link.peer_out = link.peer_out, []
    theirs = [(item.answer, result) for item, result in zip(ready, results) if not worked_out_by_other(item)]
    if own or theirs:  # a copy of the bytes: carrying out the answers afterwards writes the tensors they view
        payload = bytearray().join([*(data for _, data in own), *(r for _, r in theirs if r is not None)])
        meta = encode_frame([link.peer_cache.encode(request) for request, _ in own], [a for a, _ in theirs])
        link.channels[link.members[1]].send(meta, payload)


def take_from_coordinator(link, requests: list, payload) -> int:
    """On the other member: the coordinator's small reductions, each claimed now or once this rank submits its
    own op of the name. Returns where the answers' results start in ``payload``."""
    offset = 0
    for wire in requests:
        request = link.peer_cache.decode(link.coordinator, wire)
        data, offset = payload[offset:offset + request.inline], offset + request.inline
        handle = link.waiting.get(request.name)
        if handle is None:  # not submitted here yet: ``claim`` runs when it is
            link.peer_in[request.name] = (request, data)
        else:
            claim(link, handle, request, data)
    return offset


def claim(link, handle: Handle, request: Request, data) -> None:
    """The other member holds the coordinator's request and its own for one name: where the two agree, the op is
    this rank's to work out, once its own request has left (the coordinator needs its bytes, and carrying the op
    out writes the tensor they view); else the coordinator's answer decides."""
    if pairable(request, handle.request):
        link.waiting.pop(handle.request.name, None)  # the name's next request from the coordinator is its next op
        if _timeline.recording():  # both requests are here: its wait for its peer is over
            _timeline.ready(handle.request.name, _timeline.wall_us(), link.members[1])
        link.pair_now.append((handle, request, data))


def work_out_claimed(link, channel, reduce) -> int:
    """Work out each claimed op whose own request has left through ``channel`` (not this rank's later requests,
    which the coordinator may not read before this op is done). Returns how many were worked out."""
    done, i = 0, 0
    while i < len(link.pair_now):
        handle, request, data = link.pair_now[i]
        if channel.sent >= handle._out_at:
            del link.pair_now[i]
            done += _work_out(handle, request, data, reduce)
        else:
            i += 1
    return done


def _work_out(handle: Handle, request: Request, data, reduce) -> bool:
    """Reduce the coordinator's bytes and this rank's, as the coordinator does (``coordinator.inline_results``):
    the same function, in set order. True when the op started."""
    mine = handle.request
    answer = Answer([mine.name], OK, [request.rank_value, mine.rank_value])
    try:
        result = reduce(request.layout, [data, handle.op.inline])
        works, finish = handle.op.launch(answer, result)
    except BaseException as exc:  # noqa: BLE001 - the caller's synchronize raises it
        fail(handle, exc)
        return False
    settle(handle, works, finish)
    return True


# ---- the calling thread's path (``Engine.pair_now``) -----------------------------------------------------------

WAIT = 0.5  # seconds the calling thread waits for the other member's frame before the engine takes the op over


def idle(link, name: str) -> bool:
    """Whether nothing of ``link`` waits in the engine (no op, no request or bytes held, nothing still to send)
    but, maybe, the other member's request for ``name`` itself, read with an earlier frame."""
    table = link.table
    if table is not None:
        if not table.lone(name):
            return False
    elif link.peer_in and (len(link.peer_in) > 1 or name not in link.peer_in):
        return False
    return (link.broken is None and link.registered and not link.waiting and not link.pair_now and not link.outbox
            and not link.peer_out and not any(channel.pending() for channel in link.channels.values()))


def held(link, name: str):
    """The other member's (request, bytes) for ``name`` where they are here already (read with an earlier frame)."""
    return link.table.held(name, link.members[1]) if link.table is not None else link.peer_in.get(name)


def take(link, request: Request, theirs: tuple):
    """The other member's held bytes for ``request`` where the two agree, taken out of where the engine holds them;
    else None (they stay, for the engine's answer)."""
    if not pairable(theirs[0], request) or len(theirs[1]) != theirs[0].inline:
        return None
    if link.table is not None:
        link.table.forget(request.name)
    else:
        del link.peer_in[request.name]
    return theirs[1]


def other(link) -> tuple:
    """The other member's channel, and the caches this member encodes its requests with and decodes the other's."""
    if link.table is not None:
        return link.channels[link.members[1]], link.peer_cache, link.cache
    return link.channels[link.coordinator], link.cache, link.peer_cache


def await_other(link, channel, wake, timeout: float, check) -> list:
    """The frames from the other member, as soon as any have come whole; none after ``timeout`` seconds, or as
    soon as ``wake`` (the engine's wake-up socket) says another thread has work for the engine. ``check``: the
    op's stall report entry, told who is missing once the op waits."""
    frames = channel.receive()
    if frames:
        return frames
    _progress.attach(check, Missing(link, check[4][1]))
    poll = link.poll
    if poll is None:
        poll = link.poll = select.poll()
        poll.register(channel.sock, select.POLLIN)
        poll.register(wake, select.POLLIN)
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return frames
        events = poll.poll(left * 1000)
        if any(fd != channel.sock.fileno() for fd, _ in events):
            return channel.receive()
        frames = channel.receive()
        if frames:
            return frames


def matching(link, frames: list, request: Request, decoder):
    """The other member's bytes for ``request`` where the first frame is just its agreeing request (as the pair
    path pairs them), else None."""
    meta, payload = frames[0]
    wires = meta.get("r")
    if len(meta) != 1 or wires is None or len(wires) != 1:
        return None
    theirs = decoder.decode(link.members[1] if link.table is not None else link.coordinator, wires[0])
    if theirs.name != request.name or not pairable(theirs, request) or len(payload) != theirs.inline:
        return None
    return payload
