"""When ranks disagree, or one rank's arguments are wrong, every rank gets the same clear error, without a hang, and
the job goes on in step: joins, SyncBatchNorm, optimizers and a second init still work after it. Real rank
processes; one case per behaviour (tests/_cases.py), one test per case."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _cases import add_to, message_of, named, run_cases, values

from sparkhvd import HorovodRunner

# ---- ranks that disagree, at np=2 -----------------------------------------------------------------------------

_DISAGREEMENTS = {
    "shape": lambda hvd, r: hvd.allreduce(torch.ones(4 + r)),
    "dtype": lambda hvd, r: hvd.allreduce(torch.ones(4, dtype=torch.float32 if r == 0 else torch.float64)),
    "op": lambda hvd, r: hvd.allreduce(torch.ones(4), op=hvd.Sum if r == 0 else hvd.Max),
    "broadcast_shape": lambda hvd, r: hvd.broadcast(torch.ones(4 + r), root_rank=0),
    "broadcast_root": lambda hvd, r: hvd.broadcast(torch.ones(4), root_rank=r),
    "grouped": lambda hvd, r: hvd.grouped_allreduce([torch.ones(2)] * (1 + r)),
    "allgather_dtype": lambda hvd, r: hvd.allgather(torch.ones(r + 1, dtype=torch.int32 if r else torch.int64)),
    "reducescatter": lambda hvd, r: hvd.reducescatter(torch.ones(4 + r)),
    "alltoall": lambda hvd, r: hvd.alltoall(torch.ones(2, 1 + r)),
}


def _disagreement(call):
    def case(hvd, r):
        try:
            call(hvd, r)
        except (ValueError, RuntimeError) as exc:  # RuntimeError: hvd.HorovodInternalError, as Horovod's
            return f"{type(exc).__name__}: {exc}"
        return "no error"
    return case


DISAGREE = {key: _disagreement(call) for key, call in _DISAGREEMENTS.items()}
DISAGREE["still_works"] = lambda hvd, r: hvd.allreduce(torch.tensor([1.0]), op=hvd.Sum).item()


def _disagreements():
    import sparkhvd.collective.torch as hvd

    hvd.init()
    return run_cases(DISAGREE, hvd, hvd.rank())


@pytest.fixture(scope="module")
def two_ranks():
    return HorovodRunner(np=-2).run_all(_disagreements).values


RULE = ("Every rank must call the ops of a name (unnamed ops are matched in the order each rank calls them) with the "
        "same dtype, device and shape")


@pytest.mark.parametrize("name, fragment", named(
    ("shape", f"HorovodInternalError: ranks disagree on the 1st unnamed allreduce: rank 0: allreduce(op=Average: "
              f"float32[4] on cpu); rank 1: allreduce(op=Average: float32[5] on cpu). {RULE} (and the same op and "
              f"root_rank)."),
    ("dtype", "rank 0: allreduce(op=Average: float32[4] on cpu); rank 1: allreduce(op=Average: float64[4] on cpu)"),
    ("op", "rank 0: allreduce(op=Sum: float32[4] on cpu); rank 1: allreduce(op=Max: float32[4] on cpu)"),
    ("broadcast_shape", "rank 0: broadcast(root_rank=0: float32[4] on cpu); rank 1: broadcast(root_rank=0: "
                        "float32[5] on cpu)"),
    ("broadcast_root", "rank 0: broadcast(root_rank=0: float32[4] on cpu); rank 1: broadcast(root_rank=1: "
                       "float32[4] on cpu)"),
    ("grouped", "rank 1: grouped_allreduce(op=Average: float32[2] on cpu, float32[2] on cpu)"),
    ("allgather_dtype", "rank 0: allgather(int64[*] on cpu); rank 1: allgather(int32[*] on cpu)"),
    ("reducescatter", "rank 0: reducescatter(op=Average: float32[4] on cpu)"),
    ("alltoall", "rank 0: alltoall(float32[*, 1] on cpu); rank 1: alltoall(float32[*, 2] on cpu)")
))
def test_ranks_that_disagree_get_the_same_clear_error(two_ranks, name, fragment):
    v0, v1 = values(two_ranks, name)
    assert v0 == v1  # every rank raises the same error
    assert fragment in v0 and (name != "shape" or v0 == fragment), v0


def test_the_ranks_are_still_in_step_after_they_disagreed(two_ranks):
    assert values(two_ranks, "still_works") == [2.0, 2.0]


# ---- one rank differs, at np=3 --------------------------------------------------------------------------------

ONE: dict = {}
case = add_to(ONE)


@case
def alltoall_indivisible_on_rank_0(hvd, r):
    # only rank 0 has a first dimension the ranks cannot divide
    return message_of(lambda: hvd.alltoall(torch.ones(6 if r else 5)), ValueError)


@case
def root_outside_the_job_on_rank_0(hvd, r):
    return message_of(lambda: hvd.broadcast(torch.ones(2), root_rank=0 if r else 9), ValueError)


@case
def name_reused_on_rank_0(hvd, r):
    # every rank has "n" in flight; rank 0 reuses the name (an error there only, as in Horovod) while the others
    # start "m", which no one else submits: it waits, and holds up nothing else
    first = hvd.allreduce_async(torch.ones(1), name="n")
    reused = message_of(lambda: hvd.allreduce_async(torch.ones(1), name="n" if r == 0 else "m"), ValueError)
    return reused, hvd.synchronize(first).item()


@case
def in_step_after(hvd, r):
    return hvd.allreduce(torch.ones(1), op=hvd.Sum).item()


@case
def input_of_a_failed_op(hvd, r):
    t = torch.ones(3 + r)  # the ranks disagree: the op fails, and the tensor must stay as it was
    try:
        hvd.grouped_allreduce_([t], op=hvd.Sum, prescale_factor=2.0)
    except RuntimeError:  # hvd.HorovodInternalError
        pass
    return t


@case
def join_after_a_process_sets_ops(hvd, r):
    pair = hvd.add_process_set([1, 2])
    if r in (1, 2):
        hvd.allreduce(torch.ones(1), process_set=pair)
    if r == 2:  # answered once ranks 0 and 1 are inside join(), with "m" of name_reused_on_rank_0 (which rank 0's
        hvd.allreduce(torch.ones(1), name="last")  # join makes ready): rank 2 then joins last, alone, under any load
    return hvd.join()  # process-set exchanges do not confuse join's bookkeeping


@case
def sync_batch_norm_in_eval_without_running_stats(hvd, r):
    bn = hvd.SyncBatchNorm(1, affine=False, track_running_stats=False).eval()
    return bn(torch.tensor([[float(r)]]))  # no running stats: batch stats over all ranks


@case
def optimizer_over_a_repeated_parameter(hvd, r):
    model = torch.nn.Linear(1, 1)
    opt = hvd.DistributedOptimizer(torch.optim.SGD([model.weight, model.weight, model.bias], lr=0.1))
    for _ in range(2):
        opt.zero_grad()
        model(torch.ones(1, 1)).sum().backward()
        opt.step()
    return len(opt._hvd_buckets._where)


@case
def optimizer_a_rank_does_not_build(hvd, r):
    evens = hvd.add_process_set([0, 2])
    torch.manual_seed(0)
    a, b = torch.nn.Linear(2, 1), torch.nn.Linear(2, 1)
    if evens.included():  # rank 1 builds no optimizer for this set, as Horovod allows
        opt_a = hvd.DistributedOptimizer(torch.optim.SGD(a.parameters(), lr=1.0), process_set=evens)
        a(torch.ones(1, 2) * r).sum().backward()
        opt_a.step()
    opt_b = hvd.DistributedOptimizer(torch.optim.SGD(b.parameters(), lr=1.0), backward_passes_per_step=np.int64(1))
    opt_b.backward_passes_per_step = 2.0  # Horovod takes any whole number, and the attribute
    for _ in range(2):
        b(torch.ones(1, 2) * r).sum().backward()
    opt_b.step()
    return b.weight.detach().clone()


@case
def sparse_dense_on_rank_1(hvd, r):
    return message_of(lambda: hvd.sparse_allreduce_async(
        torch.ones(3) if r == 1 else torch.sparse_coo_tensor([[r]], [1.0], (3,)))(), ValueError)


@case
def reducescatter_scalar_on_rank_1(hvd, r):
    return message_of(lambda: hvd.reducescatter(torch.tensor(1.0) if r == 1 else torch.ones(3)), ValueError)


@case
def alltoall_scalar_on_rank_1(hvd, r):
    return message_of(lambda: hvd.alltoall(torch.tensor(1.0) if r == 1 else torch.ones(3)), ValueError)


@case
def init_again_after_an_op_left_in_flight(hvd, r):
    hvd.allreduce_async(torch.ones(1), name="left")  # never synchronized
    hvd.shutdown()
    hvd.init()
    return hvd.synchronize(hvd.allreduce_async(torch.ones(1), name="left", op=hvd.Sum))


def _one_rank_differs():
    import sparkhvd.collective.torch as hvd

    hvd.init()
    return run_cases(ONE, hvd, hvd.rank())


@pytest.fixture(scope="module")
def three_ranks():
    return HorovodRunner(np=-3).run_all(_one_rank_differs).values


def test_an_indivisible_alltoall_on_one_rank_fails_every_rank(three_ranks):
    assert values(three_ranks, "alltoall_indivisible_on_rank_0") == [
        "rank 0: alltoall without splits needs the first dimension (5) to be divisible by the number of ranks (3); "
        "pass splits= to send uneven parts."] * 3


def test_a_root_outside_the_job_on_one_rank_fails_every_rank(three_ranks):
    assert values(three_ranks, "root_outside_the_job_on_rank_0")[1] == (
        "rank 0: root_rank=9 is outside the ranks 0..2 of this job.")


def test_a_name_reused_while_in_flight_fails_that_rank_only(three_ranks):
    reused = values(three_ranks, "name_reused_on_rank_0")
    assert reused[0][0].startswith("another allreduce named 'n' is already in flight on this rank")
    assert [m for m, _ in reused[1:]] == ["no error", "no error"]
    assert [first for _, first in reused] == [1.0, 1.0, 1.0]


def test_the_ranks_are_still_in_step_after_one_failed(three_ranks):
    assert values(three_ranks, "in_step_after") == [3.0, 3.0, 3.0]


def test_a_failed_in_place_op_leaves_its_input_as_it_was(three_ranks):
    for r, t in enumerate(values(three_ranks, "input_of_a_failed_op")):
        assert torch.equal(t, torch.ones(3 + r))


def test_join_after_a_process_sets_ops_returns_the_last_rank(three_ranks):
    assert values(three_ranks, "join_after_a_process_sets_ops") == [2, 2, 2]


def test_sync_batch_norm_in_eval_without_running_stats_uses_every_ranks_batch(three_ranks):
    expected = (torch.tensor([0.0, 1.0, 2.0]) - 1.0) / torch.sqrt(torch.tensor(2 / 3 + 1e-5))
    got = values(three_ranks, "sync_batch_norm_in_eval_without_running_stats")
    torch.testing.assert_close(torch.cat(got).flatten(), expected)


def test_an_optimizer_over_a_repeated_parameter_reduces_it_once(three_ranks):
    assert values(three_ranks, "optimizer_over_a_repeated_parameter")[0] == 2


def test_an_optimizer_one_rank_does_not_build_leaves_the_global_ones_buckets_paired(three_ranks):
    weights = values(three_ranks, "optimizer_a_rank_does_not_build")
    assert all(torch.equal(w, weights[0]) for w in weights)  # the global optimizer's buckets paired up


@pytest.mark.parametrize("name, message", [
    ("sparse_dense_on_rank_1", "rank 1: sparse_allreduce_async takes a sparse COO tensor, got torch.strided; use "
                               "allreduce_async for dense ones."),
    ("reducescatter_scalar_on_rank_1", "rank 1: reducescatter needs a tensor with at least one dimension; got a "
                                       "scalar."),
    ("alltoall_scalar_on_rank_1", "rank 1: alltoall needs a tensor with at least one dimension; got a scalar."),
])
def test_a_wrong_argument_on_one_rank_is_every_ranks_error(three_ranks, name, message):
    assert values(three_ranks, name) == [message] * 3


def test_init_again_after_an_op_left_in_flight(three_ranks):
    again = values(three_ranks, "init_again_after_an_op_left_in_flight")
    assert all(torch.equal(v, torch.tensor([3.0])) for v in again)
