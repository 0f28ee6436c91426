"""At np=2 in real rank processes: topology, allreduce of every dtype and shape with its variants (average=False,
scaling, in place), broadcast and allgather forms, broadcast_object, broadcast_parameters in every form Horovod takes,
broadcast_optimizer_state, argument errors that name the fix, and shutdown then init again in the same processes. One
case per op (tests/_cases.py), one test per case."""

from __future__ import annotations

import re

import pytest
import torch
from _cases import add_to, named, run_cases, values

from sparkhvd import HorovodRunner


def _name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _in_place(reduce, t, **kwargs):
    reduce(t, **kwargs)
    return t


BASICS: dict = {}
basic = add_to(BASICS)


@basic
def topology(hvd, r, n):
    return (hvd.rank(), hvd.size(), hvd.local_rank(), hvd.local_size(), hvd.cross_rank(), hvd.cross_size(),
            hvd.is_initialized())


def _sum_and_average(dtype, dims):
    def case(hvd, r, n):
        x = (torch.arange(4 ** dims) + 1 + 10 * r).to(dtype).reshape([4] * dims)
        before = x.clone()
        summed, averaged = hvd.allreduce(x, op=hvd.Sum), hvd.allreduce(x)  # Average is the default
        return summed, averaged, torch.equal(x, before)  # allreduce leaves its input alone
    return case


for _dtype in (torch.int32, torch.int64, torch.float32, torch.float64):
    for _dims in (1, 2, 3):
        BASICS[f"allreduce_{_name(_dtype)}_{_dims}"] = _sum_and_average(_dtype, _dims)


@basic
def legacy_average_false(hvd, r, n):
    return hvd.allreduce(torch.tensor([1.0 + r]), average=False)


@basic
def scaled(hvd, r, n):
    return hvd.allreduce(torch.tensor([1.0 + r]), op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.5)


@basic
def allreduce_in_place(hvd, r, n):
    return _in_place(hvd.allreduce_, torch.tensor([float(r)] * 3), op=hvd.Sum)


@basic
def broadcast(hvd, r, n):
    return hvd.broadcast(torch.tensor([r, r + 1]), root_rank=n - 1)


@basic
def broadcast_in_place(hvd, r, n):
    return _in_place(hvd.broadcast_, torch.full((2, 2), float(r)), root_rank=0)


@basic
def allgather_uneven(hvd, r, n):
    return hvd.allgather(torch.full((r + 1, 2), r, dtype=torch.int64))  # uneven first dims


@basic
def allgather_scalar(hvd, r, n):
    return hvd.allgather(torch.tensor(float(r)))


@basic
def broadcast_object(hvd, r, n):
    out = hvd.broadcast_object({"from": r, "list": list(range(r + 1))}, root_rank=n - 1)
    hvd.barrier()
    return out


def _model_of(r):
    model = torch.nn.Linear(3, 2)
    torch.nn.init.constant_(model.weight, float(r))
    torch.nn.init.constant_(model.bias, float(r))
    return model


@basic
def parameters_named(hvd, r, n):
    model = _model_of(r)
    hvd.broadcast_parameters(model.named_parameters(), root_rank=n - 1)
    return model.weight.detach().clone()


@basic
def parameters_state_dict(hvd, r, n):
    model = _model_of(r)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    return model.weight.detach().clone()


@basic
def parameters_list(hvd, r, n):
    model = _model_of(r)
    hvd.broadcast_parameters(list(model.named_parameters()), root_rank=n - 1)
    return model.bias.detach().clone()


@basic
def optimizer_state(hvd, r, n):
    model = _model_of(r)
    opt = torch.optim.Adam(model.parameters(), lr=0.01 * (r + 1))
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    return opt.param_groups[0]["lr"], opt.state_dict()["state"][0]["exp_avg"].clone()


_ERRORS = {
    "error_root": lambda hvd, r, n: hvd.broadcast(torch.ones(1), root_rank=n),
    "error_op": lambda hvd, r, n: hvd.allreduce(torch.ones(1), op=17),
    "error_both": lambda hvd, r, n: hvd.allreduce(torch.ones(1), op=hvd.Sum, average=True),
    "error_not_tensor": lambda hvd, r, n: hvd.allreduce([1, 2]),
    "error_params": lambda hvd, r, n: hvd.broadcast_parameters(42),
    "error_params_value": lambda hvd, r, n: hvd.broadcast_parameters({"w": 3}),
    "error_opt": lambda hvd, r, n: hvd.broadcast_optimizer_state("adam"),
    "error_allgather_dims": lambda hvd, r, n: hvd.allgather(torch.ones([2] * (r + 1))),
}


def _error_case(call):
    def case(hvd, r, n):
        try:
            call(hvd, r, n)
        except Exception as exc:  # noqa: BLE001 - the test compares the type and the message
            return f"{type(exc).__name__}: {exc}"
        return "no error"
    return case


for _key, _call in _ERRORS.items():
    BASICS[_key] = _error_case(_call)


@basic
def shutdown_and_init_again(hvd, r, n):
    hvd.shutdown()
    after_shutdown = hvd.is_initialized()
    hvd.init()  # a second init in the same process gets fresh rendezvous keys
    return after_shutdown, hvd.allreduce(torch.tensor([1]), op=hvd.Sum)


