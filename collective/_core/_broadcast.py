"""Horovod's broadcast on c10d: rank ``root_rank``'s tensor to every member, in place, into a copy, or blocking."""

from __future__ import annotations

import torch
import torch.distributed as dist

from .._engine.ops import Handle, Op
from ._ops import _check_tensor, _root_problem, _unwire, _wire, now
from ._process_sets import global_process_set, require_member
from ._submit import describe, nbytes, submit


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
