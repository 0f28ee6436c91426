"""The control messages, one definition each (as Horovod's common/message.h), and their codec.

A member asks its set's coordinator for each op with a ``Request``; the coordinator decides with
an ``Answer`` per ready op (or per group of fused ops), which every member carries out in the
order given. ``Layout`` describes an op's data for the ranks that handle it without the tensors.
On the wire (``channel.PeerChannel``: a JSON meta, then raw bytes) each message is a compact JSON
object with one-letter keys; only this module spells them. ``RequestCache`` shortens a request
seen before to its name and a number.

A frame's meta (``encode_frame`` / ``decode_frame``) carries requests, answers or an abort; its
payload is the requests' inline bytes, then the answers' inline results, each in order.
"""

from __future__ import annotations

from dataclasses import dataclass

OK, ERROR = "ok", "err"  # Answer.action (or op_names.JOIN: every member is inside join())
VALUE, INTERNAL = "value", "internal"  # Answer.error_type: bad arguments (ValueError), or ranks that disagree
INLINE, ALL_REDUCE = "inline", "all_reduce"  # Layout.kind


@dataclass(slots=True, frozen=True)
class Layout:
    """What an op's data looks like, for the ranks that handle it without the tensors: the coordinator that
    reduces inline bytes, and a rank inside ``join()`` that adds zeros to the others' reduction."""

    kind: str  # INLINE: the data rides in the control frames; ALL_REDUCE: c10d all_reduces, one per bucket
    dtype: str = ""  # INLINE: the torch dtype of the bytes, without "torch." ("float32")
    op: str = ""  # INLINE: the reduction's name ("Sum", "Average", "Min", "Max", "Product")
    cuda: bool = False  # ALL_REDUCE: whether the data op runs on the GPU
    buckets: tuple = ()  # ALL_REDUCE: (dtype name, elements) of each all_reduce, in the order they start


@dataclass(slots=True)
class Request:
    """One member's op as it asks its set's coordinator for it (Horovod's Request). Never changed once made."""

    name: str  # matched across ranks: "allreduce.grads", "allreduce.noname.3" (the 4th unnamed one), JOIN
    kind: str  # "allreduce", "allgather", ..., JOIN
    signature: str = ""  # equal on every working member, else the op fails (dtype, shape, op, root, ...)
    description: str = ""  # what this rank passed, readable, for the error when signatures differ
    rank_value: object = None  # this rank's own value that may differ (allgather's rows, alltoall's splits)
    argument_error: str | None = None  # what is wrong with this rank's arguments: every member then raises it
    joinable: bool = False  # ranks inside join() may stand in for it (zeros, or nothing)
    inline: int = 0  # bytes of this rank's data that follow the request in the frame (a small reduction)
    fusion_key: str | None = None  # ops ready together with equal keys may run as one data op (tensor fusion)
    nbytes: int = 0  # the op's bytes, counted against the fusion threshold (with a fusion_key only)
    layout: Layout | None = None  # the data op, for the coordinator's inline reduction or a joined rank's zeros

    def instance(self, name: str, rank_value, inline: int) -> Request:
        """Another op of this kind, signature and description (``RequestCache``): only these three differ."""
        return Request(name, self.kind, self.signature, self.description, rank_value, self.argument_error,
                       self.joinable, inline, self.fusion_key, self.nbytes, self.layout)


@dataclass(slots=True)
class Answer:
    """The coordinator's decision on one op, or on ops fused into one (Horovod's Response)."""

    names: list  # the ops it covers, in order: several when fused (carried out as one data op)
    action: str  # OK (run it), ERROR (every member raises ``error``) or JOIN (every member is inside join())
    rank_values: list | None = None  # OK: every member's ``rank_value`` in set order (the first op's, when fused)
    joined: list | None = None  # OK: the ranks inside join() that stand in for the op with zeros, or None
    joined_layout: Layout | None = None  # OK with ``joined``: the data op they add their zeros to
    error_type: str | None = None  # ERROR: VALUE (bad arguments) or INTERNAL (the ranks disagree)
    error: str | None = None  # ERROR: the message every member raises
    last_joined: int | None = None  # JOIN: the rank that called join() last (what join() returns)
    result: int = 0  # OK: bytes of the inline result that follow the answer in the frame (a small reduction)
    # while the coordinator records a timeline: its wall clock (microseconds) when the op's last request came, the
    # end of its members' wait for their peers (runner/_service/timeline.py splits their NEGOTIATE spans there)
    ready_us: int | None = None


# ---- the codec ----------------------------------------------------------------------------------------------

def encode_layout(layout: Layout) -> dict:
    if layout.kind == INLINE:
        return {"k": INLINE, "t": layout.dtype, "o": layout.op}
    return {"k": layout.kind, "c": int(layout.cuda), "b": [list(b) for b in layout.buckets]}


