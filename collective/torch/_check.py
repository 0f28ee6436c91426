"""The control exchange before each collective: errors, not hangs or garbage; and ``join``.

Before each op the ranks of the set exchange a fixed-size control vector: a fingerprint of
what they are about to do (op, dtype, device, shape, root, reduction), a "joined" flag, and,
for a reduction that takes part in ``join``, what its single data op will carry (dtype,
element count, device). When the fingerprints of the ranks still working differ, every rank
sees it, the ranks exchange readable descriptions, and every rank raises the same
ValueError. A rank inside ``join()`` answers each exchange with the flag set and mirrors the
data op with zeros. Without the check, gloo aborts the process on a size mismatch and a
broadcast between tensors of different shapes returns garbage.
``SPARKHVD_CHECK_COLLECTIVES=0`` skips it (and with it, ``join``).

The exchange runs on direct TCP links between the set's ranks (``collective/_mesh.py``): about
0.07 ms between two processes on one host, against 0.35 ms for a gloo allgather. Each frame can
carry a payload: a CPU reduction of up to ``inline_capacity`` bytes (1 MB at np=2, less as
the set grows) rides in it, every rank reduces the gathered payloads itself, in rank order
(so every rank gets the same bits), and no gloo collective runs at all. Up to that size this is
several times faster than gloo's allreduce on this project's machines.
"""

from __future__ import annotations

import os
import struct
import zlib

import torch
import torch.distributed as dist

from .. import _engine, _progress
from .._mesh import HEADER_FIELDS
from ._process_sets import require_member

ENV_CHECK = "SPARKHVD_CHECK_COLLECTIVES"
_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8, torch.int16,
           torch.int32, torch.int64, torch.bool, torch.complex64, torch.complex128]
_JOINED, _WHAT, _TEXT, _COUNT, _MIRROR, _DTYPE, _NUMEL, _CUDA, _PROBLEM, _INLINE, _LENGTH = range(HEADER_FIELDS)
_HEADER = struct.Struct(f"<{HEADER_FIELDS}q")
_INLINE_BUDGET = 1 << 20  # payload bytes each rank receives in one exchange, over all its peers
_TEXT_LIMIT = 1 << 20  # the longest message the error path exchanges
_INLINE_DTYPES = {torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8, torch.int32,
                  torch.int64}
_INLINE_OPS = {dist.ReduceOp.SUM: torch.add, dist.ReduceOp.MIN: torch.minimum, dist.ReduceOp.MAX: torch.maximum,
               dist.ReduceOp.PRODUCT: torch.mul}
_last_joined: list | None = None  # the joined flags of the latest exchange, for join()'s answer


def enabled() -> bool:
    return os.environ.get(ENV_CHECK, "1") not in ("0", "false", "False", "no")


def inline_capacity(size: int) -> int:
    """The largest payload a rank sends in a control frame: 1 MB received over all peers."""
    return _INLINE_BUDGET // max(1, size - 1) // 64 * 64


def inline_fits(tensor: torch.Tensor, process_set) -> bool:
    """Whether a reduction of ``tensor`` rides in the control exchange (decided alike on agreeing ranks)."""
    return (enabled() and process_set.size() > 1 and tensor.device.type == "cpu" and tensor.dtype in _INLINE_DTYPES
            and 0 < tensor.numel() * tensor.element_size() <= inline_capacity(process_set.size()))


def describe(t: torch.Tensor, skip_first_dim: bool = False) -> str:
    shape = list(t.shape)
    dims = str(["*"] + shape[1:]).replace("'", "") if skip_first_dim and shape else str(shape)
    return f"{str(t.dtype).replace('torch.', '')}{dims} on {t.device.type}"