def _basics():
    import sparkhvd.collective.torch as hvd

    hvd.init()
    return run_cases(BASICS, hvd, hvd.rank(), hvd.size())


@pytest.fixture(scope="module")
def two_ranks():
    return HorovodRunner(np=-2).run_all(_basics).values


def test_topology(two_ranks):
    assert values(two_ranks, "topology") == [(0, 2, 0, 2, 0, 1, True), (1, 2, 1, 2, 0, 1, True)]


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.float32, torch.float64], ids=_name)
@pytest.mark.parametrize("dims", [1, 2, 3])
def test_allreduce_sum_and_average(two_ranks, dtype, dims):
    base = torch.arange(4 ** dims) + 1
    expected_sum = (2 * base + 10).to(dtype).reshape([4] * dims)
    expected_avg = (expected_sum // 2) if not dtype.is_floating_point else expected_sum / 2
    for summed, averaged, input_kept in values(two_ranks, f"allreduce_{_name(dtype)}_{dims}"):
        assert summed.dtype == dtype
        assert torch.equal(summed, expected_sum)
        assert torch.equal(averaged, expected_avg.to(dtype))
        assert input_kept


def test_average_false_sums(two_ranks):
    assert all(torch.equal(v, torch.tensor([3.0])) for v in values(two_ranks, "legacy_average_false"))


def test_prescale_and_postscale(two_ranks):
    assert all(torch.equal(v, torch.tensor([3.0])) for v in values(two_ranks, "scaled"))  # (1*2 + 2*2) * 0.5


def test_allreduce_in_place(two_ranks):
    assert all(torch.equal(v, torch.tensor([1.0, 1.0, 1.0])) for v in values(two_ranks, "allreduce_in_place"))


def test_broadcast(two_ranks):
    assert all(torch.equal(v, torch.tensor([1, 2])) for v in values(two_ranks, "broadcast"))


def test_broadcast_in_place(two_ranks):
    assert all(torch.equal(v, torch.zeros(2, 2)) for v in values(two_ranks, "broadcast_in_place"))


def test_allgather_of_uneven_first_dimensions(two_ranks):
    assert all(torch.equal(v, torch.tensor([[0, 0], [1, 1], [1, 1]])) for v in values(two_ranks, "allgather_uneven"))


def test_allgather_of_scalars(two_ranks):
    assert all(torch.equal(v, torch.tensor([0.0, 1.0])) for v in values(two_ranks, "allgather_scalar"))


def test_broadcast_object(two_ranks):
    assert values(two_ranks, "broadcast_object") == [{"from": 1, "list": [0, 1]}] * 2


@pytest.mark.parametrize("name, expected", named(("parameters_named", torch.ones(2, 3)),
                                                 ("parameters_state_dict", torch.zeros(2, 3)),
                                                 ("parameters_list", torch.ones(2))))
def test_broadcast_parameters_accepts_every_form(two_ranks, name, expected):
    assert all(torch.equal(v, expected) for v in values(two_ranks, name))


def test_broadcast_optimizer_state(two_ranks):
    (lr0, state0), (lr1, state1) = values(two_ranks, "optimizer_state")
    assert [lr0, lr1] == [0.01, 0.01]
    assert torch.equal(state0, state1)


_ALLGATHER_DIMS = re.compile(
    r"HorovodInternalError: ranks disagree on the \d+(st|nd|rd|th) unnamed allgather: rank 0: allgather\(float32\[\*\] "
    r"on cpu\); rank 1: allgather\(float32\[\*, 2\] on cpu\)\. Every rank must call the ops of a name \(unnamed ops "
    r"are matched in the order each rank calls them\) with the same dtype, device and dimensions after the first "
    r"\(and the same op and root_rank\)\.")


@pytest.mark.parametrize("name, check", named(
    ("error_root", lambda e: e == "ValueError: root_rank=2 is outside the ranks 0..1 of this job."),
    ("error_op", lambda e: e.startswith("ValueError: op=17 is not a reduction; use hvd.Average")),
    ("error_both", lambda e: "pass only op=hvd.Average or op=hvd.Sum" in e),
    ("error_not_tensor", lambda e: e == "TypeError: allreduce takes a torch.Tensor, got list."),
    ("error_params", lambda e: "broadcast_parameters takes a state_dict" in e),
    ("error_params_value", lambda e: "'w' is a int, not a tensor; broadcast non-tensor values with "
                                     "hvd.broadcast_object" in e),
    ("error_opt", lambda e: "broadcast_optimizer_state takes a torch.optim.Optimizer, got str" in e),
    ("error_allgather_dims", lambda e: _ALLGATHER_DIMS.fullmatch(e) is not None)
))
def test_errors_name_the_values_and_the_fix(two_ranks, name, check):
    for message in values(two_ranks, name):
        assert check(message), message


def test_shutdown_and_init_again(two_ranks):
    for after_shutdown, reinit_sum in values(two_ranks, "shutdown_and_init_again"):
        assert after_shutdown is False
        assert torch.equal(reinit_sum, torch.tensor([2]))
