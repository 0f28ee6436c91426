"""Horovod's tensor collectives on c10d: asynchronous cores, in-place and blocking variants.

Every op takes ``process_set=`` (default: every rank). Ops run in call order, as c10d and DDP
do: every rank of the set must call the same ops in the same order. The differentiable
out-of-place wrappers live in ``_autograd.py``.
"""

from __future__ import annotations

import enum

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from .. import _progress
from . import _fusion, _timeline
from ._check import inline_fits, verify
from ._handles import Handle, name_problem, register, synchronize
from ._scale import scale_, scaled
from ._process_sets import ProcessSet, global_process_set, require_member


class ReduceOp(enum.IntEnum):
    """Horovod's reduction operations."""

    Average = 0
    Sum = 1
    Adasum = 2
    Min = 3
    Max = 4
    Product = 5


Average, Sum, Adasum = ReduceOp.Average, ReduceOp.Sum, ReduceOp.Adasum
Min, Max, Product = ReduceOp.Min, ReduceOp.Max, ReduceOp.Product

_C10D_OPS = {Sum: dist.ReduceOp.SUM, Average: dist.ReduceOp.SUM, Min: dist.ReduceOp.MIN,
             Max: dist.ReduceOp.MAX, Product: dist.ReduceOp.PRODUCT}


def _resolve_op(op, average) -> ReduceOp:
    if op is not None and average is not None:
        raise ValueError("allreduce got both op= and the legacy average=; pass only op=hvd.Average or op=hvd.Sum.")
    if op is None:
        return Average if average is None or average else Sum  # as Horovod: any falsy average= sums
    try:
        op = ReduceOp(op)
    except ValueError:
        raise ValueError(f"op={op!r} is not a reduction; use hvd.Average, hvd.Sum, hvd.Min, hvd.Max "
                         "or hvd.Product.") from None
    if op == Adasum:
        raise NotImplementedError("op=hvd.Adasum is not implemented by sparkhvd; use op=hvd.Average "
                                  "(the default), which gives the same result for equal learning rates.")
    return op


def _check_tensor(tensor, what: str) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{what} takes a torch.Tensor, got {type(tensor).__name__}.")


def _group(process_set: ProcessSet, what: str):
    """The c10d group of ``process_set``; this rank must be a member."""
    require_member(process_set, what)
    return process_set.group


def _root_problem(root_rank, process_set: ProcessSet) -> str | None:
    """``root_rank`` is a job-wide rank (``hvd.rank()``), also within a process set, as in Horovod."""
    valid = isinstance(root_rank, int) and not isinstance(root_rank, bool)
    if process_set is global_process_set:
        size = process_set.size()
        if not (valid and 0 <= root_rank < size):
            return f"root_rank={root_rank!r} is outside the ranks 0..{size - 1} of this job."
    elif not (valid and root_rank in process_set.ranks):
        return (f"root_rank={root_rank!r} is not a member of process set {process_set.ranks}; root_rank is a "
                f"job-wide rank (hvd.rank()), also within a process set, as in Horovod.")
    return None


def _scale_after(tensor: torch.Tensor, op: ReduceOp, size: int, postscale: float) -> None:
    average = op == Average and size > 1
    if tensor.is_floating_point() or tensor.is_complex():
        if average:
            tensor.div_(size)
        scale_(tensor, postscale)
    else:  # one truncation, of sum * postscale / size, as Horovod
        scale_(tensor, postscale / size if average else postscale)


def _fused(members: list, pooled: list) -> torch.Tensor:
    """``members`` as one flat tensor: a view of a lone member, else a copy (into a pooled buffer on CPU)."""
    if len(members) == 1:
        return members[0].detach().reshape(-1)
    numel = sum(m.numel() for m in members)
    if members[0].device.type != "cpu":
        return _flatten_dense_tensors([m.detach() for m in members])
    buffer = _fusion.pool.take(members[0].dtype, numel)
    pooled.append(buffer)
    return torch.cat([m.detach().reshape(-1) for m in members], out=buffer[:numel])


# ---- allreduce ----------------------------------------------------------------------------

