"""Gradients fused into buckets: DistributedOptimizer's overlapped, fused reduction against the step-time reference
and single-process training, accumulated passes, fused buffers in flight together and reused, the buffer pool, and
the buckets of two optimizers, in real rank processes."""

from __future__ import annotations

import pytest
import torch

from sparkhvd import HorovodRunner


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 8), torch.nn.Tanh(),
                               torch.nn.Linear(8, 1))


def _data(seed, steps=4, rows=6):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(rows, 4, generator=g), torch.randn(rows, 1, generator=g)) for _ in range(steps)]


def _train_ranks(shards, reference: bool, passes: int = 1):
    import torch

    import sparkhvd.collective.torch as hvd

    hvd.init()
    model = _model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=model.named_parameters(), backward_passes_per_step=passes)
    buckets = len(opt._hvd_buckets.buckets)
    if reference:
        opt._hvd_buckets.remove_hooks()
        opt._hvd_buckets = None  # the step-time reference path
    batches = shards[hvd.rank()]
    for i in range(0, len(batches), passes):
        opt.zero_grad()
        for x, y in batches[i:i + passes]:
            torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()], buckets


def _single(batches):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for x, y in batches:
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("threshold", ["0", "300", "67108864"], ids=["per-tensor", "several", "one-bucket"])
def test_fused_overlap_matches_reference_and_single_process(monkeypatch, threshold):
    monkeypatch.setenv("HOROVOD_FUSION_THRESHOLD", threshold)  # the ranks inherit the driver's environment
    shards = [_data(1), _data(2)]
    fused = HorovodRunner(np=-2).run_all(_train_ranks, shards=shards, reference=False).values
    reference = HorovodRunner(np=-2).run_all(_train_ranks, shards=shards, reference=True).values
    together = _single([(torch.cat([a[0], b[0]]), torch.cat([a[1], b[1]])) for a, b in zip(*shards)])
    buckets = fused[0][1]
    assert buckets == {"0": 6, "300": 4, "67108864": 1}[threshold]  # 300 B: 68 | 512 | 64 | 256 bytes
    for weights, _ in fused + reference:
        for got, want in zip(weights, together):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_accumulating_two_backward_passes_per_step():
    shards = [_data(3, steps=4, rows=3), _data(4, steps=4, rows=3)]
    values = HorovodRunner(np=-2).run_all(_train_ranks, shards=shards, reference=False, passes=2).values
    # Two passes of 3 rows each, mean losses summed, averaged over 2 ranks = the mean loss over 12 rows x 2.
    merged = []
    for k in range(0, 4, 2):
        xs = torch.cat([s[j][0] for s in shards for j in (k, k + 1)])
        ys = torch.cat([s[j][1] for s in shards for j in (k, k + 1)])
        merged.append((xs, ys))
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for x, y in merged:
        opt.zero_grad()
        (2 * torch.nn.functional.mse_loss(model(x), y)).backward()
        opt.step()
    for weights, _ in values:
        for got, want in zip(weights, model.parameters()):
            torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.unit
def test_bad_fusion_threshold_is_a_clear_error(monkeypatch):
    from sparkhvd.collective._core._buffers import fusion_threshold

    monkeypatch.setenv("HOROVOD_FUSION_THRESHOLD", "64MB")
    with pytest.raises(ValueError, match="HOROVOD_FUSION_THRESHOLD='64MB' is not a number of bytes"):
        fusion_threshold()
    monkeypatch.setenv("HOROVOD_FUSION_THRESHOLD", "-1")
    with pytest.raises(ValueError, match="HOROVOD_FUSION_THRESHOLD=-1 must be 0 or more bytes"):
        fusion_threshold()


