"""Handing an op to the engine, shared by every op module: ``submit``, and ``describe`` and ``nbytes``
for the ``Op`` each builds."""

from __future__ import annotations

import threading

import torch

from .._engine import communicator as _engine
from .._engine.ops import Handle, Op, run_local
from ._process_sets import ProcessSet

_caller = threading.local()  # .blocking: this thread waits for the ops it submits at once (``now``)


def describe(t: torch.Tensor, skip_first_dim: bool = False) -> str:
    """What a rank passed, for the error when ranks disagree: ``float32[4, 3] on cpu``."""
    shape = list(t.shape)
    dims = str(["*"] + shape[1:]).replace("'", "") if skip_first_dim and shape else str(shape)
    return f"{str(t.dtype).replace('torch.', '')}{dims} on {t.device.type}"


def submit(process_set: ProcessSet, op: Op) -> Handle:
    """Hand ``op`` to the engine (a set of one needs no negotiation)."""
    if process_set.size() == 1:
        return run_local(op)
    return _engine.engine().submit(process_set.link_id, op, sync=getattr(_caller, "blocking", False))


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
