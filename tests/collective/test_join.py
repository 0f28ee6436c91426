"""hvd.join(): uneven inputs at np=3; joined ranks stand in with zeros until every rank joins."""

from __future__ import annotations

import torch

from sparkhvd import HorovodRunner


def _batches(rank):
    g = torch.Generator().manual_seed(rank)
    return [(torch.randn(4, 2, generator=g), torch.randn(4, 1, generator=g)) for _ in range(rank + 1)]


def _uneven_training():
    import torch

    import sparkhvd.collective.torch as hvd

    hvd.init()
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5),
                                   named_parameters=model.named_parameters())
    for x, y in _batches(hvd.rank()):  # rank r has r+1 batches
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    last = hvd.join()
    return last, [p.detach().clone() for p in model.parameters()]


def test_uneven_training_with_join_matches_the_zero_padded_average():
    values = HorovodRunner(np=-3).run_all(_uneven_training).values
    assert [last for last, _ in values] == [2, 2, 2]
    # Simulate: at step k the ranks with more than k batches contribute, joined ones add zeros.
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    data = [_batches(r) for r in range(3)]
    expected = {}
    for k in range(3):
        grads = []
        for r in range(3):
            if k < len(data[r]):
                model.zero_grad()
                torch.nn.functional.mse_loss(model(data[r][k][0]), data[r][k][1]).backward()
                grads.append([p.grad.clone() for p in model.parameters()])
        with torch.no_grad():
            for i, p in enumerate(model.parameters()):
                p -= 0.5 * sum(g[i] for g in grads) / 3  # Average divides by size()
        expected[k] = [p.detach().clone() for p in model.parameters()]
    for rank, (_, weights) in enumerate(values):
        for got, want in zip(weights, expected[rank]):  # rank r stopped after its r+1 steps
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def _ops_while_joined():
    import torch

    import sparkhvd.collective.torch as hvd

    hvd.init()
    r = hvd.rank()
    out = {}
    if r == 0:
        out["last"] = hvd.join()
        return out
    out["sum"] = hvd.allreduce(torch.ones(3), op=hvd.Sum)
    out["avg"] = hvd.allreduce(torch.ones(2) * 3)
    out["grouped"] = hvd.grouped_allreduce([torch.ones(2), torch.ones(1, dtype=torch.int64)], op=hvd.Sum)
    out["large"] = hvd.allreduce(torch.ones(400_000), op=hvd.Sum)  # beyond the control frame: a joined rank adds zeros
    bn = hvd.SyncBatchNorm(1, affine=False)
    out["bn"] = bn(torch.tensor([[0.0], [2.0]]) + 10 * r)  # stats over ranks 1 and 2 only
    out["last"] = hvd.join()
    return out


def test_reductions_while_a_rank_has_joined():
    v0, v1, v2 = HorovodRunner(np=-3).run_all(_ops_while_joined).values
    assert v0["last"] == v1["last"] == v2["last"] == 2  # ranks 1 and 2 joined together last: the highest
    for v in (v1, v2):
        assert torch.equal(v["sum"], torch.full((3,), 2.0))
        assert torch.equal(v["avg"], torch.full((2,), 2.0))  # (3 + 3 + 0) / 3
        assert torch.equal(v["grouped"][0], torch.full((2,), 2.0))
        assert torch.equal(v["grouped"][1], torch.full((1,), 2, dtype=torch.int64))
        assert torch.equal(v["large"], torch.full((400_000,), 2.0))
    values = torch.tensor([0.0, 2.0, 10.0, 12.0])  # the batch statistics cover ranks 1 and 2 only
    expected = (values - values.mean()) / torch.sqrt(values.var(unbiased=False) + 1e-5)
    torch.testing.assert_close(torch.cat([v1["bn"], v2["bn"]]).flatten(), expected)


def _unsupported_while_joined():
    import torch

    import sparkhvd.collective.torch as hvd

    hvd.init()
    t = torch.tensor([15.0 - 5 * hvd.rank()])  # the minimum, 10, must not reach rank 0's tensor
    if hvd.rank() == 2:
        return None, t, hvd.join()  # it goes on waiting while the others' ops fail, as in Horovod
    errors = []
    for call in (lambda: hvd.alltoall(torch.ones(3)),
                 lambda: hvd.allgather(torch.ones(2)),
                 lambda: hvd.allreduce_(t, op=hvd.Min)):  # small enough to ride inline: must fail untouched
        try:
            call()
            errors.append("no error")
        except RuntimeError as exc:  # hvd.HorovodInternalError, as Horovod's tests expect
            errors.append(str(exc))
    return errors, t, hvd.join()


def test_an_op_that_cannot_join_fails_on_the_working_ranks():
    values = HorovodRunner(np=-3).run_all(_unsupported_while_joined).values
    assert [t.item() for _, t, _ in values] == [15.0, 10.0, 5.0]
    assert [last for _, _, last in values] == [1, 1, 1]  # ranks 0 and 1 joined together last: the highest
    e0, e1, _ = (errors for errors, _, _ in values)
    assert e0 == e1
    assert e0[0] == ("alltoall cannot run while ranks 2 have called hvd.join(); only allreduce and grouped_allreduce "
                     "with op=Average or Sum, DistributedOptimizer and SyncBatchNorm take part in join (as in "
                     "Horovod); the joined ranks go on waiting in join().")
    assert e0[1].startswith("allgather cannot run while ranks 2 have called hvd.join()")
    assert e0[2].startswith("allreduce cannot run while ranks 2 have called hvd.join()")


def test_join_alone():
    def train():
        import sparkhvd.collective.torch as hvd

        hvd.init()
        return hvd.join()

    assert HorovodRunner(np=-1).run(train) == 0

