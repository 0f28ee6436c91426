"""Adasum (``op=hvd.Adasum``): Horovod's adaptive summation, tensor by tensor, in Horovod's order.

For two vectors a and b (horovod/common/ops/adasum/adasum.h, ``FusedPairwiseReduceWithComm``)::

    Adasum(a, b) = (1 - a.b / (2 |a|^2)) a + (1 - a.b / (2 |b|^2)) b

with the dot product and squared norms accumulated in float64, and a coefficient of 1 where a
squared norm is below sqrt(DBL_MIN) (a zero vector). Orthogonal vectors add, equal ones average.
A fused buffer is combined per tensor: each tensor has its own dot product and norms. The ranks
are combined as Horovod's vector-halving, distance-doubling algorithm does: pairs of ranks at
distance 1 (0+1, 2+3, ...), then the pairs' results at distance 2, then 4, so 4 ranks give
Adasum(Adasum(x0, x1), Adasum(x2, x3)), each level rounded to the tensor's dtype. The number of
ranks must be a power of two (Horovod refuses others with NotImplementedError, as here).

CUDA tensors follow Horovod's GPU Adasum (adasum_gpu_operations.cc, "hierarchical"): the ranks of
each host are summed (NCCL there), the hosts' sums are combined by Adasum in host order, and the
result is divided by local_size; so on one host it is the average. Horovod needs MPI for
Adasum; here every rank allgathers the op's buffer over its backend (gloo on CPU, NCCL on CUDA)
and works out the same tree in the same order, so every rank gets the same bits. That is the
readable reference, not Horovod's bandwidth: each rank receives size - 1 times the buffer, where
Horovod's vector halving moves about twice the buffer (docs/torch.md says so).

float16, float32 and float64 only, as Horovod (adasum.h dispatches these three).
"""

from __future__ import annotations

import math
import sys
import threading
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .._engine import communicator as _engine
from .._engine.ops import Op
from . import _buffers
from ._process_sets import ProcessSet, global_process_set, require_member
from ._scale import scale_
from ._submit import describe, nbytes, submit

DTYPES = (torch.float16, torch.float32, torch.float64)
_SQRT_DBL_MIN = math.sqrt(sys.float_info.min)  # adasum.h's threshold for a zero vector


# ---- the math (the tests' oracle is a NumPy copy of it, tests/_adasum_oracle.py) ---------------------------

def pair(a: torch.Tensor, b: torch.Tensor, counts: list) -> torch.Tensor:
    """Adasum of two flat vectors of one dtype, tensor by tensor (``counts``: each tensor's elements, in order).

    ``a`` is the left (lower ranks') vector. Dot products and norms are float64; the result is
    rounded to the dtype, as Horovod's ``ScaledAdd`` writes it (float16: coefficients as float32,
    ``bcoeff * b + acoeff * a`` in float32, as its AVX kernel). No ``.item()``: a GPU never waits.
    """
    out = torch.empty_like(a)
    step = _chunk(a.device)
    offset = 0
    for n in counts:
        x, y = a[offset:offset + n], b[offset:offset + n]
        dot, anormsq, bnormsq = _dots(x, y, step)
        acoeff = torch.where(anormsq >= _SQRT_DBL_MIN, 1.0 - dot / anormsq * 0.5, 1.0)
        bcoeff = torch.where(bnormsq >= _SQRT_DBL_MIN, 1.0 - dot / bnormsq * 0.5, 1.0)
        half = a.dtype == torch.float16
        if half:  # float32 coefficients; bcoeff * b is exact in float64, so the float64 sum rounded to float32
            acoeff, bcoeff = acoeff.float(), bcoeff.float().double()  # is the fused multiply-add's (but for
            # rare double-rounding ties)
        for s in range(0, n, step):
            xs, ys = x[s:s + step], y[s:s + step]
            ax = (acoeff * xs.float()).double() if half else acoeff * xs.double()
            combined = ax + bcoeff * ys.double()
            out[offset + s:offset + s + xs.numel()] = combined.float() if half else combined  # to the dtype
        offset += n
    return out


def _chunk(device: torch.device) -> int:
    """Elements per float64 temporary. On CPU 32768, torch's grain size: each sum then runs in one thread, in
    one order whatever the thread count, so every rank works out the same bits, and the temporaries stay in
    the cache (a fresh float64 copy of a large tensor costs more in page faults than the arithmetic). CUDA's
    sums do not depend on threads and launches cost more there."""
    return 1 << 22 if device.type == "cuda" else 1 << 15


