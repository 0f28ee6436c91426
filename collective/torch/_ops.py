"""Horovod's tensor collectives on the c10d process group (the unfused reference path)."""

from __future__ import annotations

import enum

import torch
import torch.distributed as dist

from .. import _engine


class ReduceOp(enum.IntEnum):
    """Horovod's reduction operations."""

    Average = 0
    Sum = 1
    Adasum = 2
    Min = 3
    Max = 4
    Product = 5


Average = ReduceOp.Average
Sum = ReduceOp.Sum
Adasum = ReduceOp.Adasum
Min = ReduceOp.Min
Max = ReduceOp.Max
Product = ReduceOp.Product

_C10D_OPS = {Sum: dist.ReduceOp.SUM, Min: dist.ReduceOp.MIN, Max: dist.ReduceOp.MAX,
             Product: dist.ReduceOp.PRODUCT}


def _resolve_op(op, average) -> ReduceOp:
    if op is not None and average is not None:
        raise ValueError("allreduce got both op= and the legacy average=; pass only op=hvd.Average or op=hvd.Sum.")
    if op is None:
        return Sum if average is False else Average
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


def allreduce_(tensor: torch.Tensor, average=None, name=None, op=None, prescale_factor=1.0,
               postscale_factor=1.0) -> torch.Tensor:
    """Reduce ``tensor`` across all ranks in place and return it.

    ``op=Average`` (the default) divides the sum by ``size()``; on integer tensors that
    division rounds down (floor), as integer arithmetic must.
    """
    _check_tensor(tensor, "allreduce")
    op = _resolve_op(op, average)
    size = _engine.topology().size
    with torch.no_grad():
        if prescale_factor != 1.0:
            tensor.mul_(prescale_factor)
        dist.all_reduce(tensor, op=_C10D_OPS.get(op, dist.ReduceOp.SUM))
        if op == Average and size > 1:
            if tensor.is_floating_point() or tensor.is_complex():
                tensor.div_(size)
            else:
                tensor.floor_divide_(size)
        if postscale_factor != 1.0:
            tensor.mul_(postscale_factor)
    return tensor


def allreduce(tensor: torch.Tensor, average=None, name=None, op=None, prescale_factor=1.0,
              postscale_factor=1.0) -> torch.Tensor:
    """Reduce ``tensor`` across all ranks; returns a new tensor (the input is unchanged)."""
    _check_tensor(tensor, "allreduce")
    return allreduce_(tensor.detach().clone(), average=average, name=name, op=op,
                      prescale_factor=prescale_factor, postscale_factor=postscale_factor)


def broadcast_(tensor: torch.Tensor, root_rank: int, name=None) -> torch.Tensor:
    """Overwrite ``tensor`` with rank ``root_rank``'s value, in place; returns it."""
    _check_tensor(tensor, "broadcast")
    _check_root(root_rank)
    with torch.no_grad():
        dist.broadcast(tensor, src=root_rank)
    return tensor


def broadcast(tensor: torch.Tensor, root_rank: int, name=None) -> torch.Tensor:
    """Rank ``root_rank``'s value of ``tensor``, as a new tensor."""
    _check_tensor(tensor, "broadcast")
    return broadcast_(tensor.detach().clone(), root_rank, name)


def allgather(tensor: torch.Tensor, name=None) -> torch.Tensor:
    """Concatenate every rank's ``tensor`` along the first dimension, in rank order.

    The first dimension may differ between ranks; the others must match.
    """
    _check_tensor(tensor, "allgather")
    t = tensor.detach().reshape(1) if tensor.dim() == 0 else tensor.detach()
    ndims = _gather_ints([t.dim()], t.device)
    if len(set(ndims)) > 1:
        raise ValueError(f"allgather needs tensors with the same number of dimensions on every rank; "
                         f"got {[n[0] for n in ndims]} dimensions on ranks 0..{len(ndims) - 1}.")
    shapes = _gather_ints(list(t.shape), t.device)
    if len({s[1:] for s in shapes}) > 1:
        raise ValueError(f"allgather needs tensors whose dimensions after the first match on every rank; "
                         f"got shapes {[list(s) for s in shapes]} on ranks 0..{len(shapes) - 1}.")
    rows = [s[0] for s in shapes]
    longest = max(rows)
    padded = t if t.shape[0] == longest else torch.cat(
        [t, t.new_zeros((longest - t.shape[0],) + tuple(t.shape[1:]))])
    gathered = [torch.empty_like(padded) for _ in rows]
    dist.all_gather(gathered, padded.contiguous())
    return torch.cat([g[:n] for g, n in zip(gathered, rows)])


def _gather_ints(values: list, device) -> list:
    """Every rank's list of ints (same length on every rank), as tuples in rank order."""
    mine = torch.tensor(values, dtype=torch.int64, device=device)
    out = [torch.empty_like(mine) for _ in range(_engine.topology().size)]
    dist.all_gather(out, mine)
    return [tuple(int(x) for x in o.tolist()) for o in out]


def barrier() -> None:
    """Wait until every rank has reached this call."""
    _engine.topology()
    dist.barrier()


def _check_root(root_rank: int) -> None:
    size = _engine.topology().size
    if not isinstance(root_rank, int) or not 0 <= root_rank < size:
        raise ValueError(f"root_rank={root_rank!r} is outside the ranks 0..{size - 1} of this job.")
