"""Process sets at np=3, in one run of real rank processes: the evens' collectives with job-wide root ranks, what
an outsider may not do, adding, removing and refusing sets, and a DistributedOptimizer over a set. One case per
behaviour (tests/_cases.py), one test per case."""

from __future__ import annotations

import pytest
import torch
from _cases import add_to, message_of, run_cases, values

from sparkhvd import HorovodRunner

SETS: dict = {}
case = add_to(SETS)


@case
def evens(hvd, r, sets):
    ps = sets["evens"]
    return ps.process_set_id, ps.size(), ps.rank() if ps.included() else None, ps.included()


@case
def global_set(hvd, r, sets):
    return hvd.global_process_set.ranks


@case
def evens_collectives(hvd, r, sets):
    ps = sets["evens"]
    if not ps.included():
        return None
    return {"sum": hvd.allreduce(torch.tensor([r + 1.0]), op=hvd.Sum, process_set=ps),
            "broadcast": hvd.broadcast(torch.tensor([r]), root_rank=2, process_set=ps),  # a job-wide rank
            "allgather": hvd.allgather(torch.tensor([r]), process_set=ps),
            "object": hvd.broadcast_object(f"from {r}", root_rank=2, process_set=ps)}


@case
def root_outside_the_set(hvd, r, sets):
    ps = sets["evens"]
    return message_of(lambda: hvd.broadcast(torch.tensor([r]), root_rank=1, process_set=ps), ValueError) \
        if ps.included() else None


@case
def outsider_calls_a_collective(hvd, r, sets):
    ps = sets["evens"]
    return None if ps.included() else message_of(lambda: hvd.allreduce(torch.ones(1), process_set=ps), ValueError)


@case
def outsider_asks_its_rank(hvd, r, sets):
    ps = sets["evens"]
    return None if ps.included() else message_of(ps.rank, ValueError)


@case
def global_after(hvd, r, sets):
    return hvd.allreduce(torch.tensor([1.0]), op=hvd.Sum)


@case
def add_a_set_twice(hvd, r, sets):
    return message_of(lambda: hvd.add_process_set([0, 2]), ValueError)


@case
def add_a_set_of_unknown_ranks(hvd, r, sets):
    return message_of(lambda: hvd.add_process_set([0, 7]), ValueError)


@case
def remove(hvd, r, sets):
    ps = sets["evens"]
    removed = (hvd.remove_process_set(ps), hvd.remove_process_set(hvd.global_process_set))
    return removed, (ps.size(), ps.rank(), ps.included())


@case
def use_a_removed_set(hvd, r, sets):
    return message_of(lambda: hvd.allreduce(torch.ones(1), process_set=sets["evens"]), ValueError)


@case
def optimizer_over_a_set_and_an_outsider(hvd, r, sets):
    pair = hvd.add_process_set([1, 2])
    model = torch.nn.Linear(2, 1, bias=False)
    torch.nn.init.zeros_(model.weight)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0), process_set=pair)
    model(torch.full((1, 2), r + 1.0)).sum().backward()  # gradient: r + 1 in both columns
    opt.step()  # ranks 1 and 2 average theirs; rank 0, outside the set, trains alone (as in Horovod)
    return model.weight.detach()


def _process_sets():
    import sparkhvd.collective.torch as hvd

    evens = hvd.ProcessSet([0, 2])
    hvd.init(process_sets=[evens])
    result = run_cases(SETS, hvd, hvd.rank(), {"evens": evens})
    hvd.barrier()  # every rank leaves the cases together
    return result


@pytest.fixture(scope="module")
def ranks():
    return HorovodRunner(np=-3).run_all(_process_sets).values


def test_a_set_given_to_init_has_an_id_a_size_and_ranks_of_its_own(ranks):
    assert values(ranks, "evens") == [(1, 2, 0, True), (1, 2, None, False), (1, 2, 1, True)]
    assert values(ranks, "global_set") == [[0, 1, 2]] * 3


def test_the_members_collectives_take_job_wide_root_ranks(ranks):
    for v in values(ranks, "evens_collectives")[::2]:
        assert torch.equal(v["sum"], torch.tensor([4.0]))
        assert torch.equal(v["broadcast"], torch.tensor([2]))
        assert torch.equal(v["allgather"], torch.tensor([0, 2]))
        assert v["object"] == "from 2"


def test_a_root_outside_the_set_is_refused(ranks):
    assert values(ranks, "root_outside_the_set")[::2] == [
        "root_rank=1 is not a member of process set [0, 2]; root_rank is a job-wide rank (hvd.rank()), also within "
        "a process set, as in Horovod."] * 2


def test_an_outsider_may_not_call_the_sets_collectives(ranks):
    assert "rank 1 is not in process set [0, 2]; call a process set's collectives only on its members" in \
        values(ranks, "outsider_calls_a_collective")[1]


def test_an_outsider_has_no_rank_in_the_set(ranks):
    assert values(ranks, "outsider_asks_its_rank")[1] == (
        "rank 1 is not a member of process set [0, 2], so it has no rank in it; check process_set.included() first.")


def test_the_global_set_still_works_after_a_sets_ops(ranks):
    assert all(torch.equal(v, torch.tensor([3.0])) for v in values(ranks, "global_after"))


def test_a_set_added_twice_is_refused_with_its_id(ranks):
    assert values(ranks, "add_a_set_twice")[0] == "a process set with ranks [0, 2] already exists (id 1)."


def test_a_set_of_unknown_ranks_is_refused(ranks):
    assert values(ranks, "add_a_set_of_unknown_ranks")[0] == (
        "process set ranks [0, 7] must be a non-empty list of ranks in 0..2.")


def test_a_set_can_be_removed_but_the_global_set_cannot(ranks):
    assert [v for v, _ in values(ranks, "remove")] == [(True, False)] * 3
    assert [after for _, after in values(ranks, "remove")] == [(None, None, True), (None, None, False),
                                                               (None, None, True)]


def test_a_removed_set_is_refused(ranks):
    assert "has not been added; call hvd.add_process_set() on every rank first" in \
        values(ranks, "use_a_removed_set")[0]


def test_an_optimizer_over_a_set_averages_its_members_and_an_outsider_trains_alone(ranks):
    weights = values(ranks, "optimizer_over_a_set_and_an_outsider")
    assert torch.equal(weights[0], torch.full((1, 2), -1.0))  # its own gradient, 1
    assert torch.equal(weights[1], torch.full((1, 2), -2.5))  # the average of 2 and 3
    assert torch.equal(weights[2], torch.full((1, 2), -2.5))
