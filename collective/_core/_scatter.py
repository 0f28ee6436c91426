"""Horovod's alltoall (rows sent to each rank by its split) and reducescatter (each rank keeps its rows of the
reduction) on c10d, of one tensor or, for reducescatter, each of a list."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from .._engine.ops import Handle, Op
from ._handles import GroupHandle
from ._ops import _check_tensor, _scale_after, _unwire, moved_as_bytes, reduced_via_int32
from ._process_sets import global_process_set, require_member
from ._reduction import Adasum, Average, Sum, resolve_op
from ._scale import scaled
from ._submit import describe, nbytes, submit


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
    op = resolve_op(op, None)
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
