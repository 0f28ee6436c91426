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

The exchange is one gloo allgather of a fixed-size frame: the control vector, then room for a
small payload (``inline_capacity``: 128 KB at np=2, less as the set grows, 256 KB in all). A
small CPU reduction rides in it: every rank reduces the gathered payloads itself, in rank
order, and no second collective runs. On gloo an allgather of a frame that size costs about
what the control vector alone costs, and less than a small all_reduce, so small reductions
with the check cost less than raw ``dist.all_reduce`` without it.
"""

from __future__ import annotations

import os
import zlib

import torch
import torch.distributed as dist

from ._process_sets import require_member

ENV_CHECK = "SPARKHVD_CHECK_COLLECTIVES"
_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8, torch.int16,
           torch.int32, torch.int64, torch.bool, torch.complex64, torch.complex128]
_JOINED, _WHAT, _TEXT, _COUNT, _MIRROR, _DTYPE, _NUMEL, _CUDA, _PROBLEM, _INLINE = range(10)
_HEADER_BYTES = 10 * 8
_INLINE_DTYPES = {torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8, torch.int16,
                  torch.int32, torch.int64}
_INLINE_OPS = {dist.ReduceOp.SUM: torch.add, dist.ReduceOp.MIN: torch.minimum, dist.ReduceOp.MAX: torch.maximum,
               dist.ReduceOp.PRODUCT: torch.mul}
_last_joined: list | None = None  # the joined flags of the latest exchange, for join()'s answer
_frames: dict = {}  # set size -> (send frame, receive buffer): reused, one exchange runs at a time


def enabled() -> bool:
    return os.environ.get(ENV_CHECK, "1") not in ("0", "false", "False", "no")


def inline_capacity(size: int) -> int:
    """Payload bytes a control frame carries: 256 KB over the set (none below 1 KB a rank)."""
    per_rank = (256 * 1024 // size) // 64 * 64
    return per_rank if per_rank >= 1024 else 0


def inline_fits(tensor: torch.Tensor, process_set) -> bool:
    """Whether a reduction of ``tensor`` rides in the control exchange (decided alike on agreeing ranks)."""
    return (enabled() and process_set.size() > 1 and tensor.device.type == "cpu" and tensor.dtype in _INLINE_DTYPES
            and tensor.numel() * tensor.element_size() <= inline_capacity(process_set.size()))


def describe(t: torch.Tensor, skip_first_dim: bool = False) -> str:
    shape = list(t.shape)
    dims = str(["*"] + shape[1:]).replace("'", "") if skip_first_dim and shape else str(shape)
    return f"{str(t.dtype).replace('torch.', '')}{dims} on {t.device.type}"


def verify(what: str, tensors: list, process_set, *, skip_first_dim: bool = False, extra: str = "",
           mirror: torch.Tensor | None = None, problem: str | None = None, inline: torch.Tensor | None = None,
           inline_op=dist.ReduceOp.SUM) -> torch.Tensor | None:
    """Raise ValueError on every rank of the set unless all working ranks pass matching tensors.

    ``mirror``: the one tensor the following data op all-reduces with SUM, which a rank in
    ``join()`` can stand in for with zeros; None for ops that cannot run while a rank has joined.
    ``problem``: what is wrong with this rank's arguments (bad splits, say); every rank then
    raises, instead of this one raising while the others wait in the op.
    ``inline``: the data of the reduction that follows, when ``inline_fits`` it: it travels in
    the exchange and the reduced result (a new flat tensor; ``inline_op`` over the working
    ranks, in rank order) is returned, and the caller runs no data op. Otherwise returns None.
    """
    require_member(process_set, what)
    if not enabled() or process_set.size() == 1:
        if problem is not None:
            raise ValueError(problem)
        return None
    text = f"{extra}: " if extra else ""
    text += ", ".join(describe(t, skip_first_dim) for t in tensors)
    row = [0, zlib.crc32(what.encode()), zlib.crc32(text.encode()), len(tensors), 0, 0, 0, 0, int(bool(problem)), 0]
    if mirror is not None:
        row[_MIRROR:_PROBLEM] = [1, _DTYPES.index(mirror.dtype), mirror.numel(), int(mirror.is_cuda)]
    if inline is not None:
        row[_INLINE] = 1
    rows, frames = _exchange(row, process_set, inline)
    if any(v[_PROBLEM] for v in rows):
        _raise_problems(problem, process_set)
    check_agreement(rows, process_set, f"{what}({_short(text)})", skip_first_dim)  # first: every rank alike
    joined = [r for r, v in enumerate(rows) if v[_JOINED]]
    if joined and mirror is None:
        raise ValueError(f"{what} cannot run while ranks {','.join(map(str, joined))} have called hvd.join(); "
                         "only allreduce and grouped_allreduce with op=Average or Sum, and DistributedOptimizer, "
                         "take part in join.")
    if inline is None:
        return None
    nbytes = inline.numel() * inline.element_size()
    payloads = [frames[r, _HEADER_BYTES:_HEADER_BYTES + nbytes].view(inline.dtype)
                for r, v in enumerate(rows) if not v[_JOINED]]
    combine = _INLINE_OPS[inline_op]
    out = payloads[0].clone()
    for payload in payloads[1:]:
        combine(out, payload, out=out)
    return out


def _raise_problems(problem: str | None, process_set) -> None:
    """Every rank raises: one message if all ranks hit the same problem, else each rank's."""
    messages = [None] * process_set.size()
    dist.all_gather_object(messages, problem, group=process_set.group)
    found = {m for m in messages if m is not None}
    if len(found) == 1 and all(m is not None for m in messages):
        raise ValueError(found.pop())
    raise ValueError("; ".join(f"rank {r}: {m}" for r, m in enumerate(messages) if m is not None))


