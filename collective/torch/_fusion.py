"""Gradient buckets: reduce while backward is still running, fused, in a fixed order.

At wrap time the parameters are cut into buckets of at most ``threshold`` bytes (one dtype
and device per bucket), in reverse registration order, since backward produces gradients
roughly last layer first. A hook on each parameter counts its gradient accumulations; when
every parameter of a bucket has its ``backward_passes_per_step``-th gradient, the bucket is
ready. Buckets are launched strictly in index order: a ready bucket waits for the ones
before it, so every rank issues the same collectives in the same order whatever order its
hooks fire in. ``finish()`` launches what backward did not (unused parameters contribute
zeros), waits, and writes the averaged gradients back.

The readable reference is ``_reduce_reference`` in ``_optimizer.py``: one step-time
reduction per dtype; tests check that both give the same weights.
"""

from __future__ import annotations

import weakref

import torch

from .._core._allreduce import allreduce_async_
from .._core._reduction import Sum
from .._core._scale import scale_


class _Bucket:
    __slots__ = ("params", "flat", "buffer", "pending", "work", "ctx", "dense", "sparse")

    def __init__(self, params: list):
        self.params = params
        self.dense = []  # indices of the params in ``flat`` this step
        self.sparse = {}  # index -> handle of a sparse gradient's reduction this step
        self.flat = None
        self.buffer = None  # kept from step to step, as DDP keeps its buckets
        self.pending = set(range(len(params)))
        self.work = None
        self.ctx = None