def verify(what: str, tensors: list, process_set, *, skip_first_dim: bool = False, extra: str = "",
           mirror: torch.Tensor | None = None, problem: str | None = None, inline: torch.Tensor | None = None,
           inline_op=dist.ReduceOp.SUM, out: torch.Tensor | None = None, name=None) -> torch.Tensor | None:
    """Raise ValueError on every rank of the set unless all working ranks pass matching tensors.

    ``mirror``: the one tensor the following data op all-reduces with SUM, which a rank in
    ``join()`` can stand in for with zeros; None for ops that cannot run while a rank has joined.
    ``problem``: what is wrong with this rank's arguments (bad splits, say); every rank then
    raises, instead of this one raising while the others wait in the op.
    ``inline``: the data of the reduction that follows, when ``inline_fits`` it: it travels in
    the exchange and the reduced result (``inline_op`` over the working ranks, in rank order) is
    returned, written into ``out`` (a contiguous tensor of the same dtype and element count) if
    given, else into a new flat tensor; the caller runs no data op. Otherwise returns None.
    ``name``: the op's name, for the stall report.
    """
    require_member(process_set, what)
    if problem is None and any(t.dtype == torch.int16 and t.device.type == "cpu" for t in tensors):
        problem = (f"{what} cannot carry int16 CPU tensors: torch's gloo backend has no 16-bit integer type; "
                   "cast to int32 first (tensor.int()).")
    if not enabled() or process_set.size() == 1:
        if problem is not None:
            raise ValueError(problem)
        return None
    text = f"{extra}: " if extra else ""
    text += ", ".join(describe(t, skip_first_dim) for t in tensors)
    row = [0, zlib.crc32(what.encode()), zlib.crc32(text.encode()), len(tensors), 0, 0, 0, 0, int(bool(problem)), 0, 0]
    if mirror is not None:
        row[_MIRROR:_PROBLEM] = [1, _DTYPES.index(mirror.dtype), mirror.numel(), int(mirror.is_cuda)]
    payload = b""
    if inline is not None:
        flat = inline.detach().reshape(-1).contiguous()
        payload = flat.view(torch.uint8).numpy()
        row[_INLINE], row[_LENGTH] = 1, payload.nbytes

    def consume(frames):
        rows = _rows(frames)
        if any(v[_PROBLEM] for v in rows) or not _agree(rows) or inline is None:
            return rows, None  # the op raises below: leave ``out`` as it was
        if mirror is None and any(v[_JOINED] for v in rows):
            return rows, None
        mine = process_set.rank()
        payloads = [flat if r == mine else torch.frombuffer(data, dtype=flat.dtype)
                    for r, ((_, data), v) in enumerate(zip(frames, rows)) if not v[_JOINED]]
        with torch.no_grad():
            return rows, _reduce(payloads, _INLINE_OPS[inline_op], out)

    rows, reduced = _exchange(row, payload, process_set, what, consume, name)
    if any(v[_PROBLEM] for v in rows):
        _raise_problems(problem, process_set, what)
    check_agreement(rows, process_set, f"{what}({_short(text)})", skip_first_dim)  # first: every rank alike
    joined = [r for r, v in enumerate(rows) if v[_JOINED]]
    if joined and mirror is None:
        raise ValueError(f"{what} cannot run while ranks {','.join(map(str, joined))} have called hvd.join(); "
                         "only allreduce and grouped_allreduce with op=Average or Sum, and DistributedOptimizer, "
                         "take part in join.")
    return reduced


def _reduce(payloads: list, combine, out: torch.Tensor | None) -> torch.Tensor:
    """``combine`` over ``payloads`` in rank order, into ``out`` (which may be one of them) or a new tensor."""
    if len(payloads) == 1:
        return payloads[0].clone() if out is None else out.reshape(-1).copy_(payloads[0])
    target = out.reshape(-1) if out is not None else None
    if target is not None and len(payloads) > 2 and any(p.data_ptr() == target.data_ptr() for p in payloads[2:]):
        target = None  # out is a later rank's input: it is read after the first step writes, so go through a copy
    result = combine(payloads[0], payloads[1], out=target) if target is not None else combine(payloads[0], payloads[1])
    for p in payloads[2:]:
        combine(result, p, out=result)
    if out is not None and target is None:
        out.reshape(-1).copy_(result)
        return out
    return result if out is None else out


def _agree(rows: list) -> bool:
    working = [v[_WHAT:_COUNT + 1] + v[_MIRROR:] for v in rows if not v[_JOINED]]
    return all(w == working[0] for w in working)


def _raise_problems(problem: str | None, process_set, what: str) -> None:
    """Every rank raises: one message if all ranks hit the same problem, else each rank's."""
    messages = _gather_text(problem, process_set, what)
    found = {m for m in messages if m is not None}
    if len(found) == 1 and all(m is not None for m in messages):
        raise ValueError(found.pop())
    raise ValueError("; ".join(f"rank {r}: {m}" for r, m in enumerate(messages) if m is not None))


def _gather_text(text: str | None, process_set, what: str) -> list:
    """Every rank's ``text`` (None allowed), in set-rank order; only text crosses the wire."""
    data = b"" if text is None else text.encode()[:_TEXT_LIMIT]
    row = [0] * HEADER_FIELDS
    row[_PROBLEM], row[_LENGTH] = int(text is not None), len(data)

    def consume(frames):
        return [bytes(payload).decode(errors="replace") if _HEADER.unpack(header)[_PROBLEM] else None
                for header, payload in frames]

    return _allgather(process_set, what, None, _HEADER.pack(*row), data, _TEXT_LIMIT, consume)