def _dots(x: torch.Tensor, y: torch.Tensor, step: int) -> torch.Tensor:
    """x.y, |x|^2 and |y|^2 in float64, summed chunk by chunk in order (never with atomics)."""
    total = torch.zeros(3, dtype=torch.float64, device=x.device)
    for s in range(0, x.numel(), step):
        xd, yd = x[s:s + step].double(), y[s:s + step].double()
        total += torch.stack([(xd * yd).sum(), (xd * xd).sum(), (yd * yd).sum()])
    return total


def tree(vectors: list, counts: list) -> torch.Tensor:
    """Adasum of the ranks' flat vectors (in rank order; a power of two of them) in Horovod's order:
    neighbours at distance 1, then 2, 4, ..."""
    level = list(vectors)
    while len(level) > 1:
        level = [pair(level[i], level[i + 1], counts) for i in range(0, len(level), 2)]
    return level[0]


def hierarchical(vectors: list, counts: list, local_size: int) -> torch.Tensor:
    """Horovod's GPU Adasum before its division by local_size: each host's ``local_size`` consecutive ranks
    summed, then Adasum across the hosts (``tree``)."""
    sums = []
    for start in range(0, len(vectors), local_size):
        total = vectors[start].clone()
        for v in vectors[start + 1:start + local_size]:
            total.add_(v)
        sums.append(total)
    return tree(sums, counts)


# ---- what Horovod refuses ---------------------------------------------------------------------------

def _power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def hosts_per_reduction(tensors: list, process_set: ProcessSet, what: str) -> int:
    """The ranks summed before Adasum (local_size for CUDA tensors, else 1); raises what Horovod refuses.

    As Horovod's ``_allreduce_async``: only the global process set, a power-of-2 number of ranks
    (for CUDA tensors: of hosts, on hosts with equal numbers of ranks).
    """
    if process_set is not global_process_set:
        raise NotImplementedError(f"{what}(op=hvd.Adasum) runs on the global process set only, as Horovod's "
                                  f"(\"Adasum does not support non-global process sets yet\"), but got process set "
                                  f"{process_set.ranks}; use op=hvd.Average on a process set.")
    t = _engine.topology()
    return ranks_summed(any(x.is_cuda for x in tensors), t.size, t.local_size, t.homogeneous, what)


def ranks_summed(cuda: bool, size: int, local_size: int, homogeneous: bool, what: str) -> int:
    """``hosts_per_reduction`` for a job of ``size`` ranks, ``local_size`` on this host."""
    if cuda and local_size > 1:
        if not homogeneous:
            raise NotImplementedError(f"{what}(op=hvd.Adasum) on CUDA tensors sums each host's ranks first, as "
                                      "Horovod's GPU Adasum, which needs every host to run the same number of ranks; "
                                      "this job's hosts run different numbers. Use op=hvd.Average, or reduce CPU "
                                      "tensors (their Adasum runs over every rank).")
        hosts = size // local_size
        if not _power_of_two(hosts):
            raise NotImplementedError(f"{what}(op=hvd.Adasum) on CUDA tensors combines hosts pairwise and needs a "
                                      f"power-of-2 number of hosts, as Horovod's GPU Adasum, but this job has "
                                      f"{hosts} hosts of {local_size} ranks; use 1, 2, 4, ... hosts, or "
                                      "op=hvd.Average.")
        return local_size
    if not _power_of_two(size):
        raise NotImplementedError(f"{what}(op=hvd.Adasum) combines ranks pairwise and needs a power-of-2 number of "
                                  f"ranks, as Horovod's (\"Running Adasum with non-power of 2 ranks is not supported "
                                  f"yet\"), but this job has {size}; run 1, 2, 4, 8, ... ranks, or use "
                                  "op=hvd.Average.")
    return 1


def dtype_problem(tensors: list, what: str) -> str | None:
    """Why Adasum cannot reduce these tensors (every rank then raises it), or None."""
    bad = sorted({str(t.dtype).replace("torch.", "") for t in tensors if t.dtype not in DTYPES})
    if bad:
        return (f"{what}(op=hvd.Adasum) reduces float16, float32 and float64 tensors, as Horovod's, got "
                f"{', '.join(bad)}; cast them to a floating type, or use op=hvd.Sum or hvd.Average.")
    return None


# ---- the data op ------------------------------------------------------------------------------------

class _Reduction:
    """One Adasum over ``targets`` (one dtype and device): their flat copy, prescaled, is allgathered at once;
    the first ``part()`` works out the tree (in the caller's thread, once)."""

    def __init__(self, targets: list, prescale_factor: float, postscale_factor: float, process_set, local_size: int):
        self.counts = [t.numel() for t in targets]
        self.local_size = local_size
        self.postscale = postscale_factor / local_size  # as Horovod's GPU Adasum: the hosts' sums averaged
        flat = torch.cat([t.reshape(-1) for t in targets]) if len(targets) > 1 else targets[0].reshape(-1).clone()
        scale_(flat, prescale_factor)
        size = process_set.size()
        self.work = None
        if size == 1 or flat.numel() == 0:
            self.gathered = [flat] * (size if flat.numel() == 0 else 1)
        else:
            self.gathered = [torch.empty_like(flat) for _ in range(size)]
            self.work = dist.all_gather(self.gathered, flat, group=process_set.group, async_op=True)
        self._result = None
        self._lock = threading.Lock()

    def works(self) -> list:
        return [] if self.work is None else [self.work]

    def part(self, index: int) -> torch.Tensor:
        """The combined result's elements of the ``index``-th target (flat)."""
        with self._lock:
            if self._result is None:
                if self.local_size > 1:
                    combined = hierarchical(self.gathered, self.counts, self.local_size)
                else:
                    combined = tree(self.gathered, self.counts)
                self._result = scale_(combined, self.postscale)
                self.gathered = None
        offset = sum(self.counts[:index])
        return self._result[offset:offset + self.counts[index]]


def allreduce_async_(tensor, name, prescale_factor, postscale_factor, process_set, what, fusable) -> object:
    """``allreduce_async_`` with op=Adasum (``_allreduce.allreduce_async_`` hands it here)."""
    local_size = hosts_per_reduction([tensor], process_set, what)
    require_member(process_set, what)
    desc = describe(tensor)
    target = tensor.detach()

    def launch(answer, result):
        reduction = _Reduction([target], prescale_factor, postscale_factor, process_set, local_size)
        return reduction.works(), lambda: _write(tensor, target, reduction, 0)

    return submit(process_set, Op(
        kind="allreduce", name=name, signature=f"Adasum|{desc}|{prescale_factor}|{postscale_factor}",
        description=f"{what}(op=Adasum: {desc})", argument_error=dtype_problem([tensor], what), launch=launch,
        nbytes=nbytes(tensor), fusion_key=f"allreduce|Adasum|{tensor.dtype}|{tensor.device}|{prescale_factor}|"
        f"{postscale_factor}" if fusable else None, launch_fused=_launch_fused,
        fusion_part=_FusablePart(tensor, target, prescale_factor, postscale_factor, process_set, local_size)))


@dataclass(slots=True)
class _FusablePart:
    """An Adasum allreduce as ``_launch_fused`` reads it, when the coordinator fuses it with others of its key."""

    tensor: torch.Tensor  # what synchronize returns
    target: torch.Tensor  # its detached view, written in place
    prescale_factor: float
    postscale_factor: float
    process_set: ProcessSet
    local_size: int  # the ranks summed before Adasum (``hosts_per_reduction``)


def _write(tensor, target, reduction: _Reduction, index: int):
    with torch.no_grad():
        target.copy_(reduction.part(index).view_as(target))
    return tensor


def _launch_fused(ops: list, answer) -> list:
    """Adasum ops the coordinator fused (one dtype, device and scaling): one allgather of their flat copy, and
    each tensor its own dot products and norms, as Horovod's fusion buffer keeps tensor boundaries."""
    parts = [o.fusion_part for o in ops]
    first = parts[0]
    reduction = _Reduction([p.target for p in parts], first.prescale_factor, first.postscale_factor,
                           first.process_set, first.local_size)
    return [(reduction.works(), lambda p=p, i=i: _write(p.tensor, p.target, reduction, i)) for i, p in enumerate(parts)]


def grouped_allreduce_async_(tensors, name, prescale_factor, postscale_factor, process_set) -> object:
    """``grouped_allreduce_async_`` with op=Adasum: one op; each dtype's tensors (up to the fusion threshold)
    one allgather, each tensor combined on its own."""
    local_size = hosts_per_reduction(tensors, process_set, "grouped_allreduce")
    require_member(process_set, "grouped_allreduce")
    desc = ", ".join(describe(t) for t in tensors)
    targets = [t.detach() for t in tensors]

    def launch(answer, result):
        reductions = [(members, _Reduction(members, prescale_factor, postscale_factor, process_set, local_size))
                      for members in _buffers.pack(targets, _buffers.fusion_threshold())] if targets else []

        def finish():
            with torch.no_grad():
                for members, reduction in reductions:
                    for i, t in enumerate(members):
                        t.copy_(reduction.part(i).view_as(t))
            return tuple(tensors)

        return [w for _, r in reductions for w in r.works()], finish

    return submit(process_set, Op(
        kind="grouped_allreduce", name=name, signature=f"Adasum|{desc}|{prescale_factor}|{postscale_factor}",
        description=f"grouped_allreduce(op=Adasum: {desc})", argument_error=dtype_problem(tensors, "grouped_allreduce"),
        launch=launch, nbytes=sum(map(nbytes, tensors))))
