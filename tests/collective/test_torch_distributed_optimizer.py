"""hvd.DistributedOptimizer in real rank processes: it trains as one process on the ranks' batches together
(after an LR scheduler, with sparse gradients too), handles hooks that fire in any order, unused and
frozen parameters and clipping, and refuses what it cannot do with the fix."""

from __future__ import annotations

import pytest
import torch
from _cases import add_to, message_of, run_cases, values

from sparkhvd import HorovodRunner


def _train(batches, rank=0, size=1, lr=0.1):
    """SGD on a fixed model; with size>1 inside a run, through DistributedOptimizer."""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    if size > 1:
        import sparkhvd.collective.torch as hvd

        opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    for x, y in batches:
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def _batches(seed=0, steps=5, rows=8):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(rows, 4, generator=g), torch.randn(rows, 1, generator=g)) for _ in range(steps)]


def test_distributed_optimizer_matches_single_process_on_concatenated_batches():
    shards = [_batches(seed=1), _batches(seed=2)]

    def train(shards):
        import sparkhvd.collective.torch as hvd

        hvd.init()
        return _train(shards[hvd.rank()], hvd.rank(), hvd.size())

    values = HorovodRunner(np=-2).run_all(train, shards=shards).values
    together = [(torch.cat([a[0], b[0]]), torch.cat([a[1], b[1]])) for a, b in zip(*shards)]
    expected = _train(together)
    for weights in values:
        for got, want in zip(weights, expected):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_optimizer_wrapped_after_an_lr_scheduler_still_averages_and_stays_in_sync():
    def train():
        import torch

        import sparkhvd.collective.torch as hvd

        hvd.init()
        model = torch.nn.Linear(1, 1, bias=False)
        torch.nn.init.constant_(model.weight, 0.0)
        opt = torch.optim.SGD(model.parameters(), lr=1.0 if hvd.rank() == 0 else 5.0)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)  # made before wrapping
        opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
        hvd.broadcast_optimizer_state(opt, root_rank=0)  # load_state_dict on rank 1
        for _ in range(2):
            opt.zero_grad()
            (model(torch.ones(1, 1)) * (hvd.rank() + 1)).sum().backward()  # grads 1 and 2: average 1.5
            opt.step()
            sched.step()
        return model.weight.item(), opt.param_groups[0]["lr"], sched.get_last_lr()[0]

    values = HorovodRunner(np=-2).run_all(train).values
    assert values[0] == values[1] == (-1.5 * 1.0 - 1.5 * 0.5, 0.25, 0.25)


_SPARSE_CONFIGS = [("sgd", False, 64 << 20), ("sgd", False, 1), ("sgd", True, 64 << 20),
                   ("sparseadam", False, 64 << 20), ("sparseadam", True, 1)]


def _embedding_training(rank=None, size=1):
    """Three steps of an Embedding(sparse=True) + Linear model, one config after another; with ``rank``
    None, single-process training on both ranks' batches together (the reference)."""
    import os

    import torch

    import sparkhvd.collective.torch as hvd

    if rank is not None:
        hvd.init()
        rank, size = hvd.rank(), hvd.size()
    batches = [torch.tensor([[1, 2], [3, 3]]), torch.tensor([[2, 5], [7, 1]])]
    out = {}
    for name, dense, threshold in _SPARSE_CONFIGS:
        os.environ["HOROVOD_FUSION_THRESHOLD"] = str(threshold)
        torch.manual_seed(0)
        emb, lin = torch.nn.Embedding(10, 3, sparse=True), torch.nn.Linear(3, 1)
        opt = (torch.optim.SGD([*emb.parameters(), *lin.parameters()], lr=0.5) if name == "sgd"
               else torch.optim.SparseAdam(list(emb.parameters()), lr=0.1))
        if rank is not None:
            opt = hvd.DistributedOptimizer(opt, sparse_as_dense=dense)
        for step in range(3):
            opt.zero_grad()
            if rank is None:
                (lin(emb(torch.cat(batches[:size]) + step)).sum() / size).backward()
            else:
                lin(emb(batches[rank] + step)).sum().backward()
            opt.step()
        out[name, dense, threshold] = (emb.weight.detach().clone(), emb.weight.grad.is_sparse)
    os.environ.pop("HOROVOD_FUSION_THRESHOLD")
    return out


