"""Arbitrary Python objects across ranks, pickled with cloudpickle into byte tensors: ``broadcast_object``, ``allgather_object``."""

from __future__ import annotations

import torch

from .._engine import communicator as _engine
from ._allgather import allgather_async
from ._broadcast import broadcast_
from ._handles import synchronize
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