def decode_layout(wire: dict | None) -> Layout | None:
    if wire is None:
        return None
    return Layout(wire["k"], wire.get("t", ""), wire.get("o", ""), bool(wire.get("c", 0)),
                  tuple(tuple(b) for b in wire.get("b", ())))


def encode_request(request: Request) -> dict:
    """The whole request; fields at their defaults are left out."""
    wire = {"n": request.name, "k": request.kind, "s": request.signature, "d": request.description}
    if request.rank_value is not None:
        wire["x"] = request.rank_value
    if request.argument_error is not None:
        wire["p"] = request.argument_error
    if request.joinable:
        wire["j"] = 1
    if request.inline:
        wire["i"] = request.inline
    if request.fusion_key is not None:
        wire["f"], wire["b"] = request.fusion_key, request.nbytes
    if request.layout is not None:
        wire["z"] = encode_layout(request.layout)
    return wire


def decode_request(wire: dict) -> Request:
    return Request(wire["n"], wire["k"], wire.get("s", ""), wire.get("d", ""), wire.get("x"), wire.get("p"),
                   bool(wire.get("j")), wire.get("i", 0), wire.get("f"), wire.get("b", 0),
                   decode_layout(wire.get("z")))


def encode_answer(answer: Answer) -> dict:
    wire: dict = {"n": answer.names, "a": answer.action}
    if answer.rank_values is not None:
        wire["x"] = answer.rank_values
    if answer.joined:
        wire["J"] = answer.joined
    if answer.joined_layout is not None:
        wire["z"] = encode_layout(answer.joined_layout)
    if answer.error is not None:
        wire["t"], wire["e"] = answer.error_type, answer.error
    if answer.last_joined is not None:
        wire["l"] = answer.last_joined
    if answer.result:
        wire["i"] = answer.result
    if answer.ready_us is not None:
        wire["w"] = answer.ready_us
    return wire


def decode_answer(wire: dict) -> Answer:
    return Answer(wire["n"], wire["a"], wire.get("x"), wire.get("J"), decode_layout(wire.get("z")), wire.get("t"),
                  wire.get("e"), wire.get("l"), wire.get("i", 0), wire.get("w"))


def encode_frame(requests: list = (), answers: list = (), abort: str | None = None) -> dict:
    """A frame's meta: ``requests`` already encoded (``RequestCache.encode``), ``answers`` as ``Answer``s, or the
    reason the set's links failed."""
    if abort is not None:
        return {"abort": abort}
    meta: dict = {}
    if requests:
        meta["r"] = requests
    if answers:
        meta["b"] = [encode_answer(a) for a in answers]
    return meta


@dataclass(slots=True)
class Frame:
    """A frame's meta, decoded: its requests are still as sent (``RequestCache.decode`` makes them whole)."""

    requests: list  # encoded requests, each followed in the payload by its inline bytes
    answers: list  # Answers, each followed in the payload by its inline result (after every request's bytes)
    abort: str | None  # the sender's links to this set failed: why (every op waiting on the set fails)


def decode_frame(meta: dict) -> Frame:
    return Frame(meta.get("r", ()), [decode_answer(a) for a in meta.get("b", ())], meta.get("abort"))


class RequestCache:
    """Horovod's response cache, on the request side: a steady-state op travels as its name and a number.

    A member's first request of a kind, signature and description goes whole, with a number (``c``);
    later ones carry only the name, the number and what may differ (``rank_value``, ``inline``), and the
    receiver fills in the rest from what that sender defined. Links keep frames in order, so a definition
    always arrives before its first use. A request with an ``argument_error`` always goes whole. At most
    ``capacity`` definitions per link (``HOROVOD_CACHE_CAPACITY``; 0: none).
    """

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._numbers: dict = {}  # on the sender: (kind, signature, description) -> number
        self._defined: dict = {}  # on the receiver: (peer, number) -> that peer's whole Request

    def encode(self, request: Request) -> dict:
        """What the sender sends for ``request``."""
        if request.argument_error is not None or not self.capacity:
            return encode_request(request)
        key = (request.kind, request.signature, request.description)
        number = self._numbers.get(key)
        if number is None:
            if len(self._numbers) >= self.capacity:
                return encode_request(request)
            number = self._numbers[key] = len(self._numbers)
            wire = encode_request(request)
            wire["c"] = number
            return wire
        short = {"n": request.name, "c": number}
        if request.rank_value is not None:
            short["x"] = request.rank_value
        if request.inline:
            short["i"] = request.inline
        return short

    def decode(self, peer: int, wire: dict) -> Request:
        """The whole request from what ``peer`` sent."""
        number = wire.get("c")
        if number is None:
            return decode_request(wire)
        if "k" in wire:
            request = self._defined[(peer, number)] = decode_request(wire)
            return request
        return self._defined[(peer, number)].instance(wire["n"], wire.get("x"), wire.get("i", 0))