def allreduce_async_(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                     process_set=global_process_set, _what: str = "allreduce") -> Handle:
    """Start reducing ``tensor`` in place; returns a handle for ``synchronize``.

    ``op=Average`` (the default) divides the sum by the set's size; on integer tensors the
    result is truncated toward zero, as Horovod's.
    """
    _check_tensor(tensor, "allreduce")
    op = _resolve_op(op, average)
    group = _group(process_set, _what)
    problem = name_problem(name, "allreduce")
    inline = None
    if problem is None and inline_fits(tensor, process_set):  # small: the data rides in the exchange
        with torch.no_grad():
            inline = scaled(tensor.detach(), prescale_factor)
    reduced = verify(_what, [tensor], process_set, extra=f"op={op.name}", mirror=_joinable(tensor, op),
                     problem=problem, inline=inline, inline_op=_C10D_OPS[op],
                     out=tensor if tensor.is_contiguous() else None, name=name)
    size = process_set.size()
    with torch.no_grad():
        if reduced is not None:
            if reduced is not tensor:
                tensor.copy_(reduced.view_as(tensor))
            works = []
        else:
            wire = tensor if tensor.is_contiguous() else tensor.contiguous()  # c10d reduces strided ones wrong
            scale_(wire, prescale_factor)
            works = [dist.all_reduce(wire, op=_C10D_OPS[op], group=group, async_op=True)]

    def finish():
        with torch.no_grad():
            if works and wire is not tensor:
                tensor.copy_(wire)
            _scale_after(tensor, op, size, postscale_factor)
        return tensor

    return register(Handle(works, finish, name, kind="allreduce", nbytes=_nbytes(tensor)))


def allreduce_async(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                    process_set=global_process_set, _what: str = "allreduce") -> Handle:
    """Start reducing a copy of ``tensor`` (the input is unchanged)."""
    _check_tensor(tensor, "allreduce")
    return allreduce_async_(tensor.detach().clone(), average, name, op, prescale_factor, postscale_factor,
                            process_set, _what)


def allreduce_(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
               process_set=global_process_set) -> torch.Tensor:
    """Reduce ``tensor`` across the ranks in place and return it."""
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor, postscale_factor, process_set))


def grouped_allreduce_async_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                             postscale_factor=1.0, process_set=global_process_set) -> Handle:
    """Start reducing a list of tensors in place, fused into one flat buffer per dtype and device."""
    tensors = list(tensors)
    for t in tensors:
        _check_tensor(t, "grouped_allreduce")
    op = _resolve_op(op, average)
    group = _group(process_set, "grouped_allreduce")
    size = process_set.size()
    buckets = _fusion.pack(tensors, _fusion.fusion_threshold())
    works, flats, pooled = [], [], []
    try:
        with torch.no_grad():
            for i, members in enumerate(buckets):
                flat = _fused(members, pooled)
                problem = name_problem(name, "grouped_allreduce")
                if problem is None:
                    flat = scaled(flat, prescale_factor)  # not in place: flat may be a view of the only member
                reduced = verify("grouped_allreduce", members, process_set,
                                 extra=f"op={op.name}, bucket {i} of {len(buckets)}", mirror=_joinable(flat, op),
                                 problem=problem, inline=flat if inline_fits(flat, process_set) else None,
                                 inline_op=_C10D_OPS[op], name=name)
                if reduced is not None:  # small: it rode in the check's exchange
                    flat = reduced
                else:
                    works.append(dist.all_reduce(flat, op=_C10D_OPS[op], group=group, async_op=True))
                flats.append((flat, members))
    except BaseException:
        for work in works:
            work.wait()  # the pooled buffers are in use until then
        for buffer in pooled:
            _fusion.pool.give(buffer)
        raise

    def finish():
        with torch.no_grad():
            for flat, members in flats:
                _scale_after(flat, op, size, postscale_factor)
                for t, reduced in zip(members, _unflatten_dense_tensors(flat, members)):
                    t.copy_(reduced)
        for buffer in pooled:
            _fusion.pool.give(buffer)
        return tuple(tensors)

    return register(Handle(works, finish, name, kind="grouped_allreduce", nbytes=sum(map(_nbytes, tensors))))


