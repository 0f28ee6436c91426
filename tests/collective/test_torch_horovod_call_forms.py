"""Horovod's own call forms and flags work as in Horovod, at np=2 in real rank processes: init's arguments, a name in
flight once per kind of op, grouped async ops, sparse_allreduce_async, 16-bit integers, average=0, broadcasts of
bare tensors and of an optimizer with a model, and set_backward_passes_per_step. One case per call form
(tests/_cases.py), one test per case."""

from __future__ import annotations

import pytest
import torch
from _cases import add_to, message_of, run_cases, values

from sparkhvd import HorovodRunner

FORMS: dict = {}
form = add_to(FORMS)


@form
def init_with_static_process_sets(hvd, state):
    return message_of(lambda: hvd.init(process_sets="static"), ValueError)


@form
def init_with_a_subset_comm(hvd, state):
    return message_of(lambda: hvd.init(comm=[0]), ValueError)


@form
def init_with_every_rank_and_dynamic_sets(hvd, state):
    hvd.init(comm=[1, 0], process_sets="dynamic")  # Horovod's forms: every rank, sets added later
    state["r"] = hvd.rank()
    return hvd.size()


@form
def mpi_threads_supported(hvd, state):
    return message_of(hvd.mpi_threads_supported, ValueError)


@form
def internal_error_is_a_runtime_error(hvd, state):
    return issubclass(hvd.HorovodInternalError, RuntimeError)


@form
def a_name_per_kind_of_op(hvd, state):
    # a name may be in flight once per kind of op, as Horovod prefixes names with the op
    r = state["r"]
    h1 = hvd.allreduce_async(torch.tensor([1.0 + r]), name="x", op=hvd.Sum)
    h2 = hvd.broadcast_async(torch.tensor([r]), root_rank=1, name="x")
    return hvd.synchronize(h1), hvd.synchronize(h2)


@form
def grouped_async_started(hvd, state):
    r = state["r"]  # synchronized in grouped_forms, after the ops below
    state["gathered"] = hvd.grouped_allgather_async([torch.tensor([r]), torch.tensor([[r, r]])], name="g")
    state["scattered"] = hvd.grouped_reducescatter_async([torch.arange(4.0) * (r + 1)], op=hvd.Sum)


@form
def sparse_allreduce_async(hvd, state):
    r = state["r"]
    sparse = hvd.sparse_allreduce_async(torch.sparse_coo_tensor([[r]], [1.0 + r], (3,)), name="s", op=hvd.Sum)
    return sparse().to_dense()  # Horovod returns a function to call


@form
def sparse_allreduce_async_of_a_dense_tensor(hvd, state):
    return message_of(lambda: hvd.sparse_allreduce_async(torch.ones(2)), ValueError)


def _int16(numel):
    def case(hvd, state):  # gloo has no 16-bit integers: reduced through int32
        return hvd.allreduce(torch.full((numel,), 3 + state["r"], dtype=torch.int16), op=hvd.Sum)
    return case


INT16_NUMELS = (4, 1_100_000)
for _numel in INT16_NUMELS:
    FORMS[f"int16_{_numel}"] = _int16(_numel)


@form
def average_0(hvd, state):
    return hvd.allreduce(torch.tensor([1.0]), average=0)  # falsy: Sum, as Horovod


@form
def fp16_average(hvd, state):
    big = torch.tensor([60000.0], dtype=torch.float16)  # out of place is the same op: sum, then divide
    return hvd.allreduce(big), hvd.allreduce_(big.clone())


@form
def grouped_forms(hvd, state):
    return (hvd.synchronize(state["gathered"]), hvd.synchronize(state["scattered"]),
            hvd.grouped_allreduce([torch.ones(1)]), hvd.grouped_allreduce_([torch.ones(1)]))


@form
def broadcast_parameters_of_bare_tensors(hvd, state):
    model = state["model"] = torch.nn.Linear(2, 1)
    torch.nn.init.constant_(model.weight, float(state["r"]))
    hvd.broadcast_parameters(list(model.parameters()), root_rank=1)  # bare tensors, as Horovod allows
    return model.weight.detach().clone()


@form
def broadcast_optimizer_state_with_a_model(hvd, state):
    model = state["model"]
    opt = state["opt"] = torch.optim.SGD(model.parameters(), lr=0.1 * (state["r"] + 1))
    hvd.broadcast_optimizer_state(opt, 1, model=model)  # Horovod's third argument
    return opt.param_groups[0]["lr"]


@form
def backward_passes_per_step_0(hvd, state):
    return message_of(lambda: hvd.DistributedOptimizer(torch.optim.SGD(state["model"].parameters(), lr=0.1),
                                                       backward_passes_per_step=0), ValueError)


