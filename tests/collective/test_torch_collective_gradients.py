"""Each torch collective's gradient, in Horovod's convention, at np=2 and np=3 in real rank processes: one run per
job size, one case per op (tests/_cases.py), one test per case. Rank k's loss is weighted by k + 1 (or by 10k in
allgather's); expected values are exact."""

from __future__ import annotations

import pytest
import torch
from _cases import add_to, run_cases, values

from sparkhvd import HorovodRunner


def _counts(n: int) -> list:
    """Rows per rank when 2n + 1 rows are scattered: rank 0 takes the extra one."""
    return [3 if k == 0 else 2 for k in range(n)]


GRADS: dict = {}
op = add_to(GRADS)


def _grad_of_allreduce(hvd, r, op):
    x = torch.ones(3, requires_grad=True)
    (hvd.allreduce(x, op=op) * (r + 1)).sum().backward()
    return x.grad


@op
def allreduce_sum(hvd, r, n):
    return _grad_of_allreduce(hvd, r, hvd.Sum)


@op
def allreduce_average(hvd, r, n):
    return _grad_of_allreduce(hvd, r, hvd.Average)


@op
def allgather(hvd, r, n):
    x = torch.ones(r + 1, requires_grad=True)
    coef = torch.arange(n * (n + 1) // 2, dtype=torch.float32) + 10 * r
    (hvd.allgather(x) * coef).sum().backward()
    return x.grad


@op
def broadcast(hvd, r, n):
    x = torch.ones(2, requires_grad=True)
    (hvd.broadcast(x, root_rank=0) * (r + 1)).sum().backward()
    return x.grad


@op
def alltoall(hvd, r, n):
    splits = [k + 1 for k in range(n)]
    x = torch.ones(sum(splits), requires_grad=True)
    received, _ = hvd.alltoall(x, splits=splits)
    (received * (r + 1)).sum().backward()
    return x.grad


@op
def reducescatter(hvd, r, n):
    x = torch.ones(2 * n + 1, requires_grad=True)
    (hvd.reducescatter(x, op=hvd.Sum) * (r + 1)).sum().backward()
    return x.grad


@op
def reducescatter_scaled(hvd, r, n):
    x = torch.ones(2 * n + 1, requires_grad=True)
    (hvd.reducescatter(x, op=hvd.Sum, prescale_factor=3.0, postscale_factor=0.5) * (r + 1)).sum().backward()
    return x.grad


@op
def grouped_allreduce(hvd, r, n):
    xs = [torch.ones(2, requires_grad=True), torch.ones(1, requires_grad=True)]
    sum((t * (r + 1)).sum() for t in hvd.grouped_allreduce(xs, op=hvd.Sum)).backward()
    return [t.grad for t in xs]


def _gradients():
    import sparkhvd.collective.torch as hvd

    hvd.init()
    return run_cases(GRADS, hvd, hvd.rank(), hvd.size())


@pytest.fixture(scope="module", params=[2, 3], ids=["np2", "np3"])
def ranks(request):
    return HorovodRunner(np=-request.param).run_all(_gradients).values


# ---- gradients, in Horovod's convention -----------------------------------------------------------------------
# Rank k's loss is weighted by k + 1 (or by 10k in allgather's). Horovod 0.28's gradients, kept on purpose:
# broadcast's and allgather's average the ranks' gradients (1/n of the derivative of the summed losses),
# reducescatter's is the allgather of the gradient times n for Sum.

def _weights(n):
    return n * (n + 1) // 2  # sum over ranks of (rank + 1)


def test_allreduce_sum_gradient(ranks):
    t = _weights(len(ranks))
    assert all(torch.equal(g, torch.full((3,), float(t))) for g in values(ranks, "allreduce_sum"))


def test_allreduce_average_gradient(ranks):
    n = len(ranks)
    assert all(torch.equal(g, torch.full((3,), _weights(n) / n)) for g in values(ranks, "allreduce_average"))


def test_allgather_gradient_averages_the_ranks_gradients(ranks):
    n = len(ranks)
    for r, g in enumerate(values(ranks, "allgather")):
        offset = r * (r + 1) // 2  # rows before this rank's in the gathered tensor
        summed = sum(torch.arange(offset, offset + r + 1, dtype=torch.float32) + 10 * k for k in range(n))
        assert torch.equal(g, summed / n)


def test_broadcast_gradient_reaches_the_root_averaged(ranks):
    n = len(ranks)
    for r, g in enumerate(values(ranks, "broadcast")):
        assert torch.equal(g, torch.full((2,), _weights(n) / n if r == 0 else 0.0))


def test_alltoall_gradient_returns_each_split_to_its_sender(ranks):
    n = len(ranks)
    for g in values(ranks, "alltoall"):
        assert torch.equal(g, torch.cat([torch.full((k + 1,), k + 1.0) for k in range(n)]))


def test_reducescatter_sum_gradient_is_the_gathered_gradient_times_n(ranks):
    n = len(ranks)
    owner = torch.cat([torch.full((c,), k + 1.0) for k, c in enumerate(_counts(n))])
    assert all(torch.equal(g, owner * n) for g in values(ranks, "reducescatter"))


def test_scaled_reducescatter_gradient_carries_both_scales(ranks):
    n = len(ranks)
    # each row's gradient is its owner's weight times the scales, times the set's size for Sum (Horovod's convention)
    owner = torch.cat([torch.full((c,), k + 1.0) for k, c in enumerate(_counts(n))])
    assert all(torch.equal(g, owner * 1.5 * n) for g in values(ranks, "reducescatter_scaled"))


def test_grouped_allreduce_gradient(ranks):
    t = _weights(len(ranks))
    for grads in values(ranks, "grouped_allreduce"):
        assert all(torch.equal(x, torch.full_like(x, float(t))) for x in grads)
