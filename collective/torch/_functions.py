"""Broadcasting model and optimizer state, and arbitrary Python objects."""

from __future__ import annotations

import io

import torch
import torch.distributed as dist

from .. import _engine, _progress
from ._check import verify
from ._ops import _group, _root_problem, broadcast_, gather_ints
from ._process_sets import global_process_set


def broadcast_object(obj=None, root_rank: int = 0, name=None, process_set=global_process_set):
    """Rank ``root_rank``'s ``obj`` on every rank of the set (pickled with cloudpickle)."""
    import cloudpickle

    group = _group(process_set, "broadcast_object")
    verify("broadcast_object", [], process_set, extra=f"root_rank={root_rank}",
           problem=_root_problem(root_rank, process_set), name=name)
    op = _progress.take_op()
    rank = _engine.topology().rank
    if rank == root_rank:
        buf = io.BytesIO()
        cloudpickle.dump(obj, buf)  # the user's pickling: not a wait on peers
        data = torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)
        length = torch.tensor([data.numel()], dtype=torch.int64)
    else:
        length = torch.zeros(1, dtype=torch.int64)
    entry = _progress.begin_data(op, "broadcast_object", name)
    try:
        dist.broadcast(length, src=root_rank, group=group)
        if rank != root_rank:
            data = torch.empty(int(length.item()), dtype=torch.uint8)
        dist.broadcast(data, src=root_rank, group=group)
    finally:
        _progress.end(entry)
    if rank == root_rank:
        return obj
    return cloudpickle.loads(data.numpy().tobytes())


def allgather_object(obj, name=None, process_set=global_process_set) -> list:
    """Every rank's ``obj``, as a list in rank order (pickled with cloudpickle)."""
    import cloudpickle

    group = _group(process_set, "allgather_object")
    verify("allgather_object", [], process_set, name=name)
    data = torch.frombuffer(bytearray(cloudpickle.dumps(obj)), dtype=torch.uint8)
    lengths = [n[0] for n in gather_ints([data.numel()], data.device, process_set)]  # leaves the op to take
    padded = torch.zeros(max(lengths), dtype=torch.uint8)
    padded[: data.numel()] = data
    gathered = [torch.empty_like(padded) for _ in lengths]
    entry = _progress.begin_data(_progress.take_op(), "allgather_object", name)
    try:
        dist.all_gather(gathered, padded, group=group)
    finally:
        _progress.end(entry)
    return [cloudpickle.loads(g[:n].numpy().tobytes()) for g, n in zip(gathered, lengths)]


def broadcast_parameters(params, root_rank: int = 0, process_set=global_process_set) -> None:
    """Overwrite every rank's parameters with rank ``root_rank``'s, in place.

    ``params`` is a ``state_dict()``, a list of ``(name, tensor)`` pairs or of tensors,
    ``model.named_parameters()`` or ``model.parameters()``.
    """
    if isinstance(params, dict):
        items = sorted(params.items())
    elif isinstance(params, (list, tuple)) or hasattr(params, "__next__"):
        items = list(params)
    else:
        raise ValueError(f"broadcast_parameters takes a state_dict, a list of (name, tensor) pairs or of tensors, "
                         f"or model.named_parameters(), got {type(params).__name__}.")
    for item in items:
        if isinstance(item, torch.Tensor):
            item = (None, item)  # as Horovod: bare tensors are allowed
        if not (isinstance(item, tuple) and len(item) == 2):
            raise ValueError(f"broadcast_parameters takes (name, tensor) pairs or tensors, got an item of type "
                             f"{type(item).__name__}; pass model.named_parameters() or model.state_dict().")
        name, p = item
        if not isinstance(p, torch.Tensor):
            raise ValueError(f"broadcast_parameters: {name!r} is a {type(p).__name__}, not a tensor; "
                             "broadcast non-tensor values with hvd.broadcast_object.")
        broadcast_(p.data, root_rank, name=None, process_set=process_set)


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int = 0, model=None,
                              process_set=global_process_set) -> None:
    """Overwrite every rank's optimizer state and hyperparameters with rank ``root_rank``'s.

    ``model`` is accepted for Horovod compatibility and not needed: the state is the optimizer's
    ``state_dict()``, loaded as a whole.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(f"broadcast_optimizer_state takes a torch.optim.Optimizer, got "
                         f"{type(optimizer).__name__}.")
    is_root = _engine.topology().rank == root_rank
    state = _to_cpu(optimizer.state_dict()) if is_root else None
    state = broadcast_object(state, root_rank, process_set=process_set)
    if not is_root:
        optimizer.load_state_dict(state)  # moves state tensors to each parameter's device


def _to_cpu(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj
