"""Horovod's tensor collectives on c10d: asynchronous cores, in-place and blocking variants.

Every op takes ``process_set=`` (default: every rank) and goes to the background engine
(``collective/_engine/engine.py``), which matches it across ranks by name (explicit, or an automatic
one: the n-th unnamed op of its kind on the set) and starts its data op in the order the set's
coordinator gives. Each function here describes its op (``Op``): what must agree across ranks,
and ``launch``, which starts the c10d op once every member has submitted it. The frameworks wrap
these: torch's differentiable out-of-place ops are ``collective/torch/_autograd.py``, TensorFlow's
ops and gradients ``collective/tensorflow/_ops.py``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from .._engine.messages import ALL_REDUCE, INLINE, Layout
from .._engine.ops import Handle, Op
from . import _adasum, _buffers, _inline, _submit
from ._handles import GroupHandle, synchronize
from ._process_sets import ProcessSet, global_process_set, require_member
from ._reduction import Adasum, Average, Max, Min, Product, ReduceOp, Sum, resolve_op
from ._scale import scale_, scaled
from ._submit import describe, nbytes, submit

_resolve_op = resolve_op

_C10D_OPS = {Sum: dist.ReduceOp.SUM, Average: dist.ReduceOp.SUM, Min: dist.ReduceOp.MIN,
             Max: dist.ReduceOp.MAX, Product: dist.ReduceOp.PRODUCT}


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


def now(start, *args, **kwargs):
    """``synchronize(start(*args, **kwargs))`` for a blocking call: the engine thread is not woken for the
    op, since this thread does the engine's work itself while it waits (``Engine.drive``)."""
    _submit._caller.blocking = True
    try:
        handle = start(*args, **kwargs)
    finally:
        _submit._caller.blocking = False
    return synchronize(handle)


def _wire(tensor: torch.Tensor) -> torch.Tensor:
    """What the backend moves for ``tensor``: itself when contiguous and of a type the backend carries, else a
    contiguous byte view (``moved_as_bytes``)."""
    t = tensor if tensor.is_contiguous() else tensor.contiguous()
    if moved_as_bytes(t) and t.numel() == 0:
        return t.new_empty(tuple(t.shape[:-1]) + (t.shape[-1] * t.element_size(),) if t.dim() else (0,),
                           dtype=torch.uint8)
    if moved_as_bytes(t):
        return t.view(torch.uint8) if t.dim() else t.reshape(1).view(torch.uint8)
    return t


def _unwire(wire: torch.Tensor, dtype: torch.dtype, shape) -> torch.Tensor:
    """``wire`` (from ``_wire``) as a ``dtype`` tensor of ``shape`` again (an empty one has no bytes to view)."""
    if wire.dtype == dtype:
        return wire.view(shape)
    if wire.numel() == 0:
        return torch.empty(shape, dtype=dtype, device=wire.device)
    return wire.view(dtype).view(shape)


# The dtypes each backend cannot move as themselves: their bytes travel instead (gloo on CPU, NCCL on CUDA).
_BYTE_VIEWED = {
    "cpu": {torch.bool, torch.int8, torch.int16, torch.uint16, torch.uint32, torch.uint64, torch.complex64,
            torch.complex128},
    "cuda": {torch.int16, torch.uint16, torch.uint32, torch.uint64, torch.complex64, torch.complex128},
}
# The dtypes each backend cannot reduce: they are reduced as int32 (gloo has no 8/16-bit reduction, NCCL no int16).
_REDUCED_VIA_INT32 = {"cpu": {torch.int16, torch.int8, torch.uint8, torch.bool}, "cuda": {torch.int16}}


def moved_as_bytes(t: torch.Tensor) -> bool:
    """Whether ``t``'s backend moves it as bytes (broadcast, allgather, alltoall)."""
    return t.dtype in _BYTE_VIEWED.get(t.device.type, ())


