"""What Horovod's tensor collectives on c10d share: argument checks, the blocking form, the bytes a backend moves.

Every op takes ``process_set=`` (default: every rank) and goes to the background engine
(``collective/_engine/engine.py``), which matches it across ranks by name (explicit, or an automatic
one: the n-th unnamed op of its kind on the set) and starts its data op in the order the set's
coordinator gives. Each op function describes its op (``Op``): what must agree across ranks, and
``launch``, which starts the c10d op once every member has submitted it. The ops, by family:
``_allreduce.py`` (allreduce and grouped allreduce, fused), ``_broadcast.py``, ``_allgather.py``
(allgather, grouped, and the sparse allreduce made of two), ``_scatter.py`` (alltoall,
reducescatter), ``_barrier.py`` (barrier and check, which move no data). The frameworks wrap
these: torch's differentiable out-of-place ops are ``collective/torch/_autograd.py``, TensorFlow's
ops and gradients ``collective/tensorflow/_ops.py``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from . import _submit
from ._handles import synchronize
from ._process_sets import ProcessSet, global_process_set, require_member
from ._reduction import Average, Max, Min, Product, ReduceOp, Sum
from ._scale import scale_

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