@form
def set_backward_passes_per_step(hvd, state):
    model = state["model"]
    opt = hvd.DistributedOptimizer(state["opt"], named_parameters=model.named_parameters())
    opt.set_backward_passes_per_step(2)
    for _ in range(2):
        model(torch.ones(1, 2)).sum().backward()
    in_flight = message_of(lambda: opt.set_backward_passes_per_step(1), RuntimeError)
    opt.step()
    return in_flight, opt.backward_passes_per_step, model.bias.grad.clone()


def _horovod_signatures():
    import sparkhvd.collective.torch as hvd

    return run_cases(FORMS, hvd, {})


@pytest.fixture(scope="module")
def ranks():
    return HorovodRunner(np=-2).run_all(_horovod_signatures).values


def test_init_refuses_static_process_sets(ranks):
    assert values(ranks, "init_with_static_process_sets") == [
        "init(process_sets='static'): pass a list of ProcessSets or \"dynamic\"."] * 2


def test_init_refuses_a_comm_of_some_ranks(ranks):
    assert values(ranks, "init_with_a_subset_comm") == [
        "init(comm=[0]): sparkhvd always runs on every rank of the job ([0, 1]); pass comm=None, and put a subset of "
        "ranks in a process set (hvd.add_process_set)."] * 2


def test_init_takes_every_rank_and_dynamic_sets(ranks):
    assert values(ranks, "init_with_every_rank_and_dynamic_sets") == [2, 2]


def test_mpi_threads_supported_says_mpi_is_not_enabled(ranks):
    for v in values(ranks, "mpi_threads_supported"):
        assert v.startswith("MPI is not enabled: this process did not join its job through MPI")


def test_horovod_internal_error_is_a_runtime_error(ranks):
    assert values(ranks, "internal_error_is_a_runtime_error") == [True, True]


def test_a_name_may_be_in_flight_once_per_kind_of_op(ranks):
    for summed, broadcast in values(ranks, "a_name_per_kind_of_op"):
        assert torch.equal(summed, torch.tensor([3.0])) and torch.equal(broadcast, torch.tensor([1]))


def test_sparse_allreduce_async_returns_a_function_to_call(ranks):
    assert all(torch.equal(v, torch.tensor([1.0, 2.0, 0.0])) for v in values(ranks, "sparse_allreduce_async"))


def test_sparse_allreduce_async_refuses_a_dense_tensor(ranks):
    assert values(ranks, "sparse_allreduce_async_of_a_dense_tensor") == [
        "sparse_allreduce_async takes a sparse COO tensor, got torch.strided; use allreduce_async for dense ones."] * 2


@pytest.mark.parametrize("numel", INT16_NUMELS)
def test_int16_is_reduced_through_int32(ranks, numel):
    assert all(torch.equal(v, torch.full((numel,), 7, dtype=torch.int16)) for v in values(ranks, f"int16_{numel}"))


def test_average_0_sums_as_horovod(ranks):
    assert all(torch.equal(v, torch.tensor([2.0])) for v in values(ranks, "average_0"))


def test_fp16_average_overflows_before_the_division_in_place_or_not(ranks):
    for v in values(ranks, "fp16_average"):
        assert all(torch.isinf(t).all() for t in v)  # 120000 overflows fp16 before the division


def test_grouped_ops_return_tuples_and_async_ones_wait_across_other_ops(ranks):
    for r, (gathered, scattered, grouped, grouped_) in enumerate(values(ranks, "grouped_forms")):
        assert isinstance(gathered, tuple) and isinstance(grouped, tuple) and isinstance(grouped_, tuple)
        assert torch.equal(gathered[0], torch.tensor([0, 1]))
        assert torch.equal(gathered[1], torch.tensor([[0, 0], [1, 1]]))
        assert torch.equal(scattered[0], (torch.arange(4.0) * 3)[2 * r:2 * r + 2])


def test_broadcast_parameters_takes_bare_tensors(ranks):
    assert all(torch.equal(v, torch.ones(1, 2)) for v in values(ranks, "broadcast_parameters_of_bare_tensors"))


def test_broadcast_optimizer_state_takes_horovods_model_argument(ranks):
    assert values(ranks, "broadcast_optimizer_state_with_a_model") == [pytest.approx(0.2)] * 2


def test_backward_passes_per_step_must_be_1_or_more(ranks):
    assert values(ranks, "backward_passes_per_step_0") == [
        "backward_passes_per_step must be a whole number of 1 or more, got 0."] * 2


def test_set_backward_passes_per_step_sums_the_passes_and_is_refused_mid_reduction(ranks):
    for in_flight, passes, bias_grad in values(ranks, "set_backward_passes_per_step"):
        assert in_flight == ("set_backward_passes_per_step() was called while gradients were being reduced; call it "
                             "right after optimizer.step().")
        assert passes == 2 and torch.equal(bias_grad, torch.tensor([2.0]))  # two passes, summed