def _fused_in_flight():
    import os

    import torch

    import sparkhvd.collective.torch as hvd

    hvd.init()
    r = hvd.rank()
    os.environ["HOROVOD_FUSION_THRESHOLD"] = str(5 * 2 ** 20)  # 3 MB tensors: buckets of two, then one
    big = 750_000  # 3 MB of float32: beyond the control exchange
    first = [torch.full((big,), 1.0 + r), torch.full((big,), 2.0 + r), torch.full((big,), 3.0 + r),
             torch.arange(5, dtype=torch.int64) + r]
    second = [t * 10 for t in first]
    h1 = hvd.grouped_allreduce_async_(first, op=hvd.Sum)
    h2 = hvd.grouped_allreduce_async_(second, op=hvd.Sum)  # in flight together: separate buffers
    hvd.synchronize(h2)
    hvd.synchronize(h1)
    third = hvd.grouped_allreduce([t + 1 for t in first], op=hvd.Sum)  # reuses the released buffers
    return {"first": first, "second": second, "third": third}


def test_fused_buckets_in_flight_together_and_reused():
    values = HorovodRunner(np=-2).run_all(_fused_in_flight).values
    sums = [torch.full((750_000,), 3.0), torch.full((750_000,), 5.0), torch.full((750_000,), 7.0),
            torch.arange(5, dtype=torch.int64) * 2 + 1]
    for v in values:
        for got, want in zip(v["first"], sums):
            assert torch.equal(got, want)
        for got, want in zip(v["second"], sums):
            assert torch.equal(got, want * 10)
        for got, want in zip(v["third"], sums):
            assert torch.equal(got, want * 2 + 2)


@pytest.mark.unit
def test_buffer_pool_hands_out_fitting_buffers_and_keeps_the_largest():
    from sparkhvd.collective._core._buffers import BufferPool, pack

    pool = BufferPool(keep=2)
    a, b = pool.take(torch.float32, 10), pool.take(torch.float32, 10)
    assert a.data_ptr() != b.data_ptr() and a.numel() == b.numel() == 10
    c = pool.take(torch.float32, 100)
    for buffer in (a, b, c):
        pool.give(buffer)
    assert pool.take(torch.float32, 50).data_ptr() == c.data_ptr()  # the smallest that fits
    assert pool.take(torch.float32, 5).numel() == 10  # one of the two small ones was dropped: keep=2
    assert pool.take(torch.float32, 5).numel() == 5  # nothing left: fresh
    assert pool.take(torch.float64, 10).dtype == torch.float64
    big, small = torch.empty(340), torch.empty(20)
    pool.give(big)
    pool.give(small)  # the best fit is not the first kept: taking it must not compare tensors
    assert pool.take(torch.float32, 15).data_ptr() == small.data_ptr()
    ts = [torch.ones(4), torch.ones(4), torch.ones(4, dtype=torch.int64), torch.ones(20), torch.ones(1)]
    assert [[len(t) for t in group] for group in pack(ts, 32)] == [[4, 4], [20], [1], [4]]


def _two_optimizers_one_unused_parameter():
    import os

    import torch

    import sparkhvd.collective.torch as hvd

    os.environ["HOROVOD_FUSION_THRESHOLD"] = "1"  # a bucket per parameter
    hvd.init()
    r = hvd.rank()
    a = torch.nn.ModuleDict({"used": torch.nn.Linear(4, 4, bias=False), "rank0": torch.nn.Linear(4, 4, bias=False)})
    b = torch.nn.Linear(4, 4, bias=False)
    opt_a = hvd.DistributedOptimizer(torch.optim.SGD(a.parameters(), lr=1.0))
    opt_b = hvd.DistributedOptimizer(torch.optim.SGD(b.parameters(), lr=1.0))
    x = torch.ones(1, 4)
    try:
        out = a["used"](x) + (a["rank0"](x) if r == 0 else 0)  # on rank 1 a bucket of opt_a waits for step()
        out.sum().backward()
        b(x).sum().backward()  # so opt_b's buckets would pair with opt_a's on the other rank
        opt_a.step()
        opt_b.step()
        return "no error"
    except ValueError as exc:
        return str(exc)


def test_buckets_of_two_optimizers_never_pair_up():
    values = HorovodRunner(np=-2).run_all(_two_optimizers_one_unused_parameter).values
    # Buckets are matched by name: rank 1's late bucket of opt_a pairs with rank 0's, not with opt_b's
    assert values == ["no error", "no error"]