class GradientBuckets:
    """The buckets of one DistributedOptimizer, and the hooks that fill them."""

    def __init__(self, params: list, *, threshold: int, passes: int, reduce_launch, reduce_finish, reduce_sparse=None,
                 label: str = "optimizer"):
        self._passes = passes
        self._label = label  # names the buckets in the per-op check, so that two optimizers' never pair up
        self._launch_fn = reduce_launch  # (flat tensor, label) -> (work, ctx)
        self._finish_fn = reduce_finish  # (flat tensor, ctx) -> reduced flat tensor
        self._sparse_fn = reduce_sparse  # (sparse gradient) -> handle, or None: sparse ones go dense
        self.buckets: list[_Bucket] = []
        params = list({id(p): p for p in params}.values())  # a parameter listed twice is one parameter
        current, size, key = [], 0, None
        for p in reversed(params):
            nbytes = p.numel() * p.element_size()
            pkey = (p.dtype, p.device)
            if current and (pkey != key or size + nbytes > threshold):
                self.buckets.append(_Bucket(current))
                current, size = [], 0
            current.append(p)
            size += nbytes
            key = pkey
        if current:
            self.buckets.append(_Bucket(current))
        self._where = {id(p): (b, i) for b, bucket in enumerate(self.buckets) for i, p in enumerate(bucket.params)}
        self._counts = {id(p): 0 for p in params}
        self._next = 0  # the next bucket to launch
        ref = weakref.ref(self)  # the hooks must not keep a dropped optimizer's buckets alive

        def hook(p, ref=ref):
            buckets = ref()
            if buckets is not None:
                buckets._on_grad(p)

        self._hooks = [p.register_post_accumulate_grad_hook(hook) for p in params]

    def in_flight(self) -> bool:
        return self._next > 0 or any(c for c in self._counts.values())

    def _on_grad(self, p: torch.Tensor) -> None:
        if id(p) not in self._where:
            return
        self._counts[id(p)] += 1
        if self._counts[id(p)] > self._passes:
            raise RuntimeError(f"gradients were computed {self._counts[id(p)]} times before optimizer.step(), more "
                               f"than backward_passes_per_step={self._passes}; pass backward_passes_per_step="
                               f"{self._counts[id(p)]} to DistributedOptimizer to accumulate them locally.")
        if self._counts[id(p)] != self._passes:
            return
        b, i = self._where[id(p)]
        self.buckets[b].pending.discard(i)
        while self._next < len(self.buckets) and not self.buckets[self._next].pending:
            self._launch(self._next)
            self._next += 1

    def _launch(self, index: int) -> None:
        bucket = self.buckets[index]
        grads, bucket.dense, bucket.sparse = [], [], {}
        for i, p in enumerate(bucket.params):
            if p.grad is None or not p.requires_grad:
                grads.append(torch.zeros_like(p))  # every rank takes part in every reduction
            elif p.grad.is_sparse and self._sparse_fn is not None:
                bucket.sparse[i] = self._sparse_fn(p.grad)  # gathered, as Horovod reduces sparse gradients
                continue
            else:
                grads.append(p.grad.to_dense() if p.grad.is_sparse else p.grad)
            bucket.dense.append(i)
        if not grads:
            return
        numel = sum(g.numel() for g in grads)
        dtype, device = grads[0].dtype, grads[0].device
        buffer = bucket.buffer
        if buffer is None or buffer.numel() != numel or buffer.dtype != dtype or buffer.device != device:
            buffer = bucket.buffer = torch.empty(numel, dtype=dtype, device=device)
        with torch.no_grad():
            bucket.flat = torch.cat([g.reshape(-1) for g in grads], out=buffer)
        bucket.work, bucket.ctx = self._launch_fn(bucket.flat, f"{self._label}, bucket {index} of {len(self.buckets)}")

    def finish(self) -> None:
        """Launch the rest in order, wait for every bucket, and write the gradients back."""
        try:
            self._finish_all()
        finally:  # whatever happened, the next step starts clean
            for bucket in self.buckets:
                bucket.flat, bucket.work, bucket.ctx, bucket.dense, bucket.sparse = None, None, None, [], {}
                bucket.pending = set(range(len(bucket.params)))
            self._counts = dict.fromkeys(self._counts, 0)
            self._next = 0

    def _finish_all(self) -> None:
        while self._next < len(self.buckets):
            self._launch(self._next)
            self._next += 1
        with torch.no_grad():
            for bucket in self.buckets:
                if bucket.work is not None:
                    bucket.work.wait()
                for i, handle in bucket.sparse.items():
                    bucket.params[i].grad = handle.wait()
                if bucket.flat is None:
                    continue
                flat = self._finish_fn(bucket.flat, bucket.ctx)
                offset = 0
                for p in (bucket.params[i] for i in bucket.dense):
                    n = p.numel()
                    if p.requires_grad:
                        write_back(p, flat[offset:offset + n].view_as(p))
                    offset += n

    def remove_hooks(self) -> None:
        for hook in self._hooks:
            hook.remove()


def write_back(p: torch.Tensor, reduced: torch.Tensor) -> None:
    """Make ``reduced`` the gradient of ``p``, in the layout the gradient had (a sparse one stays
    sparse, as Horovod converts back after ``sparse_as_dense``)."""
    if p.grad is None:
        p.grad = reduced.clone()
    elif p.grad.is_sparse:
        p.grad = reduced.to_sparse(p.grad.sparse_dim())
    else:
        p.grad.copy_(reduced)


def launch_allreduce(flat: torch.Tensor, label: str, *, op_is_average: bool, predivide: float, compression,
                     process_set):
    """Start one bucket's reduction: returns (work, context for finish_allreduce)."""
    wire, ctx = compression.compress(flat)
    if op_is_average:
        scale_(wire, 1.0 / predivide)
    handle = allreduce_async_(wire, op=Sum, name=label, process_set=process_set, _what="DistributedOptimizer bucket",
                              _fusable=False)  # a bucket is fused already: not copied again
    return handle, (wire, ctx)


def finish_allreduce(flat: torch.Tensor, ctx, *, op_is_average: bool, predivide: float, size: int, compression):
    wire, cctx = ctx
    if op_is_average:
        scale_(wire, predivide / size)
    return compression.decompress(wire, cctx)
