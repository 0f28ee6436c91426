"""SyncBatchNorm at np=2 equals BatchNorm on the concatenated batch: outputs, running stats, gradients."""

from __future__ import annotations

import pytest
import torch

from sparkhvd import HorovodRunner


def _data(rank, rows=5):
    g = torch.Generator().manual_seed(10 + rank)
    return torch.randn(rows + rank, 3, 4, generator=g) * (rank + 1) + rank  # uneven batches, shifted


def _model(bn_cls):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv1d(3, 3, 1), bn_cls(3), torch.nn.Tanh())


def _distributed():
    import torch

    import sparkhvd.collective.torch as hvd

    hvd.init()
    model = _model(hvd.SyncBatchNorm)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    x = _data(hvd.rank())
    y = model(x)
    # Each rank's share of the global mean loss, scaled so averaging matches the global loss.
    (y.sum() * hvd.size() / sum(_data(r).numel() for r in range(hvd.size()))).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    opt.step()
    bn = model[1]
    model.eval()
    try:
        hvd.SyncBatchNorm(3)(torch.ones(1 - hvd.rank(), 3))  # one value per channel in all
        too_few = "no error"
    except ValueError as exc:
        too_few = str(exc)
    return {"too_few": too_few, "y": y.detach(), "grads": grads,
            "weights": [p.detach().clone() for p in model.parameters()],
            "running": (bn.running_mean.clone(), bn.running_var.clone(), int(bn.num_batches_tracked)),
            "eval": model(x).detach()}


@pytest.fixture(scope="module")
def ranks():
    return HorovodRunner(np=-2).run_all(_distributed).values


def _reference():
    model = _model(torch.nn.BatchNorm1d)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.cat([_data(0), _data(1)])
    y = model(x)
    (y.sum() / x.numel()).backward()
    opt.step()
    model.eval()
    bn = model[1]
    return y.detach(), [p.detach().clone() for p in model.parameters()], bn, model


def test_forward_matches_batchnorm_on_the_whole_batch(ranks):
    y, _, _, _ = _reference()
    torch.testing.assert_close(torch.cat([ranks[0]["y"], ranks[1]["y"]]), y, rtol=1e-5, atol=1e-6)


def test_a_step_matches(ranks):
    _, weights, _, _ = _reference()
    for v in ranks:
        for got, want in zip(v["weights"], weights):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_running_stats_match(ranks):
    _, _, bn, _ = _reference()
    for v in ranks:
        mean, var, tracked = v["running"]
        torch.testing.assert_close(mean, bn.running_mean, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(var, bn.running_var, rtol=1e-5, atol=1e-6)
        assert tracked == 1


def test_eval_uses_the_running_stats(ranks):
    _, _, _, model = _reference()
    torch.testing.assert_close(ranks[1]["eval"], model(_data(1)).detach(), rtol=1e-5, atol=1e-6)


def test_too_few_values_is_the_same_error_on_every_rank(ranks):
    assert ranks[0]["too_few"] == ranks[1]["too_few"]
    assert "SyncBatchNorm needs more than one value per channel across all ranks in training" in ranks[0]["too_few"]


@pytest.mark.unit
def test_outside_a_job_it_is_plain_batchnorm_and_bad_input_is_refused():
    import sparkhvd.collective.torch as hvd

    bn, ref = hvd.SyncBatchNorm(3), torch.nn.BatchNorm1d(3)
    x = torch.randn(4, 3)
    torch.testing.assert_close(bn(x), ref(x))
    with pytest.raises(ValueError, match="SyncBatchNorm expects an input of at least 2 dimensions"):
        bn(torch.ones(3))
