"""Horovod's allgather on c10d (every member's rows, in rank order; the first dimension may differ), of one tensor
or each of a list, and what is made of allgathers: the sparse allreduce, and ``gather_ints``."""

from __future__ import annotations

import torch
import torch.distributed as dist

from .._engine.ops import Handle, Op
from ._handles import GroupHandle, synchronize
from ._ops import _check_tensor, _unwire, _wire, now
from ._process_sets import global_process_set, require_member
from ._reduction import Average, Sum, resolve_op
from ._submit import describe, nbytes, submit


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
    op = resolve_op(op, None)
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
