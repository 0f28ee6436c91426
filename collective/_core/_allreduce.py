"""Horovod's allreduce on c10d: in place, out of place and blocking, of one tensor or a group (fused per dtype).

Small reductions ride inline in the control frames (``_inline.py``); dtypes a backend cannot reduce
run widened to int32; allreduces ready together are fused by the coordinator into one c10d op
(``_launch_fused``); op=Adasum has its own data op (``_adasum.py``). The shared helpers are ``_ops.py``'s.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from .._engine import communicator as _engine
from .._engine.messages import ALL_REDUCE, INLINE, Layout, Request
from .._engine.ops import Handle, Op
from . import _adasum, _buffers, _inline
from ._ops import _C10D_OPS, _check_tensor, _scale_after, now, reduced_via_int32
from ._process_sets import ProcessSet, global_process_set, require_member
from ._reduction import Adasum, Average, ReduceOp, Sum, resolve_op
from ._scale import scale_, scaled
from ._submit import describe, nbytes, submit


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


def _narrow(widened: torch.Tensor, wire: torch.Tensor, target: torch.Tensor, op: ReduceOp, size: int,
            postscale_factor: float) -> None:
    """A reduction run widened to int32 (``reduced_via_int32``), scaled and back in ``wire``'s dtype, then in
    ``target``: an average is one truncation, of sum * postscale / size, as Horovod's."""
    if op == Average and size > 1:
        widened = torch.div(widened * postscale_factor, size, rounding_mode="trunc")
        postscale = 1.0
    else:
        postscale = postscale_factor
    scale_(widened, postscale)
    wire.copy_(widened.to(wire.dtype) if wire.dtype != torch.bool else widened > 0)
    if wire is not target:
        target.copy_(wire)


def _strings(tensor: torch.Tensor, op: ReduceOp, prescale_factor: float, postscale_factor: float, what: str) -> tuple:
    """An allreduce's ``Request.signature`` and ``description``."""
    desc = describe(tensor)
    return f"{op.name}|{desc}|{prescale_factor}|{postscale_factor}", f"{what}(op={op.name}: {desc})"


def allreduce_async_(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                     process_set=global_process_set, _what: str = "allreduce", _fusable: bool = True) -> Handle:
    """Start reducing ``tensor`` in place; returns a handle for ``synchronize``.

    ``op=Average`` (the default) divides the sum by the set's size; on integer tensors the
    result is truncated toward zero, as Horovod's. (``_fusable=False``: ``tensor`` is a fusion
    buffer already, which the engine must not copy into another.)
    """
    _check_tensor(tensor, "allreduce")
    op = resolve_op(op, average)
    if op == Adasum:  # not element-wise: its own data op (``_adasum.py``)
        return _adasum.allreduce_async_(tensor, name, prescale_factor, postscale_factor, process_set, _what, _fusable)
    require_member(process_set, _what)
    return submit(process_set, _op(tensor, op, name, prescale_factor, postscale_factor, process_set, _what, _fusable))


def _op(tensor, op: ReduceOp, name, prescale_factor: float, postscale_factor: float, process_set: ProcessSet,
        _what: str = "allreduce", _fusable: bool = True) -> Op:
    """The ``Op`` of an element-wise allreduce of ``tensor`` in place, for ``submit``."""
    size = process_set.size()
    signature, description = _strings(tensor, op, prescale_factor, postscale_factor, _what)
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
            _narrow(widened, wire, target, op, size, postscale_factor)
            return tensor
        if wire is not None and wire is not target:
            target.copy_(wire)
        _scale_after(target, op, size, postscale_factor)
        return tensor

    fusable = _fusable and inline is None and not reduced_via_int32(tensor.dtype, tensor.device)
    return Op(
        kind="allreduce", name=name, signature=signature, description=description, joinable=op in (Sum, Average),
        inline=None if inline is None else _inline.wire_bytes(inline), launch=launch, nbytes=nbytes(tensor),
        layout=_all_reduce_layout([[tensor]], tensor.is_cuda) if inline is None else _inline_layout(inline, op),
        fusion_key=f"allreduce|{op.name}|{tensor.dtype}|{tensor.device}|{prescale_factor}|{postscale_factor}"
        if fusable else None,
        launch_fused=_launch_fused,
        fusion_part=_FusablePart(tensor, target, op, prescale_factor, postscale_factor, process_set))


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
    done = paired_now(tensor, average, name, op, prescale_factor, postscale_factor, process_set)
    if done is not None:
        return done
    return now(allreduce_async_, tensor, average, name, op, prescale_factor, postscale_factor, process_set)


_pair_requests: dict = {}  # (dtype, shape, op, prescale, postscale) -> the Request of such a small reduction


def paired_now(tensor, average, name, op, prescale_factor, postscale_factor, process_set,
               copy: bool = False) -> torch.Tensor | None:
    """A blocking small CPU reduction in a set of two, in place (``copy``: of a copy), worked out in this thread
    without the engine's turns (``Engine.pair_now``): the reduced tensor, or None where the usual path runs the op
    (and raises what is wrong with its arguments)."""
    if not (isinstance(tensor, torch.Tensor) and isinstance(process_set, ProcessSet) and process_set.size() == 2
            and _inline.fits(tensor, 2) and process_set.included()):
        return None
    op = resolve_op(op, average)
    if op == Adasum:
        return None
    if copy:
        tensor = tensor.detach().clone()
    target = tensor.detach()
    array = None  # the tensor as numpy sees it, where numpy handles its bytes (cheaper per call than torch's views)
    if prescale_factor == 1.0 and target.dtype in _inline.NUMPY_OF:
        try:
            array = target.numpy()
        except (RuntimeError, TypeError):  # a view with torch's negative bit, say: torch's own way below
            pass
    if array is not None:
        data = memoryview(np.ascontiguousarray(array)).cast("B")
    else:
        data = _inline.wire_bytes(scaled(target, prescale_factor).reshape(-1).contiguous())
    key = (tensor.dtype, tensor.shape, op, prescale_factor, type(prescale_factor), postscale_factor,
           type(postscale_factor))  # 1 and 1.0 are equal keys, but their signatures differ
    template = _pair_requests.get(key)
    if template is None:
        if len(_pair_requests) >= 1024:  # shapes made afresh each step: kept bounded
            _pair_requests.clear()
        signature, description = _strings(tensor, op, prescale_factor, postscale_factor, "allreduce")
        template = _pair_requests[key] = Request("", "allreduce", signature, description, joinable=op in (Sum, Average),
                                                 inline=nbytes(tensor), layout=_inline_layout(target, op))
    done = _engine.engine().pair_now(process_set.link_id, "allreduce", name, template, data,
                                     lambda: _op(tensor, op, name, prescale_factor, postscale_factor, process_set))
    if done is None:
        return None
    if isinstance(done, Handle):
        return done.wait()
    if array is not None and 0 not in array.strides:  # (a stride-0 view goes to torch's copy_, which refuses it)
        array[...] = np.frombuffer(done, array.dtype).reshape(array.shape)
        torch.autograd.graph.increment_version(target)  # as an in-place torch op: autograd sees the tensor changed
    else:
        target.copy_(_inline.read(done, target.dtype).view_as(target))
    if op == Average or postscale_factor != 1.0:
        _scale_after(target, op, 2, postscale_factor)
    return tensor


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
    op = resolve_op(op, average)
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