@pytest.mark.parametrize("np_", [1, 2], ids=["np1", "np2"])
def test_sparse_gradients_gathered_or_dense_as_horovod(np_):
    """Sparse gradients are gathered (indices and values) by default and reduced dense with
    sparse_as_dense, coming back sparse either way, so SparseAdam keeps working; the weights equal
    single-process training on the concatenated batches."""
    values = HorovodRunner(np=-np_).run_all(_embedding_training, rank=0).values
    reference = _embedding_training(size=np_)
    for v in values:
        for config in _SPARSE_CONFIGS:
            weight, sparse = v[config]
            assert torch.allclose(weight, reference[config][0], atol=1e-6), config
            assert sparse is True, config


# ---- hooks in any order, unused and frozen parameters, clipping: one optimizer's steps, at np=2 ----------------

STEPS: dict = {}
step = add_to(STEPS)


@step
def hooks_in_opposite_orders(hvd, r, state):
    a, b = state["a"], state["b"] = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(3))
    opt = state["opt"] = hvd.DistributedOptimizer(torch.optim.SGD([a, b], lr=1.0))
    la, lb = (a * (r + 1)).sum(), (b * (r + 1)).sum()  # b: 3 elements, a: 2
    for loss in ([la, lb] if r == 0 else [lb, la]):  # hooks fire in opposite orders on the two ranks
        loss.backward()
    opt.step()
    return a.detach().clone(), b.detach().clone()


@step
def unused_on_one_rank(hvd, r, state):
    a, b, opt = state["a"], state["b"], state["opt"]
    opt.zero_grad()
    if r == 0:  # b unused on rank 0: it contributes zeros
        (a * 2).sum().backward()
    else:
        (a * 2 + b.sum()).sum().backward()
    opt.step()
    return a.detach().clone(), b.detach().clone()


@step
def frozen_after_wrapping(hvd, r, state):
    a, b, opt = state["a"], state["b"], state["opt"]
    opt.zero_grad()
    b.requires_grad_(False)  # frozen after wrapping: left alone
    (a.sum() * 4).backward()
    opt.step()
    b.requires_grad_(True)
    return a.detach().clone(), b.detach().clone(), b.grad


@step
def synchronize_then_clip(hvd, r, state):
    a, opt = state["a"], state["opt"]
    opt.zero_grad()
    (a.sum() * (r + 1) * 10).backward()
    opt.synchronize()  # gradient clipping between reduction and update
    synced = a.grad.clone()
    torch.nn.utils.clip_grad_norm_([a], max_norm=1.0)
    with opt.skip_synchronize():
        opt.step()
    return synced, a.detach().clone()


@step
def zero_grad_before_step(hvd, r, state):
    a, opt = state["a"], state["opt"]
    opt.zero_grad()
    a.sum().backward()
    return message_of(opt.zero_grad, RuntimeError)


@step
def more_passes_than_declared(hvd, r, state):
    return message_of(lambda: state["a"].sum().backward(), RuntimeError)


def _steps():
    import sparkhvd.collective.torch as hvd

    hvd.init()
    return run_cases(STEPS, hvd, hvd.rank(), {})


@pytest.fixture(scope="module")
def steps():
    return HorovodRunner(np=-2).run_all(_steps).values


def test_hooks_that_fire_in_opposite_orders_on_the_ranks(steps):
    for a, b in values(steps, "hooks_in_opposite_orders"):
        assert torch.equal(a, torch.full((2,), -1.5)) and torch.equal(b, torch.full((3,), -1.5))


def test_a_parameter_unused_on_one_rank_contributes_zeros(steps):
    for a, b in values(steps, "unused_on_one_rank"):
        assert torch.equal(a, torch.full((2,), -3.5)) and torch.equal(b, torch.full((3,), -2.5))


def test_a_parameter_frozen_after_wrapping_is_left_alone(steps):
    for a, b, bgrad in values(steps, "frozen_after_wrapping"):
        assert torch.equal(a, torch.full((2,), -7.5)) and torch.equal(b, torch.full((3,), -2.5)) and bgrad is None


