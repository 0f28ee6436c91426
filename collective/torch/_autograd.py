"""The blocking, out-of-place collectives, differentiable as in Horovod.

Gradients are Horovod 0.28's (a known wart, kept so that ported training behaves the same):
allreduce's is the same allreduce of the incoming gradient; broadcast's is the *average* of the
ranks' gradients on the root and zero elsewhere; allgather's is this rank's slice of the
*averaged* gradient; alltoall's sends the gradient back along the received splits;
reducescatter's is the allgather of the gradient, times the scale factors, times the set's
size for Sum (and not divided for Average). Against the exact derivative of the sum of every
rank's loss, broadcast's and allgather's are 1/size of it and reducescatter's size times it.
"""

from __future__ import annotations

import torch

from .._core._allgather import allgather_async, gather_ints
from .._core._allreduce import allreduce_async, grouped_allreduce_async, paired_now
from .._core._broadcast import broadcast_async
from .._core._ops import _check_tensor, now
from .._core._process_sets import global_process_set
from .._core._reduction import Average, Sum, resolve_op
from .._core._scatter import alltoall_async, reducescatter_async
from .._engine import communicator as _engine
from ._compression import Compression


class _Allreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, op, prescale, postscale, process_set, name=None):
        ctx.args = (op, prescale, postscale, process_set)
        done = paired_now(tensor, None, name, op, prescale, postscale, process_set, copy=True)
        if done is not None:
            return done
        return now(allreduce_async, tensor, name=name, op=op, prescale_factor=prescale,
                                                postscale_factor=postscale, process_set=process_set)

    @staticmethod
    def backward(ctx, grad):
        op, prescale, postscale, process_set = ctx.args
        return _Allreduce.apply(grad, op, prescale, postscale, process_set), None, None, None, None, None


def allreduce(tensor, average=None, name=None, compression=Compression.none, op=None, prescale_factor=1.0,
              postscale_factor=1.0, process_set=global_process_set) -> torch.Tensor:
    """Reduce ``tensor`` across the ranks; returns a new tensor (the input is unchanged).

    ``op``: ``Average`` (default), ``Sum``, ``Min``, ``Max``, ``Product``; the legacy
    ``average=`` is accepted. ``compression`` casts floating-point tensors for the wire.
    """
    _check_tensor(tensor, "allreduce")
    op = resolve_op(op, average)
    wire, ctx = compression.compress(tensor)
    out = _Allreduce.apply(wire, op, prescale_factor, postscale_factor, process_set, name)
    return compression.decompress(out, ctx)


class _GroupedAllreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, op, prescale, postscale, process_set, *tensors):
        ctx.args = (op, prescale, postscale, process_set)
        return tuple(now(grouped_allreduce_async,
            tensors, op=op, prescale_factor=prescale, postscale_factor=postscale, process_set=process_set))

    @staticmethod
    def backward(ctx, *grads):
        return (None, None, None, None) + tuple(_GroupedAllreduce.apply(*ctx.args, *grads))


def grouped_allreduce(tensors, average=None, name=None, compression=Compression.none, op=None,
                      prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set) -> tuple:
    """Reduce a list of tensors in one fused operation; returns new tensors."""
    op = resolve_op(op, average)
    wires = [compression.compress(t) for t in tensors]
    outs = _GroupedAllreduce.apply(op, prescale_factor, postscale_factor, process_set, *[w for w, _ in wires])
    return tuple(compression.decompress(o, c) for o, (_, c) in zip(outs, wires))


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, root_rank, process_set, name=None):
        ctx.args = (root_rank, process_set)
        return now(broadcast_async, tensor, root_rank, name=name, process_set=process_set)

    @staticmethod
    def backward(ctx, grad):
        root_rank, process_set = ctx.args
        averaged = _Allreduce.apply(grad, Average, 1.0, 1.0, process_set)
        return (averaged if _engine.topology().rank == root_rank else torch.zeros_like(averaged)), None, None, None


def broadcast(tensor, root_rank, name=None, process_set=global_process_set) -> torch.Tensor:
    """Rank ``root_rank``'s value of ``tensor`` (a job-wide rank, also within a process set), as a new tensor."""
    _check_tensor(tensor, "broadcast")
    return _Broadcast.apply(tensor, root_rank, process_set, name)


class _Allgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, process_set, name=None):
        ctx.args = (tensor.shape[0] if tensor.dim() else 1, process_set)
        return now(allgather_async, tensor, name=name, process_set=process_set)

    @staticmethod
    def backward(ctx, grad):
        rows, process_set = ctx.args
        averaged = _Allreduce.apply(grad, Average, 1.0, 1.0, process_set)
        counts = [c[0] for c in gather_ints([rows], grad.device, process_set)]
        return averaged.narrow(0, sum(counts[:process_set.rank()]), rows), None, None


def allgather(tensor, name=None, process_set=global_process_set) -> torch.Tensor:
    """Concatenate every rank's ``tensor`` along the first dimension (which may differ), in rank order."""
    _check_tensor(tensor, "allgather")
    return _Allgather.apply(tensor, process_set, name)


def grouped_allgather(tensors, name=None, process_set=global_process_set) -> tuple:
    """``allgather`` of each tensor in a list."""
    return tuple(allgather(t, process_set=process_set) for t in tensors)


class _Alltoall(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, splits, process_set):
        output, received = now(alltoall_async, tensor, splits, process_set=process_set)
        ctx.args = (received, process_set)
        ctx.mark_non_differentiable(received)
        return output, received

    @staticmethod
    def backward(ctx, grad, _):
        received, process_set = ctx.args
        back, _ = _Alltoall.apply(grad.contiguous(), received, process_set)
        return back, None, None


def alltoall(tensor, splits=None, name=None, process_set=global_process_set):
    """Send ``splits[i]`` rows of ``tensor`` to rank i (even parts without splits).

    Returns the received tensor (rows from rank 0 first) and, as in Horovod, only when
    ``splits`` is given, also the received splits: ``(tensor, received_splits)``.
    """
    _check_tensor(tensor, "alltoall")
    output, received = _Alltoall.apply(tensor, splits, process_set)
    return output if splits is None else (output, received)


class _Reducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, op, prescale, postscale, process_set):
        ctx.args = (op, process_set, prescale * postscale)
        return now(reducescatter_async, tensor, op=op, process_set=process_set,
                                                    prescale_factor=prescale, postscale_factor=postscale)

    @staticmethod
    def backward(ctx, grad):
        op, process_set, scale = ctx.args
        if op == Sum:
            scale *= process_set.size()
        return _Allgather.apply(grad.contiguous(), process_set) * scale, None, None, None, None


def reducescatter(tensor, name=None, compression=Compression.none, op=Average,
                  process_set=global_process_set, prescale_factor=1.0, postscale_factor=1.0) -> torch.Tensor:
    """Reduce ``tensor`` across the ranks and keep this rank's rows of the result.

    The first dimension is divided as evenly as possible; lower ranks take the extra rows.
    """
    _check_tensor(tensor, "reducescatter")
    wire, ctx = compression.compress(tensor)
    out = _Reducescatter.apply(wire, op, prescale_factor, postscale_factor, process_set)
    return compression.decompress(out, ctx)


def grouped_reducescatter(tensors, name=None, compression=Compression.none, op=Average,
                          process_set=global_process_set, prescale_factor=1.0, postscale_factor=1.0) -> tuple:
    """``reducescatter`` of each tensor in a list."""
    return tuple(reducescatter(t, compression=compression, op=op, process_set=process_set,
                               prescale_factor=prescale_factor, postscale_factor=postscale_factor)
                 for t in tensors)