def grouped_allreduce_async(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                            postscale_factor=1.0, process_set=global_process_set) -> Handle:
    """Start reducing copies of a list of tensors."""
    return grouped_allreduce_async_([t.detach().clone() for t in tensors], average, name, op,
                                    prescale_factor, postscale_factor, process_set)


def grouped_allreduce_(tensors, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                       process_set=global_process_set) -> tuple:
    """Reduce a list of tensors in place (fused); returns them, as a tuple (as Horovod)."""
    return synchronize(grouped_allreduce_async_(tensors, average, name, op, prescale_factor, postscale_factor,
                                                process_set))


# ---- broadcast ----------------------------------------------------------------------------

def broadcast_async_(tensor, root_rank, name=None, process_set=global_process_set) -> Handle:
    """Start overwriting ``tensor`` with rank ``root_rank``'s value, in place."""
    _check_tensor(tensor, "broadcast")
    group = _group(process_set, "broadcast")
    problem = _root_problem(root_rank, process_set) or name_problem(name, "broadcast")
    verify("broadcast", [tensor], process_set, extra=f"root_rank={root_rank}", problem=problem, name=name)
    src = root_rank
    wire = tensor if tensor.is_contiguous() else tensor.detach().contiguous()
    with torch.no_grad():
        work = dist.broadcast(wire, src=src, group=group, async_op=True)

    def finish():
        if wire is not tensor:
            with torch.no_grad():
                tensor.copy_(wire)
        return tensor

    return register(Handle([work], finish, name, kind="broadcast", nbytes=_nbytes(tensor)))


def broadcast_async(tensor, root_rank, name=None, process_set=global_process_set) -> Handle:
    """Start broadcasting into a copy of ``tensor``."""
    _check_tensor(tensor, "broadcast")
    return broadcast_async_(tensor.detach().clone(), root_rank, name, process_set)


def broadcast_(tensor, root_rank, name=None, process_set=global_process_set) -> torch.Tensor:
    """Overwrite ``tensor`` with rank ``root_rank``'s value, in place; returns it."""
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


# ---- allgather ----------------------------------------------------------------------------

def gather_ints(values: list, device, process_set=global_process_set) -> list:
    """Every member's list of ints (same length on every member), as tuples in set-rank order.

    Registered as the data wait of this thread's latest checked op, which it leaves for the data
    wait that follows (``take_op``)."""
    mine = torch.tensor(values, dtype=torch.int64, device=device)
    out = [torch.empty_like(mine) for _ in range(process_set.size())]
    op = _progress.current_op()
    entry = _progress.begin_data(op, "allgather" if op is None else op[0], None)
    try:
        dist.all_gather(out, mine, group=process_set.group)
    finally:
        _progress.end(entry)
    return [tuple(int(x) for x in o.tolist()) for o in out]


def allgather_async(tensor, name=None, process_set=global_process_set, _problem=None) -> Handle:
    """Start concatenating every member's ``tensor`` along the first dimension, in rank order.

    The first dimension may differ between ranks; the others must match. (The shapes are
    exchanged before this returns; the data moves asynchronously.)
    """
    _check_tensor(tensor, "allgather")
    _group(process_set, "allgather")
    t = tensor.detach().reshape(1) if tensor.dim() == 0 else tensor.detach()
    verify("allgather", [t], process_set, skip_first_dim=True,
           problem=_problem or name_problem(name, "allgather"), name=name)
    shapes = gather_ints(list(t.shape), t.device, process_set)
    if len({s[1:] for s in shapes}) > 1:
        raise ValueError(f"allgather needs tensors whose dimensions after the first match on every rank; "
                         f"got shapes {[list(s) for s in shapes]} on ranks 0..{len(shapes) - 1}.")
    rows = [s[0] for s in shapes]
    longest = max(rows)
    padded = t if t.shape[0] == longest else torch.cat(
        [t, t.new_zeros((longest - t.shape[0],) + tuple(t.shape[1:]))])
    gathered = [torch.empty_like(padded) for _ in rows]
    work = dist.all_gather(gathered, padded.contiguous(), group=process_set.group, async_op=True)
    return register(Handle([work], lambda: torch.cat([g[:n] for g, n in zip(gathered, rows)]), name,
                           kind="allgather", nbytes=_nbytes(padded) * len(rows)))


def sparse_allreduce_async(tensor, name=None, op=Average, process_set=global_process_set) -> Handle:
    """Start reducing a sparse COO tensor, as Horovod does: every rank's indices and values are
    gathered, and the result is their (uncoalesced) sparse sum, divided by the size for Average.

    The handle is callable for the result (Horovod returns a function) or goes to ``synchronize``.
    """
    op = _resolve_op(op, None)
    if op not in (Average, Sum):
        raise ValueError(f"sparse_allreduce_async supports op=hvd.Average or hvd.Sum, got {op.name}.")
    size = process_set.size()
    problem = name_problem(name, "sparse_allreduce")  # every rank raises in the first gather's check
    if not isinstance(tensor, torch.Tensor) or tensor.layout != torch.sparse_coo:  # a dense one on some rank
        problem = (f"sparse_allreduce_async takes a sparse COO tensor, got "
                   f"{getattr(tensor, 'layout', type(tensor).__name__)}; use allreduce_async for dense ones.")
        allgather_async(torch.empty(0, 1, dtype=torch.int64), process_set=process_set, _problem=problem)
    indices = allgather_async(tensor._indices().t().contiguous(), process_set=process_set, _problem=problem)
    values = allgather_async(tensor._values(), process_set=process_set)

    def finish():
        gathered = values.wait()
        if op == Average:
            gathered = gathered / size if gathered.is_floating_point() else torch.div(gathered, size,
                                                                                       rounding_mode="trunc")
        return torch.sparse_coo_tensor(indices.wait().t(), gathered, tensor.shape, check_invariants=True)

    return register(Handle(indices._works + values._works, finish, name, kind="sparse_allreduce",
                           nbytes=indices.nbytes + values.nbytes))


def _grouped(kind: str, handles: list, name) -> Handle:
    """One handle for several: ``synchronize`` gives the tuple of their results (Horovod's grouped ops)."""
    return register(Handle([w for h in handles for w in h._works], lambda: tuple(h.wait() for h in handles), name,
                           kind=kind, nbytes=sum(h.nbytes for h in handles)))


def grouped_allgather_async(tensors, name=None, process_set=global_process_set) -> Handle:
    """Start ``allgather`` of each tensor in a list; ``synchronize`` returns a tuple of results."""
    problem = name_problem(name, "grouped_allgather")  # every rank raises in the first one's check
    return _grouped("grouped_allgather", [allgather_async(t, process_set=process_set, _problem=problem if i == 0
                                                          else None) for i, t in enumerate(tensors)], name)


# ---- alltoall, reducescatter --------------------------------------------------------------

def alltoall_async(tensor, splits=None, name=None, process_set=global_process_set) -> Handle:
    """Start sending ``splits[i]`` rows of ``tensor`` to rank i; the result is (tensor, received splits)."""
    _check_tensor(tensor, "alltoall")
    _group(process_set, "alltoall")
    n = process_set.size()
    rows = tensor.shape[0] if tensor.dim() else 0
    problem = None
    if tensor.dim() == 0:  # every rank raises this in the check below, not this rank alone
        problem, splits = "alltoall needs a tensor with at least one dimension; got a scalar.", [0] * n
    elif splits is None:
        if rows % n:
            problem = (f"alltoall without splits needs the first dimension ({rows}) to be divisible by the "
                       f"number of ranks ({n}); pass splits= to send uneven parts.")
        splits = [rows // n] * n
    splits = [int(s) for s in (splits.tolist() if isinstance(splits, torch.Tensor) else splits)]
    if problem is None and (len(splits) != n or any(s < 0 for s in splits) or sum(splits) != rows):
        problem = (f"alltoall splits {splits} must be {n} non-negative counts (one per rank) that add up "
                   f"to the first dimension ({rows}).")
    verify("alltoall", [tensor], process_set, skip_first_dim=True,
           problem=problem or name_problem(name, "alltoall"), name=name)
    send = torch.tensor(splits, dtype=torch.int64, device=tensor.device)
    recv = torch.empty_like(send)
    entry = _progress.begin_data(_progress.current_op(), "alltoall", name)  # the Handle below takes the op
    try:
        dist.all_to_all_single(recv, send, group=process_set.group)
    finally:
        _progress.end(entry)
    received = [int(x) for x in recv.tolist()]
    output = tensor.new_empty((sum(received),) + tuple(tensor.shape[1:]))
    work = dist.all_to_all_single(output, tensor.detach().contiguous(), output_split_sizes=received,
                                  input_split_sizes=splits, group=process_set.group, async_op=True)
    received_splits = torch.tensor(received, dtype=torch.int32)
    return register(Handle([work], lambda: (output, received_splits), name, kind="alltoall",
                           nbytes=_nbytes(tensor)))


def reducescatter_rows(rows: int, size: int) -> list:
    """How many of ``rows`` each rank gets: as even as possible, lower ranks take the extra rows."""
    base, extra = divmod(rows, size)
    return [base + (1 if r < extra else 0) for r in range(size)]


def reducescatter_async(tensor, name=None, op=Average, process_set=global_process_set, prescale_factor=1.0,
                        postscale_factor=1.0, _problem=None) -> Handle:
    """Start reducing ``tensor`` and keeping this rank's rows of the result.

    The first dimension is divided as evenly as possible; lower ranks take the extra rows
    (uneven shares are padded to the largest for the wire).
    """
    _check_tensor(tensor, "reducescatter")
    op = _resolve_op(op, None)
    if op not in (Average, Sum):
        raise ValueError(f"reducescatter supports op=hvd.Average or hvd.Sum, got {op.name}.")
    group = _group(process_set, "reducescatter")
    scalar = "reducescatter needs a tensor with at least one dimension; got a scalar." if tensor.dim() == 0 else None
    verify("reducescatter", [tensor], process_set, extra=f"op={op.name}",  # every rank raises any problem
           problem=_problem or scalar or name_problem(name, "reducescatter"), name=name)
    n, me = process_set.size(), process_set.rank()
    counts = reducescatter_rows(tensor.shape[0], n)
    longest, trailing = counts[0], tuple(tensor.shape[1:])
    with torch.no_grad():
        src = tensor.detach()
        if len(set(counts)) > 1:  # pad every share to the largest
            padded = src.new_zeros((n * longest,) + trailing)
            start = 0
            for r, c in enumerate(counts):
                padded[r * longest:r * longest + c] = src[start:start + c]
                start += c
            src = padded
        src = scaled(src, prescale_factor)
        out = src.new_empty((longest,) + trailing)
        work = dist.reduce_scatter_tensor(out, src.contiguous(), op=dist.ReduceOp.SUM, group=group, async_op=True)

    def finish():
        mine = out[:counts[me]]
        with torch.no_grad():
            _scale_after(mine, op, n, postscale_factor)
        return mine

    return register(Handle([work], finish, name, kind="reducescatter", nbytes=_nbytes(tensor)))


def grouped_reducescatter_async(tensors, name=None, op=Average, process_set=global_process_set, prescale_factor=1.0,
                                postscale_factor=1.0) -> Handle:
    """Start ``reducescatter`` of each tensor in a list; ``synchronize`` returns a tuple of results."""
    problem = name_problem(name, "grouped_reducescatter")  # every rank raises in the first one's check
    return _grouped("grouped_reducescatter",
                    [reducescatter_async(t, op=op, process_set=process_set, prescale_factor=prescale_factor,
                                         postscale_factor=postscale_factor, _problem=problem if i == 0 else None)
                     for i, t in enumerate(tensors)], name)


def _joinable(tensor: torch.Tensor, op: ReduceOp):
    """The tensor a joined rank stands in for with zeros, for reductions where zeros are neutral."""
    return tensor if op in (Sum, Average) else None


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def barrier(process_set=global_process_set) -> None:
    """Wait until every rank of the set has reached this call."""
    _group(process_set, "barrier")
    verify("barrier", [], process_set)
    started = _timeline.now_us()
    entry = _progress.begin_data(_progress.take_op(), "barrier", None)
    try:
        dist.barrier(group=process_set.group)
    finally:
        _progress.end(entry)
    _timeline.record("barrier", None, started, 0)