def test_synchronize_then_clip_then_step_without_synchronizing_again(steps):
    for synced, clipped in values(steps, "synchronize_then_clip"):
        assert torch.equal(synced, torch.full((2,), 15.0))
        torch.testing.assert_close(clipped, torch.full((2,), -7.5 - 2 ** -0.5))


def test_zero_grad_between_backward_and_step_is_refused(steps):
    for message in values(steps, "zero_grad_before_step"):
        assert "zero_grad() was called after loss.backward() but before optimizer.step()" in message


def test_more_backward_passes_than_declared_are_refused(steps):
    for message in values(steps, "more_passes_than_declared"):
        assert ("gradients were computed 2 times before optimizer.step(), more than backward_passes_per_step=1; "
                "pass backward_passes_per_step=2") in message


# ---- what it refuses, at np=1 ---------------------------------------------------------------------------------

REFUSALS: dict = {}
refusal = add_to(REFUSALS)


def _sgd():
    model = torch.nn.Linear(2, 1)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


@refusal
def not_an_optimizer(hvd):
    return message_of(lambda: hvd.DistributedOptimizer("sgd"))


@refusal
def parameters_of_another_model(hvd):
    _, opt = _sgd()
    other = torch.nn.Linear(2, 1)
    return message_of(lambda: hvd.DistributedOptimizer(opt, named_parameters=other.named_parameters()))


@refusal
def duplicate_parameter_names(hvd):
    model, opt = _sgd()
    return message_of(lambda: hvd.DistributedOptimizer(opt, named_parameters=[("a", p) for p in model.parameters()]))


@refusal
def op_max(hvd):
    _, opt = _sgd()
    return message_of(lambda: hvd.DistributedOptimizer(opt, op=hvd.Max))


@refusal
def wrapped_and_stepped_without_synchronizing(hvd):
    model, opt = _sgd()
    wrapped = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    model(torch.ones(1, 2)).sum().backward()
    with wrapped.skip_synchronize():
        wrapped.step()
    return type(wrapped).__name__, isinstance(wrapped, torch.optim.SGD)


@refusal
def wrapped_twice(hvd):
    model = torch.nn.Linear(1, 1)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    return message_of(lambda: hvd.DistributedOptimizer(opt), ValueError)


@refusal
def own_step_attribute(hvd):
    model = torch.nn.Linear(1, 1)
    other = torch.optim.SGD(model.parameters(), lr=0.1)
    other.step = lambda closure=None: None
    return message_of(lambda: hvd.DistributedOptimizer(other), ValueError), type(other).__name__


def _refusals():
    import sparkhvd.collective.torch as hvd

    hvd.init()
    return run_cases(REFUSALS, hvd)


@pytest.fixture(scope="module")
def one_rank():
    return HorovodRunner(np=-1).run_all(_refusals).values


def test_it_wraps_only_an_optimizer(one_rank):
    assert values(one_rank, "not_an_optimizer") == ["DistributedOptimizer wraps a torch.optim.Optimizer, got str."]


def test_named_parameters_must_be_the_optimizers(one_rank):
    assert "2 of the optimizer's 2 parameters are not in it" in values(one_rank, "parameters_of_another_model")[0]


def test_named_parameters_must_have_unique_names(one_rank):
    assert "named_parameters has duplicate names ['a']" in values(one_rank, "duplicate_parameter_names")[0]


def test_it_reduces_with_average_sum_or_adasum(one_rank):
    assert "op=hvd.Average, hvd.Sum or hvd.Adasum, got Max" in values(one_rank, "op_max")[0]


def test_the_wrapped_optimizer_keeps_its_class(one_rank):
    assert values(one_rank, "wrapped_and_stepped_without_synchronizing") == [("SGD", True)]


def test_wrapping_twice_is_refused(one_rank):
    assert values(one_rank, "wrapped_twice") == [
        "this optimizer is already a DistributedOptimizer; wrap the original optimizer once."]


def test_an_optimizer_with_a_patched_step_is_refused_and_left_as_it_was(one_rank):
    [(message, name)] = values(one_rank, "own_step_attribute")
    assert "has its own step attribute" in message and "wrap the optimizer with DistributedOptimizer before" in message
    assert name == "SGD"  # a refused wrap leaves the optimizer as it was


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
