"""The coordinator's side of a set (its lowest rank): take the members' requests, decide, answer.

``negotiate.Table`` decides which ops are ready; this module feeds it the requests as frames
arrive, paces its answers by the cycle time, reduces the small reductions whose bytes rode in the
requests (in set order, with the coordinator's own op's reducer, so every member gets the same bits)
and sends the answers: one frame to each member, or in a set of two only what the other member does
not work out itself (``pair.py``). The coordinator then carries out the same answers itself.
"""

from __future__ import annotations

import time

from . import pair
from . import timeline as _timeline
from .messages import OK, encode_frame


def take_requests(link, peer: int, requests: list, payload) -> None:
    """A member's requests as they arrived in one frame, each with its inline bytes, into the table."""
    offset = 0
    at = _timeline.wall_us() if _timeline.recording() else None
    for wire in requests:
        request = link.cache.decode(peer, wire)
        size = request.inline
        link.table.add(peer, request, payload[offset:offset + size] if size else None, at)
        offset += size


def due(link, cycle: float) -> tuple:
    """The ``Ready`` answers due now, and when the next is due where they must wait (else None): at once, or with a
    cycle time, at most one batch per cycle (ops that become ready within it wait for its end, and are answered,
    and fused, together)."""
    if not cycle:
        return link.table.decide(), None
    now = time.monotonic()
    if now < link.next_answer:
        return [], link.next_answer
    ready = link.table.decide()
    if ready:
        link.next_answer = now + cycle
    return ready, None


def answer(link, ready: list, reduce) -> list:
    """Send the ``ready`` answers, and in a pair the coordinator's own new small reductions; returns each answer
    with its inline result, for this rank to carry out."""
    results = inline_results(ready, reduce)
    if _timeline.recording():  # the members' wait for their peers ended when the last request came
        now = _timeline.wall_us()
        for item in ready:
            item.answer.ready_us = round(item.ready_at or now)
    if link.is_pair:
        pair.send_to_other(link, ready, results)
    else:
        meta = encode_frame(answers=[item.answer for item in ready])
        blob = bytearray().join(r for r in results if r is not None)
        for channel in link.channels.values():
            channel.send(meta, blob)
    return [(item.answer, result) for item, result in zip(ready, results)]


def inline_results(ready: list, reduce) -> list:
    """Reduce each ready inline op's payloads (in set order, the members that submitted it) with the reducer its
    layout names: each answer's result bytes, or None."""
    results = []
    for item in ready:
        requests = item.requests
        if item.answer.action != OK or not any(q is not None and q.inline for q in requests):
            results.append(None)
            continue
        payloads = [p for q, p in zip(requests, item.payloads) if q is not None]
        first = next(q for q in requests if q is not None)
        result = reduce(first.layout, payloads)
        item.answer.result = len(result)
        results.append(result)
    return results