# torch 2.13 renamed all_gather_into_tensor (which now warns) to all_gather_single.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def exchange(row: list, process_set) -> list:
    """Every rank's control vector, in set-rank order."""
    return _exchange(row, process_set, None)[0]


def _exchange(row: list, process_set, payload: torch.Tensor | None):
    """Every rank's control vector and its whole frame (uint8 rows), in set-rank order."""
    global _last_joined
    n = process_set.size()
    if n not in _frames:
        width = _HEADER_BYTES + inline_capacity(n)
        _frames[n] = (torch.zeros(width, dtype=torch.uint8), torch.empty(n * width, dtype=torch.uint8))
    send, receive = _frames[n]
    send[:_HEADER_BYTES].view(torch.int64).copy_(torch.tensor(row, dtype=torch.int64))
    if payload is not None:
        nbytes = payload.numel() * payload.element_size()
        send[_HEADER_BYTES:_HEADER_BYTES + nbytes].view(payload.dtype).copy_(payload.reshape(-1))
    _all_gather_single(receive, send, group=process_set.group)
    frames = receive.view(n, -1)
    rows = frames[:, :_HEADER_BYTES].view(torch.int64).tolist()
    if process_set.group is None:  # join() works on the global set: only its exchanges count
        _last_joined = [v[_JOINED] for v in rows]
    return rows, frames


def check_agreement(rows: list, process_set, mine: str, skip_first_dim: bool) -> None:
    """Raise the same ValueError on every rank when the working ranks' fingerprints differ."""
    working = [v[_WHAT:_COUNT + 1] + v[_MIRROR:] for v in rows if not v[_JOINED]]
    if all(w == working[0] for w in working):
        return
    names = [None] * process_set.size()  # every rank got here: joined ones too
    dist.all_gather_object(names, mine, group=process_set.group)
    groups: dict = {}
    for rank, name in enumerate(names):
        groups.setdefault(name, []).append(rank)
    listing = "; ".join(f"rank{'s' if len(r) > 1 else ''} {','.join(map(str, r))}: {name}"
                        for name, r in groups.items())
    rule = ("the same dtype, device and dimensions after the first" if skip_first_dim
            else "the same dtype, device and shape")
    raise ValueError(f"ranks disagree on a collective: {listing}. Every rank must call the same collectives in "
                     f"the same order, with {rule} (and the same op and root_rank).")


def join(process_set) -> int:
    """Stand in for this rank in the others' reductions until every rank has joined."""
    global _last_joined
    if process_set.size() == 1:
        return 0
    if not enabled():
        raise ValueError(f"hvd.join() needs the collective check, which {ENV_CHECK}=0 turned off; unset it.")
    previous = _last_joined  # who had joined at the latest exchange before this call
    while True:
        rows = exchange([1, 0, 0, 0, 0, 0, 0, 0, 0, 0], process_set)
        flags = [v[_JOINED] for v in rows]
        if all(flags):
            last = [r for r in range(len(rows)) if previous is None or not previous[r]]
            _last_joined = None
            return max(last)
        previous = flags
        if any(v[_PROBLEM] for v in rows):
            _raise_problems(None, process_set)
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
        dist.all_reduce(zeros, group=process_set.group)  # this rank's contribution: zeros


def _short(text: str) -> str:
    return text if len(text) <= 300 else text[:300] + "..."
