"""Broadcasting model and optimizer state, and arbitrary Python objects."""

from __future__ import annotations

import io

import torch
import torch.distributed as dist

from .. import _engine
from ._ops import _check_root, broadcast_


def broadcast_object(obj=None, root_rank: int = 0, name=None):
    """Rank ``root_rank``'s ``obj`` on every rank (pickled with cloudpickle)."""
    import cloudpickle

    _check_root(root_rank)
    rank = _engine.topology().rank
    if rank == root_rank:
        buf = io.BytesIO()
        cloudpickle.dump(obj, buf)
        data = torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)
        length = torch.tensor([data.numel()], dtype=torch.int64)
    else:
        length = torch.zeros(1, dtype=torch.int64)
    dist.broadcast(length, src=root_rank)
    if rank != root_rank:
        data = torch.empty(int(length.item()), dtype=torch.uint8)
    dist.broadcast(data, src=root_rank)
    if rank == root_rank:
        return obj
    return cloudpickle.loads(data.numpy().tobytes())


def broadcast_parameters(params, root_rank: int = 0) -> None:
    """Overwrite every rank's parameters with rank ``root_rank``'s, in place.

    ``params`` is a ``state_dict()``, a list of ``(name, tensor)`` pairs, or
    ``model.named_parameters()``.
    """
    if isinstance(params, dict):
        items = sorted(params.items())
    elif isinstance(params, (list, tuple)) or hasattr(params, "__next__"):
        items = list(params)
    else:
        raise ValueError(f"broadcast_parameters takes a state_dict, a list of (name, tensor) pairs or "
                         f"model.named_parameters(), got {type(params).__name__}.")
    for item in items:
        if not (isinstance(item, tuple) and len(item) == 2):
            raise ValueError(f"broadcast_parameters takes (name, tensor) pairs, got an item of type "
                             f"{type(item).__name__}; pass model.named_parameters() or model.state_dict().")
        name, p = item
        if not isinstance(p, torch.Tensor):
            raise ValueError(f"broadcast_parameters: {name!r} is a {type(p).__name__}, not a tensor; "
                             "broadcast non-tensor values with hvd.broadcast_object.")
        broadcast_(p.data, root_rank, name=name)


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int = 0) -> None:
    """Overwrite every rank's optimizer state and hyperparameters with rank ``root_rank``'s."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(f"broadcast_optimizer_state takes a torch.optim.Optimizer, got "
                         f"{type(optimizer).__name__}.")
    state = _to_cpu(optimizer.state_dict()) if _engine.topology().rank == root_rank else None
    state = broadcast_object(state, root_rank)
    if _engine.topology().rank != root_rank:
        optimizer.load_state_dict(state)  # moves state tensors to each parameter's device


def _to_cpu(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj
