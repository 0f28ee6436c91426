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
Adasum; here a CPU buffer of ``HALVING_MIN_ELEMENTS`` or more goes by Horovod's vector halving,
distance doubling over gloo's point-to-point messages (``halving_doubling``: about twice the
buffer moved, whatever the ranks), and every other buffer (small ones, CUDA's) is allgathered over
the backend, each rank working out the same ``tree`` in the same order: the readable reference,
which receives size - 1 times the buffer. Either way every rank gets the same bits. The halving runs on a thread of
its own (``_Halving``), the ops in the order they were launched.

float16, float32 and float64 only, as Horovod (adasum.h dispatches these three).
"""

from __future__ import annotations

import math
import queue
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
#: CPU buffers of at least this many elements (and one per rank) go by ``halving_doubling``; smaller ones are
#: allgathered (one collective, where the halving takes 2 log2(size) trips plus the dot products')
HALVING_MIN_ELEMENTS = 1 << 14
_TAG = 0x5ADA  # the halving's point-to-point messages


# ---- the math (the tests' oracle is a NumPy copy of it, tests/_adasum_oracle.py) ---------------------------

def pair(a: torch.Tensor, b: torch.Tensor, counts: list) -> torch.Tensor:
    """Adasum of two flat vectors of one dtype, tensor by tensor (``counts``: each tensor's elements, in order).

    ``a`` is the left (lower ranks') vector. Dot products and norms are float64; the result is
    rounded to the dtype, as Horovod's ``ScaledAdd`` writes it (float16: coefficients as float32,
    ``bcoeff * b + acoeff * a`` in float32, as its AVX kernel). No ``.item()``: a GPU never waits.
    """
    out = torch.empty_like(a)
    combine(a, b, counts, dots_each(a, b, counts), out)
    return out


def dots_each(a: torch.Tensor, b: torch.Tensor, counts: list) -> torch.Tensor:
    """Each tensor's a.b, |a|^2 and |b|^2 (``counts``: its elements, in order; 0: none), float64, one row each."""
    step = _chunk(a.device)
    rows, offset = [], 0
    for n in counts:
        rows.append(_dots(a[offset:offset + n], b[offset:offset + n], step))
        offset += n
    return torch.stack(rows)


def combine(a: torch.Tensor, b: torch.Tensor, counts: list, dots: torch.Tensor, out: torch.Tensor) -> None:
    """``out`` (which may be ``a`` or ``b``) = each tensor's ``acoeff * a + bcoeff * b``, from its row of ``dots``
    (``dots_each``, or its sum over the ranks that hold the rest of the tensor)."""
    step = _chunk(a.device)
    offset = 0
    for k, n in enumerate(counts):
        x, y = a[offset:offset + n], b[offset:offset + n]
        dot, anormsq, bnormsq = dots[k]
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


def halving_doubling(flat: torch.Tensor, counts: list, group, rank: int, size: int) -> torch.Tensor:
    """``flat`` (this rank's vector, written in place) becomes the Adasum of every rank's, as Horovod's
    vector-halving, distance-doubling algorithm works it out (adasum.h, ``FusedAllreduce``), moving about twice the
    buffer whatever the number of ranks (a power of two).

    At distance d = 1, 2, 4, ... each rank and ``rank ^ d`` split the part they both hold: the lower keeps its first
    half, the upper its second, each sends the other half and combines its kept half of the lower side's vector (a)
    with the upper side's (b). Each tensor's dot product and norms are the sums of the partial ones of the 2d ranks
    that hold its parts, added at distances 1, 2, ..., d (each pair adds the same two numbers: the same bits on every
    rank of the block). Then the parts travel back, d = ..., 2, 1, so every rank has every part; each part was
    worked out on one rank only, so every rank has the same bits. Within float rounding of ``tree`` (the dot
    products are summed in other orders)."""
    kept, d = [], 1
    lo, hi = 0, flat.numel()
    while d < size:
        mid, lower = lo + (hi - lo) // 2, not rank & d
        keep, give = ((lo, mid), (mid, hi)) if lower else ((mid, hi), (lo, mid))
        mine, theirs = flat[keep[0]:keep[1]], torch.empty(keep[1] - keep[0], dtype=flat.dtype, device=flat.device)
        _exchange(flat[give[0]:give[1]], theirs, rank ^ d, group)
        a, b = (mine, theirs) if lower else (theirs, mine)
        local = _within(counts, *keep)
        dots, bit = _partial_dots(a, b, local), 1
        while bit <= d:  # summed over the 2d ranks of the block
            other = torch.empty_like(dots)
            _exchange(dots, other, rank ^ bit, group)
            dots, bit = dots + other, bit * 2
        if flat.dtype == torch.float16:
            combine(a, b, local, dots, mine)
        else:
            _combine_in_place(a, b, local, dots, mine)
        kept.append(((lo, hi), keep))
        (lo, hi), d = keep, d * 2
    for (parent_lo, parent_hi), (keep_lo, keep_hi) in reversed(kept):
        d //= 2
        other = (parent_lo, keep_lo) if keep_lo > parent_lo else (keep_hi, parent_hi)
        _exchange(flat[keep_lo:keep_hi], flat[other[0]:other[1]], rank ^ d, group)
    return flat


_STEP = 1 << 16  # elements per float64 temporary of the halving's arithmetic: in the cache, never allocated anew


def _partial_dots(a: torch.Tensor, b: torch.Tensor, counts: list) -> torch.Tensor:
    """``dots_each`` for the halving, faster: float64 chunks into two reused buffers, BLAS's dot. Its sums' order may
    depend on the threads: no matter here, since the ranks that share a tensor add the same partial sums."""
    rows, offset = torch.zeros((len(counts), 3), dtype=torch.float64), 0
    x64, y64 = torch.empty(_STEP, dtype=torch.float64), torch.empty(_STEP, dtype=torch.float64)
    for k, n in enumerate(counts):
        row = rows[k]
        for s in range(offset, offset + n, _STEP):
            m = min(_STEP, offset + n - s)
            xd, yd = x64[:m].copy_(a[s:s + m]), y64[:m].copy_(b[s:s + m])
            row[0] += torch.dot(xd, yd)
            row[1] += torch.dot(xd, xd)
            row[2] += torch.dot(yd, yd)
        offset += n
    return rows


def _combine_in_place(a: torch.Tensor, b: torch.Tensor, counts: list, dots: torch.Tensor, out: torch.Tensor) -> None:
    """``combine`` for float32 and float64 on CPU, faster: the same float64 arithmetic (``acoeff * a`` and
    ``bcoeff * b`` rounded apart, then added) in two reused buffers."""
    x64, y64 = torch.empty(_STEP, dtype=torch.float64), torch.empty(_STEP, dtype=torch.float64)
    offset = 0
    for (dot, anormsq, bnormsq), n in zip(dots.tolist(), counts):
        acoeff = 1.0 - dot / anormsq * 0.5 if anormsq >= _SQRT_DBL_MIN else 1.0
        bcoeff = 1.0 - dot / bnormsq * 0.5 if bnormsq >= _SQRT_DBL_MIN else 1.0
        for s in range(offset, offset + n, _STEP):
            m = min(_STEP, offset + n - s)
            xd, yd = x64[:m].copy_(a[s:s + m]), y64[:m].copy_(b[s:s + m])
            xd.mul_(acoeff).add_(yd.mul_(bcoeff))
            out[s:s + m].copy_(xd)  # to the dtype
        offset += n


def _within(counts: list, lo: int, hi: int) -> list:
    """Each tensor's elements within ``[lo, hi)`` of the flat buffer (``counts``: each tensor's, in order)."""
    within, offset = [], 0
    for n in counts:
        within.append(max(0, min(hi, offset + n) - max(lo, offset)))
        offset += n
    return within


def _exchange(send: torch.Tensor, receive: torch.Tensor, peer: int, group) -> None:
    """Send ``send`` to the set's rank ``peer`` and receive as much from it into ``receive``."""
    work = dist.isend(send, group=group, tag=_TAG, group_dst=peer)
    dist.recv(receive, group=group, tag=_TAG, group_src=peer)
    work.wait()


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

class _Halving:
    """A ``halving_doubling`` as the engine's work on an op (``wait``, ``is_completed``): it runs on one thread of this
    process that runs every halving in turn, in the order the ops were launched, the same on every rank (so their
    point-to-point messages pair up); the engine's thread meanwhile goes on reading and sending control frames, which
    a peer still inside an earlier halving may need before it reaches this one."""

    _queue: queue.SimpleQueue | None = None
    _lock = threading.Lock()

    def __init__(self, run):
        self._run, self._error = run, None
        self._done = threading.Event()
        with _Halving._lock:
            if _Halving._queue is None:
                _Halving._queue = queue.SimpleQueue()
                threading.Thread(target=_Halving._serve, args=(_Halving._queue,), name="sparkhvd-adasum",
                                 daemon=True).start()
        _Halving._queue.put(self)

    @staticmethod
    def _serve(halvings: queue.SimpleQueue) -> None:
        while True:
            halving = halvings.get()
            try:
                halving._run()
            except BaseException as exc:  # noqa: BLE001 - the op's synchronize raises it
                halving._error = exc
            finally:
                halving._done.set()

    def wait(self) -> bool:
        self._done.wait()
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self) -> bool:
        return self._done.is_set()


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
        self._result = None
        if local_size == 1 and size > 1 and flat.device.type == "cpu" and flat.numel() >= max(HALVING_MIN_ELEMENTS,
                                                                                               size):
            self.gathered = None
            group, rank = process_set.group, process_set.rank()

            def halve():
                self._result = scale_(halving_doubling(flat, self.counts, group, rank, size), self.postscale)

            self.work = _Halving(halve)
        elif size == 1 or flat.numel() == 0:
            self.gathered = [flat] * (size if flat.numel() == 0 else 1)
        else:
            self.gathered = [torch.empty_like(flat) for _ in range(size)]
            self.work = dist.all_gather(self.gathered, flat, group=process_set.group, async_op=True)
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
