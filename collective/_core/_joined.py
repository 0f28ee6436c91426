"""A rank inside ``join()`` stands in for itself in the others' reductions: it adds zeros.

The engine calls ``zeros_for_joined_rank`` with the data op's ``Layout`` from the coordinator's
answer (what a working member's op looks like), on every joined rank that did not submit the op.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .._engine.messages import INLINE, Layout
from ._ops import reduced_via_int32


def zeros_for_joined_rank(layout: Layout | None, group) -> list:
    """Start this joined rank's part, zeros, in the op ``layout`` describes; returns the works to wait for."""
    if layout is None or layout.kind == INLINE:  # the data rode in the control frames, without this rank's share
        return []
    device = torch.device("cuda", torch.cuda.current_device()) if layout.cuda else torch.device("cpu")
    # one c10d all_reduce per bucket, in order, of the dtype the working ranks reduce it as
    return [dist.all_reduce(torch.zeros(numel, dtype=_reduced_as(getattr(torch, dtype), device), device=device),
                            group=group, async_op=True) for dtype, numel in layout.buckets]


def _reduced_as(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype the working ranks reduce ``dtype`` as (they widen what the backend cannot reduce)."""
    return torch.int32 if reduced_via_int32(dtype, device) else dtype
