"""Fusion's shared parts: the threshold, the packing rule every rank cuts alike, and pooled flat buffers.

Used by the engine's fused allreduces and grouped allreduces (``_allreduce.py``) and by torch's
DistributedOptimizer buckets (``collective/torch/_fusion.py``).
"""

from __future__ import annotations

import threading

import torch

from ..._common import settings


def fusion_threshold() -> int:
    """Bucket size in bytes: ``$HOROVOD_FUSION_THRESHOLD`` or 64 MB."""
    return settings.FUSION_THRESHOLD.get()


class BufferPool:
    """Flat CPU buffers kept between fused ops, so that fusing does not map fresh memory each time.

    glibc serves large blocks with a fresh mmap on every allocation, and the page faults of
    filling one can cost more than the copy itself (docs/performance.md). The pool keeps the
    ``keep`` largest released buffers per dtype.
    """

    def __init__(self, keep: int = 2):
        self._keep = keep
        self._free: dict = {}  # dtype -> released buffers
        self._lock = threading.Lock()

    def take(self, dtype: torch.dtype, numel: int) -> torch.Tensor:
        """A 1-D CPU buffer of at least ``numel`` elements; hand it back with ``give``."""
        with self._lock:
            free = self._free.get(dtype, [])
            fits = [i for i, b in enumerate(free) if b.numel() >= numel]
            if fits:  # by index: list.remove would compare tensors with ==, element by element
                return free.pop(min(fits, key=lambda i: free[i].numel()))
        return torch.empty(numel, dtype=dtype)

    def give(self, buffer: torch.Tensor) -> None:
        with self._lock:
            free = self._free.setdefault(buffer.dtype, [])
            free.append(buffer)
            free.sort(key=torch.Tensor.numel, reverse=True)
            del free[self._keep:]


pool = BufferPool()


def pack(tensors: list, threshold: int) -> list:
    """Cut ``tensors`` into lists of one dtype and device, in order, each at most ``threshold`` bytes.

    A tensor larger than ``threshold`` is a list on its own; every rank cuts alike.
    """
    groups: dict = {}
    for t in tensors:
        groups.setdefault((t.dtype, t.device), []).append(t)
    packed = []
    for members in groups.values():
        current, size = [], 0
        for t in members:
            nbytes = t.numel() * t.element_size()
            if current and size + nbytes > threshold:
                packed.append(current)
                current, size = [], 0
            current.append(t)
            size += nbytes
        packed.append(current)
    return packed
