"""A rank inside ``join()`` stands in for itself in the others' reductions with zeros. The engine
calls ``mirror`` with the coordinator's answer, whose ``m`` is a working member's request and its
``z``, what the data op looks like there.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ._ops import reduced_via_int32


def mirror(item: dict, group) -> list:
    """Start this joined rank's part in the op ``item`` answers; returns the works to wait for."""
    spec = item["m"].get("z") or {}
    kind = spec.get("kind")
    if kind in (None, "inline"):  # the data rode in the control frames, without this rank's share
        return []
    device = torch.device("cuda", torch.cuda.current_device()) if spec["cuda"] else torch.device("cpu")
    if kind == "all_reduce_buckets":  # grouped_allreduce: one reduction per fused bucket, in order
        return [dist.all_reduce(torch.zeros(n, dtype=_reduced_as(getattr(torch, dtype), device), device=device),
                                group=group, async_op=True) for dtype, n in spec["buckets"]]
    dtype = getattr(torch, spec["dtype"])
    if kind == "all_reduce":
        return [dist.all_reduce(torch.zeros(_numel(spec["shape"]), dtype=_reduced_as(dtype, device), device=device),
                                group=group, async_op=True)]
    raise RuntimeError(f"sparkhvd cannot stand in for a joined rank in {kind!r}; this is a bug in sparkhvd.")


def _reduced_as(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype the working ranks reduce ``dtype`` as (they widen what the backend cannot reduce)."""
    return torch.int32 if reduced_via_int32(dtype, device) else dtype


def _numel(shape: list) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
