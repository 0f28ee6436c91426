"""Errors, not hangs or garbage, when ranks disagree on a collective.

Before each op the ranks of the set exchange a fingerprint of what they are about to do
(op, dtype, device, shape, root, reduction): one allgather of three int64s over gloo. When
they differ, every rank sees it, the ranks exchange readable descriptions, and every rank
raises the same ValueError naming what each rank passed. Without this, gloo aborts the
process on a size mismatch and a broadcast between tensors of different shapes returns
garbage. ``SPARKHVD_CHECK_COLLECTIVES=0`` skips the check (for small-op throughput once a
program is known to be right).
"""

from __future__ import annotations

import os
import zlib

import torch
import torch.distributed as dist

ENV_CHECK = "SPARKHVD_CHECK_COLLECTIVES"


def enabled() -> bool:
    return os.environ.get(ENV_CHECK, "1") not in ("0", "false", "False", "no")


def describe(t: torch.Tensor, skip_first_dim: bool = False) -> str:
    shape = list(t.shape)
    dims = str(["*"] + shape[1:]).replace("'", "") if skip_first_dim and shape else str(shape)
    return f"{str(t.dtype).replace('torch.', '')}{dims} on {t.device.type}"


def verify(what: str, tensors: list, process_set, *, skip_first_dim: bool = False, extra: str = "") -> None:
    """Raise ValueError on every rank of the set unless all ranks pass matching tensors."""
    if not enabled() or process_set.size() == 1:
        return
    text = f"{extra}: " if extra else ""
    text += ", ".join(describe(t, skip_first_dim) for t in tensors)
    fingerprint = torch.tensor([zlib.crc32(what.encode()), zlib.crc32(text.encode()), len(tensors)],
                               dtype=torch.int64)
    gathered = [torch.empty_like(fingerprint) for _ in range(process_set.size())]
    dist.all_gather(gathered, fingerprint, group=process_set.group)
    if all(torch.equal(g, gathered[0]) for g in gathered):
        return
    # Every rank got here: exchange the readable descriptions and fail the same way everywhere.
    names = [None] * process_set.size()
    readable = text if len(text) <= 300 else text[:300] + "..."
    dist.all_gather_object(names, f"{what}({readable})", group=process_set.group)
    groups: dict = {}
    for rank, name in enumerate(names):
        groups.setdefault(name, []).append(rank)
    listing = "; ".join(f"rank{'s' if len(r) > 1 else ''} {','.join(map(str, r))}: {name}"
                        for name, r in groups.items())
    rule = ("the same dtype, device and dimensions after the first" if skip_first_dim
            else "the same dtype, device and shape")
    raise ValueError(f"ranks disagree on a collective: {listing}. Every rank must call the same collectives in "
                     f"the same order, with {rule} (and the same op and root_rank).")
