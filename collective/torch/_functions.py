"""Broadcasting model and optimizer state, and arbitrary Python objects."""

from __future__ import annotations


import torch

from .. import _engine
from ._handles import synchronize
from ._ops import allgather_async, broadcast_
from ._process_sets import global_process_set


def broadcast_object(obj=None, root_rank: int = 0, name=None, process_set=global_process_set):
    """Rank ``root_rank``'s ``obj`` on every rank of the set (pickled with cloudpickle)."""
    import cloudpickle

    base = "broadcast_object" if name is None else name
    if _engine.topology().rank == root_rank:
        data = torch.frombuffer(bytearray(cloudpickle.dumps(obj)), dtype=torch.uint8)
        length = torch.tensor([data.numel()], dtype=torch.int64)
    else:
        length = torch.zeros(1, dtype=torch.int64)
    broadcast_(length, root_rank, name=f"{base}.length" if name is not None else None, process_set=process_set)
    if _engine.topology().rank != root_rank:
        data = torch.empty(int(length.item()), dtype=torch.uint8)
    broadcast_(data, root_rank, name=f"{base}.data" if name is not None else None, process_set=process_set)
    if _engine.topology().rank == root_rank:
        return obj
    return cloudpickle.loads(data.numpy().tobytes())


def allgather_object(obj, name=None, process_set=global_process_set) -> list:
    """Every rank's ``obj``, as a list in rank order (pickled with cloudpickle).

    Without ``name`` the ops are named after ``obj``'s type, as in Horovod, so that an allgather that
    failed on some ranks only (one issued while another rank had joined) does not shift the pairing.
    """
    import cloudpickle

    name = type(obj).__name__ if name is None else name
    data = torch.frombuffer(bytearray(cloudpickle.dumps(obj)), dtype=torch.uint8)
    handles = [allgather_async(torch.tensor([data.numel()], dtype=torch.int64), name=f"{name}.sz",
                               process_set=process_set),
               allgather_async(data, name=f"{name}.t", process_set=process_set)]
    lengths, gathered = (synchronize(h) for h in handles)
    parts, offset = [], 0
    for n in lengths.reshape(-1).tolist():
        parts.append(cloudpickle.loads(gathered[offset:offset + n].numpy().tobytes()))
        offset += n
    return parts


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
