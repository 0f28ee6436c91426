"""DistributedOptimizer's overlapped, fused reduction against the step-time reference and
single-process training, in real rank processes."""

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


def _edge_cases():
    import torch

    import sparkhvd.collective.torch as hvd

    hvd.init()
    r = hvd.rank()
    out = {}
    a = torch.nn.Parameter(torch.zeros(2))
    b = torch.nn.Parameter(torch.zeros(3))
    opt = hvd.DistributedOptimizer(torch.optim.SGD([a, b], lr=1.0))
    la, lb = (a * (r + 1)).sum(), (b * (r + 1)).sum()  # b: 3 elements, a: 2
    for loss in ([la, lb] if r == 0 else [lb, la]):  # hooks fire in opposite orders on the two ranks
        loss.backward()
    opt.step()
    out["order"] = (a.detach().clone(), b.detach().clone())
    opt.zero_grad()
    if r == 0:  # b unused on rank 0: it contributes zeros
        (a * 2).sum().backward()
    else:
        (a * 2 + b.sum()).sum().backward()
    opt.step()
    out["unused"] = (a.detach().clone(), b.detach().clone())
    opt.zero_grad()
    b.requires_grad_(False)  # frozen after wrapping: left alone
    (a.sum() * 4).backward()
    opt.step()
    out["frozen"] = (a.detach().clone(), b.detach().clone(), b.grad)
    b.requires_grad_(True)
    opt.zero_grad()
    (a.sum() * (r + 1) * 10).backward()
    opt.synchronize()  # gradient clipping between reduction and update
    out["synced_grad"] = a.grad.clone()
    torch.nn.utils.clip_grad_norm_([a], max_norm=1.0)
    with opt.skip_synchronize():
        opt.step()
    out["clipped"] = a.detach().clone()
    errors = []
    opt.zero_grad()
    a.sum().backward()
    try:
        opt.zero_grad()
    except RuntimeError as exc:
        errors.append(str(exc))
    try:
        a.sum().backward()
    except RuntimeError as exc:
        errors.append(str(exc))
    out["errors"] = errors
    return out


def test_hook_order_unused_frozen_clipping_and_errors():
    v0, v1 = HorovodRunner(np=-2).run_all(_edge_cases).values
    for v in (v0, v1):
        a, b = v["order"]
        assert torch.equal(a, torch.full((2,), -1.5)) and torch.equal(b, torch.full((3,), -1.5))
        a, b = v["unused"]
        assert torch.equal(a, torch.full((2,), -3.5)) and torch.equal(b, torch.full((3,), -2.5))
        a, b, bgrad = v["frozen"]
        assert torch.equal(a, torch.full((2,), -7.5)) and torch.equal(b, torch.full((3,), -2.5)) and bgrad is None
        assert torch.equal(v["synced_grad"], torch.full((2,), 15.0))
        torch.testing.assert_close(v["clipped"], torch.full((2,), -7.5 - 2 ** -0.5))
        assert "zero_grad() was called after loss.backward() but before optimizer.step()" in v["errors"][0]
        assert ("gradients were computed 2 times before optimizer.step(), more than backward_passes_per_step=1; "
                "pass backward_passes_per_step=2") in v["errors"][1]


def test_bad_fusion_threshold_is_a_clear_error(monkeypatch):
    from sparkhvd.collective._core._buffers import fusion_threshold

    monkeypatch.setenv("HOROVOD_FUSION_THRESHOLD", "64MB")
    with pytest.raises(ValueError, match="HOROVOD_FUSION_THRESHOLD='64MB' is not a number of bytes"):
        fusion_threshold()
    monkeypatch.setenv("HOROVOD_FUSION_THRESHOLD", "-1")
    with pytest.raises(ValueError, match="HOROVOD_FUSION_THRESHOLD=-1 must be 0 or more bytes"):
        fusion_threshold()


def test_ranks_with_different_models_fail_at_wrap_time():
    def train():
        import torch

        import sparkhvd.collective.torch as hvd

        hvd.init()
        model = torch.nn.Linear(3, 2 + hvd.rank())  # rank 1 built a different model
        try:
            hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
        except hvd.HorovodInternalError as exc:
            return str(exc)

    v0, v1 = HorovodRunner(np=-2).run_all(train).values
    assert v0 == v1
    assert ("rank 0: DistributedOptimizer 0(op=Average: float32[2, 3] on cpu, float32[2] on cpu); "
            "rank 1: DistributedOptimizer 0(op=Average: float32[3, 3] on cpu, float32[3] on cpu)") in v0
