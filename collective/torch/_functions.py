"""Broadcasting a model's parameters and an optimizer's state."""

from __future__ import annotations

import torch

from .._core._broadcast import broadcast_
from .._core._objects import broadcast_object
from .._core._process_sets import global_process_set
from .._engine import communicator as _engine


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
    if not optimizer.state:  # as Horovod, whose state-initializing step leaves trainable parameters a zero gradient
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.requires_grad and p.grad is None:
                    p.grad = torch.zeros_like(p)
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