def reduced_via_int32(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether a reduction of ``dtype`` on ``device`` runs widened to int32."""
    return dtype in _REDUCED_VIA_INT32.get(device.type, ())


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _all_reduce_layout(buckets: list, cuda: bool) -> Layout:
    """What a rank inside ``join()`` needs to add its zeros to the others' all_reduces of ``buckets`` (lists of
    tensors of one dtype, each reduced as one flat tensor, in order)."""
    return Layout(ALL_REDUCE, cuda=cuda, buckets=tuple((_dtype_name(b[0].dtype), sum(t.numel() for t in b))
                                                      for b in buckets))


_inline_layouts: dict = {}  # (dtype, op) -> its Layout: made once per kind of small reduction, not per op


def _inline_layout(flat: torch.Tensor, op: ReduceOp) -> Layout:
    """How the coordinator reduces the bytes of ``flat`` that ride inline (``_inline.reduce``)."""
    layout = _inline_layouts.get((flat.dtype, op))
    if layout is None:
        layout = _inline_layouts[(flat.dtype, op)] = Layout(INLINE, dtype=_dtype_name(flat.dtype), op=op.name)
    return layout


@dataclass(slots=True)
class _FusablePart:
    """An allreduce as ``_launch_fused`` reads it, when the coordinator fuses it with others of its key."""

    tensor: torch.Tensor  # what synchronize returns
    target: torch.Tensor  # its detached view, reduced in place
    op: ReduceOp
    prescale_factor: float
    postscale_factor: float
    process_set: ProcessSet


# ---- allreduce ----------------------------------------------------------------------------


def allreduce_async_(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                     process_set=global_process_set, _what: str = "allreduce", _fusable: bool = True) -> Handle:
    """Start reducing ``tensor`` in place; returns a handle for ``synchronize``.

    ``op=Average`` (the default) divides the sum by the set's size; on integer tensors the
    result is truncated toward zero, as Horovod's. (``_fusable=False``: ``tensor`` is a fusion
    buffer already, which the engine must not copy into another.)
    """
    _check_tensor(tensor, "allreduce")
    op = _resolve_op(op, average)
    if op == Adasum:  # not element-wise: its own data op (``_adasum.py``)
        return _adasum.allreduce_async_(tensor, name, prescale_factor, postscale_factor, process_set, _what, _fusable)
    require_member(process_set, _what)
    size = process_set.size()
    desc = describe(tensor)
    target = tensor.detach()  # written in place below: a detached view needs no torch.no_grad()
    inline = None
    if _inline.fits(tensor, size):  # small: the data rides in the control frames
        inline = scaled(target, prescale_factor).reshape(-1).contiguous()

    def launch(answer, result):
        if inline is not None:
            target.copy_(_inline.read(result, inline.dtype).view_as(target))
            return [], finish
        wire = target if target.is_contiguous() else target.contiguous()  # c10d reduces strided ones wrong
        widened = wire.to(torch.int32) if reduced_via_int32(wire.dtype, wire.device) else None
        reduced = wire if widened is None else widened
        scale_(reduced, prescale_factor)
        work = dist.all_reduce(reduced, op=_C10D_OPS[op], group=process_set.group, async_op=True)
        state["wire"], state["widened"] = wire, widened
        return [work], finish

    state: dict = {}

    def finish():
        wire, widened = state.get("wire"), state.get("widened")
        if widened is not None:
            if op == Average and size > 1:
                widened = torch.div(widened * postscale_factor, size, rounding_mode="trunc")
                postscale = 1.0
            else:
                postscale = postscale_factor
            scale_(widened, postscale)
            wire.copy_(widened.to(wire.dtype) if wire.dtype != torch.bool else widened > 0)
            if wire is not target:
                target.copy_(wire)
            return tensor
        if wire is not None and wire is not target:
            target.copy_(wire)
        _scale_after(target, op, size, postscale_factor)
        return tensor

    fusable = _fusable and inline is None and not reduced_via_int32(tensor.dtype, tensor.device)
    return submit(process_set, Op(
        kind="allreduce", name=name, signature=f"{op.name}|{desc}|{prescale_factor}|{postscale_factor}",
        description=f"{_what}(op={op.name}: {desc})", joinable=op in (Sum, Average),
        inline=None if inline is None else _inline.wire_bytes(inline), launch=launch, nbytes=nbytes(tensor),
        layout=_all_reduce_layout([[tensor]], tensor.is_cuda) if inline is None else _inline_layout(inline, op),
        fusion_key=f"allreduce|{op.name}|{tensor.dtype}|{tensor.device}|{prescale_factor}|{postscale_factor}"
        if fusable else None,
        launch_fused=_launch_fused,
        fusion_part=_FusablePart(tensor, target, op, prescale_factor, postscale_factor, process_set)))


def _launch_fused(ops: list, answer) -> list:
    """Allreduces the coordinator fused (one dtype, device, op and scaling, on one set): one c10d op over a
    flat copy of their tensors (Horovod's fusion buffer; pooled on CPU), each op's part copied back when it is
    synchronized. The buffer goes back to the pool once every part is out."""
    first = ops[0].fusion_part
    op, prescale_factor, postscale_factor, process_set = (first.op, first.prescale_factor, first.postscale_factor,
                                                          first.process_set)
    targets = [o.fusion_part.target for o in ops]
    pooled: list = []
    flat = _fused(targets, pooled)
    scale_(flat, prescale_factor)
    work = dist.all_reduce(flat, op=_C10D_OPS[op], group=process_set.group, async_op=True)
    left = [len(ops)]
    size = process_set.size()

    def finisher(tensor, target, offset):
        def finish():
            part = flat[offset:offset + target.numel()]
            _scale_after(part, op, size, postscale_factor)
            target.copy_(part.view_as(target))
            left[0] -= 1
            if not left[0]:
                for buffer in pooled:
                    _buffers.pool.give(buffer)
            return tensor
        return finish

    launched, offset = [], 0
    for o in ops:
        part = o.fusion_part
        launched.append(([work], finisher(part.tensor, part.target, offset)))
        offset += part.target.numel()
    return launched


def allreduce_async(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                    process_set=global_process_set, _what: str = "allreduce") -> Handle:
    """Start reducing a copy of ``tensor`` (the input is unchanged)."""
    _check_tensor(tensor, "allreduce")
    return allreduce_async_(tensor.detach().clone(), average, name, op, prescale_factor, postscale_factor,
                            process_set, _what)


def allreduce_(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
               process_set=global_process_set) -> torch.Tensor:
    """Reduce ``tensor`` across the ranks in place and return it."""
    return now(allreduce_async_, tensor, average, name, op, prescale_factor, postscale_factor, process_set)


def _fused(members: list, pooled: list) -> torch.Tensor:
    """``members`` as one flat tensor: a view of a lone member, else a copy (into a pooled buffer on CPU)."""
    if len(members) == 1:
        return members[0].detach().reshape(-1)
    numel = sum(m.numel() for m in members)
    if members[0].device.type != "cpu":
        return _flatten_dense_tensors([m.detach() for m in members])
    buffer = _buffers.pool.take(members[0].dtype, numel)
    pooled.append(buffer)
    return torch.cat([m.detach().reshape(-1) for m in members], out=buffer[:numel])


def grouped_allreduce_async_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                             postscale_factor=1.0, process_set=global_process_set) -> Handle:
    """Start reducing a list of tensors in place, fused into one flat buffer per dtype and device.

    The list is one op for negotiation: its tensors are reduced together or not at all.
    """
    tensors = list(tensors)
    for t in tensors:
        _check_tensor(t, "grouped_allreduce")
    devices = sorted({str(t.device) for t in tensors})
    if len(devices) > 1:  # as Horovod: one group, one device
        raise RuntimeError(f"grouped_allreduce takes tensors on one device, got tensors on {', '.join(devices)}; "
                           "move them to one device, or reduce each device's tensors in a group of their own.")
    op = _resolve_op(op, average)
    if op == Adasum:  # not element-wise: its own data op (``_adasum.py``)
        return _adasum.grouped_allreduce_async_(tensors, name, prescale_factor, postscale_factor, process_set)
    require_member(process_set, "grouped_allreduce")
    size = process_set.size()
    desc = ", ".join(describe(t) for t in tensors)
    buckets = _buffers.pack(tensors, _buffers.fusion_threshold())
    inline = None
    if len(buckets) == 1 and tensors and _inline.fits(tensors[0], size, sum(map(nbytes, tensors))):
        with torch.no_grad():  # fused only once it is known to fit: a large group is not copied here
            inline = scaled(torch.cat([t.detach().reshape(-1) for t in tensors]), prescale_factor)
    flats, pooled = [], []

    def launch(answer, result):
        if inline is not None:
            flats.append((_inline.read(result, inline.dtype), tensors))
            return [], finish
        works = []
        with torch.no_grad():
            for members in buckets:
                flat = scaled(_fused(members, pooled), prescale_factor)  # not in place: may view the only member
                if reduced_via_int32(flat.dtype, flat.device):
                    flat = flat.to(torch.int32)  # copied back into the members' own dtype in finish()
                works.append(dist.all_reduce(flat, op=_C10D_OPS[op], group=process_set.group, async_op=True))
                flats.append((flat, members))
        return works, finish

    def finish():
        with torch.no_grad():
            for flat, members in flats:
                _scale_after(flat, op, size, postscale_factor)
                for t, reduced in zip(members, _unflatten_dense_tensors(flat, members)):
                    t.copy_(reduced)
        for buffer in pooled:
            _buffers.pool.give(buffer)
        return tuple(tensors)

    layout = None  # an empty group: nothing a joined rank could stand in for
    if inline is not None:
        layout = _inline_layout(inline, op)
    elif tensors:
        layout = _all_reduce_layout(buckets, tensors[0].is_cuda)
    return submit(process_set, Op(
        kind="grouped_allreduce", name=name, signature=f"{op.name}|{desc}|{prescale_factor}|{postscale_factor}",
        description=f"grouped_allreduce(op={op.name}: {desc})", joinable=op in (Sum, Average) and layout is not None,
        inline=None if inline is None else _inline.wire_bytes(inline), launch=launch,
        nbytes=sum(map(nbytes, tensors)), layout=layout))


def grouped_allreduce_async(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                            postscale_factor=1.0, process_set=global_process_set) -> Handle:
    """Start reducing copies of a list of tensors."""
    return grouped_allreduce_async_([t.detach().clone() for t in tensors], average, name, op,
                                    prescale_factor, postscale_factor, process_set)


def grouped_allreduce_(tensors, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                       process_set=global_process_set) -> tuple:
    """Reduce a list of tensors in place (fused); returns them, as a tuple (as Horovod)."""
    return now(grouped_allreduce_async_, tensors, average, name, op, prescale_factor, postscale_factor,
                                                process_set)


# ---- broadcast ----------------------------------------------------------------------------

def broadcast_async_(tensor, root_rank, name=None, process_set=global_process_set) -> Handle:
    """Start overwriting ``tensor`` with rank ``root_rank``'s value, in place."""
    _check_tensor(tensor, "broadcast")
    require_member(process_set, "broadcast")
    desc = describe(tensor)
    state: dict = {}

    def launch(answer, result):
        wire = _wire(tensor.detach())
        state["wire"] = wire
        with torch.no_grad():
            return [dist.broadcast(wire, src=root_rank, group=process_set.group, async_op=True)], finish

    def finish():
        wire = state["wire"]
        if not tensor.is_contiguous():  # the data went into a contiguous copy
            with torch.no_grad():
                tensor.copy_(_unwire(wire, tensor.dtype, tensor.shape))
        return tensor

    return submit(process_set, Op(
        kind="broadcast", name=name, signature=f"{root_rank}|{desc}", description=f"broadcast(root_rank={root_rank}: "
        f"{desc})", argument_error=_root_problem(root_rank, process_set), launch=launch, nbytes=nbytes(tensor)))


def broadcast_async(tensor, root_rank, name=None, process_set=global_process_set) -> Handle:
    """Start broadcasting into a copy of ``tensor``."""
    _check_tensor(tensor, "broadcast")
    return broadcast_async_(tensor.detach().clone(), root_rank, name, process_set)


def broadcast_(tensor, root_rank, name=None, process_set=global_process_set) -> torch.Tensor:
    """Overwrite ``tensor`` with rank ``root_rank``'s value, in place; returns it."""
    return now(broadcast_async_, tensor, root_rank, name, process_set)


# ---- allgather ----------------------------------------------------------------------------

def gather_ints(values: list, device, process_set=global_process_set) -> list:
    """Every member's list of ints (same length on every member), as tuples in set-rank order."""
    mine = torch.tensor([values], dtype=torch.int64)
    gathered = now(allgather_async, mine, process_set=process_set)
    return [tuple(int(x) for x in row) for row in gathered.tolist()]


def allgather_async(tensor, name=None, process_set=global_process_set, _problem=None) -> Handle:
    """Start concatenating every member's ``tensor`` along the first dimension, in rank order.

    The first dimension may differ between ranks; the others must match.
    """
    _check_tensor(tensor, "allgather")
    require_member(process_set, "allgather")
    t = tensor.detach().reshape(1) if tensor.dim() == 0 else tensor.detach()
    desc = describe(t, skip_first_dim=True)
    trailing = tuple(t.shape[1:])
    out: dict = {}

    def launch(answer, result):
        rows = [r or 0 for r in answer.rank_values]  # every member's first dimension
        longest = max(rows)
        padded = t if t.shape[0] == longest else torch.cat([t, t.new_zeros((longest - t.shape[0],) + trailing)])
        wire = _wire(padded)
        gathered = [torch.empty_like(wire) for _ in rows]
        out["rows"], out["gathered"] = rows, gathered
        return [dist.all_gather(gathered, wire, group=process_set.group, async_op=True)], finish

    def finish():
        longest = max(out["rows"])
        return torch.cat([_unwire(g, t.dtype, (longest,) + trailing)[:n] for g, n in zip(out["gathered"], out["rows"])])

    return submit(process_set, Op(
        kind="allgather", name=name, signature=desc, description=f"allgather({desc})", rank_value=int(t.shape[0]),
        argument_error=_problem, launch=launch, nbytes=nbytes(t) * process_set.size()))


def sparse_allreduce_async(tensor, name=None, op=Average, process_set=global_process_set) -> Handle:
    """Start reducing a sparse COO tensor, as Horovod does: every rank's indices and values are
    gathered, and the result is their (uncoalesced) sparse sum, divided by the size for Average.

    The handle is callable for the result (Horovod returns a function) or goes to ``synchronize``.
    """
    op = _resolve_op(op, None)
    if op not in (Average, Sum):
        raise ValueError(f"sparse_allreduce_async supports op=hvd.Average or hvd.Sum, got {op.name}.")
    size = process_set.size()
    names = (None, None) if name is None else (f"{name}.indices", f"{name}.values")
    if not isinstance(tensor, torch.Tensor) or tensor.layout != torch.sparse_coo:  # a dense one on some rank
        problem = (f"sparse_allreduce_async takes a sparse COO tensor, got "
                   f"{getattr(tensor, 'layout', type(tensor).__name__)}; use allreduce_async for dense ones.")
        stand_ins = [allgather_async(torch.empty(0, 1, dtype=torch.int64), names[0], process_set, _problem=problem),
                     allgather_async(torch.empty(0), names[1], process_set, _problem=problem)]  # the others' two ops
        synchronize(GroupHandle(stand_ins, lambda: None, "sparse_allreduce"))  # every rank raises the problem
    problem = None
    indices = allgather_async(tensor._indices().t().contiguous(), names[0], process_set=process_set,
                              _problem=problem)
    values = allgather_async(tensor._values(), names[1], process_set=process_set)

    def finish():
        gathered = values.wait()
        if op == Average:
            gathered = gathered / size if gathered.is_floating_point() else torch.div(gathered, size,
                                                                                       rounding_mode="trunc")
        return torch.sparse_coo_tensor(indices.wait().t(), gathered, tensor.shape, check_invariants=True)

    return GroupHandle([indices, values], finish, "sparse_allreduce")


def grouped_allgather_async(tensors, name=None, process_set=global_process_set) -> Handle:
    """Start ``allgather`` of each tensor in a list; ``synchronize`` returns a tuple of results."""
    handles = [allgather_async(t, None if name is None else f"{name}.{i}", process_set=process_set)
               for i, t in enumerate(tensors)]
    return GroupHandle(handles, lambda: tuple(h.wait() for h in handles), "grouped_allgather")


# ---- alltoall, reducescatter --------------------------------------------------------------

def alltoall_async(tensor, splits=None, name=None, process_set=global_process_set) -> Handle:
    """Start sending ``splits[i]`` rows of ``tensor`` to rank i; the result is (tensor, received splits)."""
    _check_tensor(tensor, "alltoall")
    require_member(process_set, "alltoall")
    n = process_set.size()
    rows = tensor.shape[0] if tensor.dim() else 0
    problem = None
    if tensor.dim() == 0:  # every rank raises this, not this rank alone
        problem, splits = "alltoall needs a tensor with at least one dimension; got a scalar.", [0] * n
    elif splits is None:
        if rows % n:
            problem = (f"alltoall without splits needs the first dimension ({rows}) to be divisible by the "
                       f"number of ranks ({n}); pass splits= to send uneven parts.")
        splits = [rows // n] * n
    # Horovod returns the received splits like the splits given: a tensor's dtype and device, else int32 on CPU
    like = splits if isinstance(splits, torch.Tensor) else torch.empty(0, dtype=torch.int32)
    splits = [int(s) for s in (splits.tolist() if isinstance(splits, torch.Tensor) else splits)]
    if problem is None and (len(splits) != n or any(s < 0 for s in splits) or sum(splits) != rows):
        problem = (f"alltoall splits {splits} must be {n} non-negative counts (one per rank) that add up "
                   f"to the first dimension ({rows}).")
    desc = describe(tensor, skip_first_dim=True)
    out: dict = {}

    trailing = tuple(tensor.shape[1:])
    as_bytes = moved_as_bytes(tensor)

    def launch(answer, result):
        me = process_set.rank()
        received = [int(row[me]) for row in answer.rank_values]  # every member's splits: what each sends here
        src = tensor.detach().contiguous()
        if as_bytes:  # gloo moves bytes: rows of bytes
            row_bytes = tensor.element_size() * math.prod(trailing)
            src = src.view(torch.uint8).reshape(rows, row_bytes) if src.numel() else src.new_empty(
                (rows, row_bytes), dtype=torch.uint8)
        output = src.new_empty((sum(received),) + tuple(src.shape[1:]))
        out["output"], out["received"] = output, received
        work = dist.all_to_all_single(output, src, output_split_sizes=received, input_split_sizes=splits,
                                      group=process_set.group, async_op=True)
        return [work], finish

    def finish():
        output = out["output"]
        if as_bytes:
            output = _unwire(output, tensor.dtype, (sum(out["received"]),) + trailing)
        return output, torch.tensor(out["received"], dtype=like.dtype, device=like.device)

    return submit(process_set, Op(
        kind="alltoall", name=name, signature=desc, description=f"alltoall({desc})", rank_value=splits,
        argument_error=problem, launch=launch, nbytes=nbytes(tensor)))


# torch 2.13 renamed reduce_scatter_tensor (which now warns on every call) to reduce_scatter_single
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


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
    if op == Adasum:  # NotImplementedError (a RuntimeError), as Horovod's test_horovod_reducescatter_adasum expects
        raise NotImplementedError("reducescatter does not support op=hvd.Adasum (nor does Horovod); use op=hvd.Average "
                                  "or hvd.Sum, or allreduce with op=hvd.Adasum.")
    if op not in (Average, Sum):
        raise ValueError(f"reducescatter supports op=hvd.Average or hvd.Sum, got {op.name}.")
    require_member(process_set, "reducescatter")
    scalar = "reducescatter needs a tensor with at least one dimension; got a scalar." if tensor.dim() == 0 else None
    desc = describe(tensor)
    n = process_set.size()
    out: dict = {}

    def launch(answer, result):
        me = process_set.rank()
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
            widened = reduced_via_int32(src.dtype, src.device)
            if widened:
                src = src.to(torch.int32)
            result_ = src.new_empty((longest,) + trailing)
            work = _reduce_scatter(result_, src.contiguous(), op=dist.ReduceOp.SUM, group=process_set.group,
                                   async_op=True)
        out["result"], out["count"] = result_, counts[me]
        return [work], finish

    def finish():
        mine = out["result"][:out["count"]]
        with torch.no_grad():
            _scale_after(mine, op, n, postscale_factor)
        return mine.to(tensor.dtype) if mine.dtype != tensor.dtype else mine

    return submit(process_set, Op(
        kind="reducescatter", name=name, signature=f"{op.name}|{desc}|{prescale_factor}|{postscale_factor}",
        description=f"reducescatter(op={op.name}: {desc})", argument_error=_problem or scalar, launch=launch,
        nbytes=nbytes(tensor)))


def grouped_reducescatter_async(tensors, name=None, op=Average, process_set=global_process_set, prescale_factor=1.0,
                                postscale_factor=1.0) -> Handle:
    """Start ``reducescatter`` of each tensor in a list; ``synchronize`` returns a tuple of results."""
    handles = [reducescatter_async(t, None if name is None else f"{name}.{i}", op=op, process_set=process_set,
                                   prescale_factor=prescale_factor, postscale_factor=postscale_factor)
               for i, t in enumerate(tensors)]
    return GroupHandle(handles, lambda: tuple(h.wait() for h in handles), "grouped_reducescatter")


def check(what: str, tensors: list, process_set=global_process_set, extra: str = "", problem=None) -> None:
    """Fail on every rank unless every member passes matching ``tensors`` (no data moves)."""
    require_member(process_set, what)
    desc = ", ".join(describe(t) for t in tensors)
    text = f"{extra}: {desc}" if extra else desc
    now(submit, process_set, Op(kind="check", name=what, signature=text, description=f"{what}({text})",
                                 argument_error=problem, launch=lambda answer, result: ([], None)))


def barrier(process_set=global_process_set) -> None:
    """Wait until every rank of the set has reached this call."""
    require_member(process_set, "barrier")
    now(submit, process_set, Op(kind="barrier", name=None, signature="", description="barrier()",
                                 launch=lambda answer, result: ([], None)))