def exchange(row: list, process_set) -> list:
    """Every rank's control vector, in set-rank order."""
    return _exchange(row, b"", process_set, "join()", lambda frames: (_rows(frames), None))[0]


def _rows(frames: list) -> list:
    """The control vectors of exchanged frames."""
    return [list(_HEADER.unpack(header)) for header, _ in frames]


def _exchange(row: list, payload, process_set, what: str, consume, name=None):
    """Send this rank's frame to the set and return ``consume`` of everyone's: (rows, anything)."""
    global _last_joined
    rows, result = _allgather(process_set, what, name, _HEADER.pack(*row), payload,
                              inline_capacity(process_set.size()), consume)
    if process_set.group is None:  # join() works on the global set: only its exchanges count
        _last_joined = [v[_JOINED] for v in rows]
    return rows, result


def _allgather(process_set, what: str, name, header, payload, max_payload: int, consume):
    """One control exchange on the set's links, registered for the stall report while it waits."""
    entry = _progress.begin_check(what, name, process_set.ranks, process_set.link_id)
    try:
        mesh = _link(process_set, what)
        _progress.attach(entry, mesh)
        return mesh.allgather(header, payload, max_payload, what, consume)
    finally:
        _progress.end(entry)


def _link(process_set, what: str):
    ranks = list(range(process_set.size())) if process_set.ranks is None else process_set.ranks
    return _engine.endpoint().mesh(process_set.link_id, ranks, what)


def check_agreement(rows: list, process_set, mine: str, skip_first_dim: bool) -> None:
    """Raise the same ValueError on every rank when the working ranks' fingerprints differ."""
    if _agree(rows):
        return
    names = _gather_text(mine, process_set, mine)  # every rank got here: joined ones too
    groups: dict = {}
    for rank, name in enumerate(names):
        groups.setdefault(name, []).append(rank)
    listing = "; ".join(f"rank{'s' if len(r) > 1 else ''} {','.join(map(str, r))}: {name}"
                        for name, r in groups.items())
    rule = ("the same dtype, device and dimensions after the first" if skip_first_dim
            else "the same dtype, device and shape")
    hint = ""
    if any(name.startswith("DistributedOptimizer bucket") for name in groups):
        hint = (" A DistributedOptimizer bucket starts once all of its parameters have their gradients; on a rank "
                "where one has none (unused in this step), it waits until step(), after any collective in between "
                "(another optimizer's buckets, an allreduce of the loss): use every parameter on every rank, or "
                "run such collectives after step().")
    raise ValueError(f"ranks disagree on a collective: {listing}. Every rank must call the same collectives in "
                     f"the same order, with {rule} (and the same op and root_rank).{hint}")


def join(process_set) -> int:
    """Stand in for this rank in the others' reductions until every rank has joined."""
    global _last_joined
    if process_set.size() == 1:
        return 0
    if not enabled():
        raise ValueError(f"hvd.join() needs the collective check, which {ENV_CHECK}=0 turned off; unset it.")
    previous = _last_joined  # who had joined at the latest exchange before this call
    while True:
        rows = exchange([1] + [0] * (HEADER_FIELDS - 1), process_set)
        flags = [v[_JOINED] for v in rows]
        if all(flags):
            last = [r for r in range(len(rows)) if previous is None or not previous[r]]
            _last_joined = None
            return max(last)
        previous = flags
        if any(v[_PROBLEM] for v in rows):
            _raise_problems(None, process_set, "join()")
        check_agreement(rows, process_set, "join()", False)
        working = next(v for v in rows if not v[_JOINED])
        if not working[_MIRROR]:
            joined = [r for r, f in enumerate(flags) if f]
            raise ValueError(f"an operation that cannot take part in join ran while ranks "
                             f"{','.join(map(str, joined))} had called hvd.join(); only allreduce and "
                             "grouped_allreduce with op=Average or Sum, and DistributedOptimizer, take part in join.")
        if working[_INLINE]:
            continue  # the data rode in the exchange: the working ranks left this rank's share out
        device = torch.device("cuda", torch.cuda.current_device()) if working[_CUDA] else torch.device("cpu")
        zeros = torch.zeros(working[_NUMEL], dtype=_DTYPES[working[_DTYPE]], device=device)
        entry = _progress.begin_data(_progress.take_op(), "join()", None)  # the working ranks' op, from this end
        try:
            dist.all_reduce(zeros, group=process_set.group)  # this rank's contribution: zeros
        finally:
            _progress.end(entry)


def _short(text: str) -> str:
    return text if len(text) <= 300 else text[:300] + "..."
