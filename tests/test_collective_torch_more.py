"""Async handles, grouped ops, alltoall, reducescatter, process sets, compression and gradients,
at np=2 and np=3 in real rank processes; inputs built from the rank, exact expected values."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from sparkhvd import HorovodRunner

DTYPES = (torch.int32, torch.int64, torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _ops():
    import torch

    import sparkhvd.collective.torch as hvd

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    out = {"flags": (hvd.is_homogeneous(), hvd.gloo_built(), hvd.mpi_built(), hvd.cuda_built(), hvd.nccl_built(),
                     hvd.mpi_enabled(), hvd.gloo_enabled(), hvd.ddl_built(), hvd.ccl_built(), hvd.rocm_built())}
    x = torch.arange(4.0) + r
    h1 = hvd.allreduce_async(x, op=hvd.Sum, name="a")
    h2 = hvd.broadcast_async(torch.tensor([r, r]), root_rank=n - 1, name="b")
    h3 = hvd.allgather_async(torch.full((r + 1,), r))
    y = x.clone()
    h4 = hvd.allreduce_async_(y, name="c")
    try:
        hvd.allreduce_async(x, name="a")
    except ValueError as exc:
        out["dup"] = str(exc)
    out["async"] = (hvd.synchronize(h1), hvd.synchronize(h2), hvd.synchronize(h3), hvd.synchronize(h4), y,
                    hvd.poll(h1), torch.equal(x, torch.arange(4.0) + r))
    try:
        hvd.synchronize("nope")
    except ValueError as exc:
        out["not_handle"] = str(exc)
    g = [torch.tensor([1.0 + r, 2.0]), torch.tensor([10 + r]), torch.ones(2, 2) * r]
    out["grouped"] = hvd.grouped_allreduce(g, op=hvd.Sum)
    gi = [t.clone() for t in g]
    hvd.grouped_allreduce_(gi)
    out["grouped_"] = gi
    out["grouped_async"] = hvd.synchronize(hvd.grouped_allreduce_async(g, op=hvd.Max))
    narrow = [torch.tensor([1 + r, 2], dtype=dtype) for dtype in (torch.int16, torch.int8, torch.uint8)]
    out["grouped_narrow"] = hvd.grouped_allreduce(narrow + [torch.tensor([r == 0, False])], op=hvd.Sum)
    try:
        hvd.grouped_allreduce([torch.ones(1), torch.ones(1, device="meta")])
    except RuntimeError as exc:
        out["grouped_devices"] = str(exc)
    out["minmaxprod"] = [hvd.allreduce(torch.tensor([r + 1.0]), op=op) for op in (hvd.Min, hvd.Max, hvd.Product)]
    out["alltoall_even"] = hvd.alltoall(torch.arange(2 * n) + 100 * r)
    splits = [k + 1 for k in range(n)]  # rank r sends k+1 rows to rank k
    out["alltoall_splits"] = hvd.alltoall(torch.full((sum(splits), 2), r), splits=splits)
    out["alltoall_split_tensor"] = hvd.alltoall(torch.full((sum(splits),), r), splits=torch.tensor(splits))[1]
    rows = 2 * n + 1  # uneven: rank 0 gets the extra row
    out["reducescatter_sum"] = hvd.reducescatter(torch.arange(rows * 2.0).reshape(rows, 2) + r, op=hvd.Sum)
    out["reducescatter_avg"] = hvd.reducescatter(torch.ones(rows) * (r + 1))
    out["grouped_reducescatter"] = hvd.grouped_reducescatter([torch.ones(n) * r, torch.ones(2 * n)], op=hvd.Sum)
    out["objects"] = hvd.allgather_object({"rank": r, "pad": "x" * r})
    out["fp16"] = hvd.allreduce(torch.tensor([1.5, 2.5]) * (r + 1), op=hvd.Sum, compression=hvd.Compression.fp16)
    out["bf16"] = hvd.allreduce(torch.tensor([1.0, 2.0]) * (r + 1), op=hvd.Sum, compression=hvd.Compression.bf16)
    half = {}
    for dtype in (torch.float16, torch.bfloat16):
        try:
            half[str(dtype)] = hvd.allreduce(torch.tensor([1.0, 2.0], dtype=dtype) * (r + 1), op=hvd.Sum)
        except Exception as exc:  # noqa: BLE001 - recorded: which dtypes gloo carries
            half[str(dtype)] = f"{type(exc).__name__}: {exc}"[:200]
    out["half"] = half
    matrix = {}
    for dtype in DTYPES:
        for dims in (1, 2, 3):
            x = (torch.arange(2 ** dims) + 1 + r).to(dtype).reshape([2] * dims)
            matrix[(str(dtype), dims)] = (hvd.allreduce(x, op=hvd.Sum), hvd.allreduce(x),
                                          hvd.broadcast(x, root_rank=n - 1), hvd.allgather(x))
    out["matrix"] = matrix
    errors = {}
    for key, call in {
        "alltoall_indivisible": lambda: hvd.alltoall(torch.arange(2 * n + 1)),
        "alltoall_bad_splits": lambda: hvd.alltoall(torch.arange(4), splits=[1] * (n + 1)),
        "reducescatter_op": lambda: hvd.reducescatter(torch.ones(n), op=hvd.Max),
        "alltoall_scalar": lambda: hvd.alltoall(torch.tensor(1.0)),
    }.items():
        try:
            call()
        except ValueError as exc:
            errors[key] = str(exc)
    out["errors"] = errors
    # gradients
    grads = {}
    for op in (hvd.Sum, hvd.Average):
        x = torch.ones(3, requires_grad=True)
        (hvd.allreduce(x, op=op) * (r + 1)).sum().backward()
        grads[f"allreduce_{op.name}"] = x.grad
    x = torch.ones(r + 1, requires_grad=True)
    coef = torch.arange(n * (n + 1) // 2, dtype=torch.float32) + 10 * r
    (hvd.allgather(x) * coef).sum().backward()
    grads["allgather"] = x.grad
    x = torch.ones(2, requires_grad=True)
    (hvd.broadcast(x, root_rank=0) * (r + 1)).sum().backward()
    grads["broadcast"] = x.grad
    x = torch.ones(sum(splits), requires_grad=True)
    received, _ = hvd.alltoall(x, splits=splits)
    (received * (r + 1)).sum().backward()
    grads["alltoall"] = x.grad
    x = torch.ones(rows, requires_grad=True)
    (hvd.reducescatter(x, op=hvd.Sum) * (r + 1)).sum().backward()
    grads["reducescatter"] = x.grad
    xs = [torch.ones(2, requires_grad=True), torch.ones(1, requires_grad=True)]
    sum((t * (r + 1)).sum() for t in hvd.grouped_allreduce(xs, op=hvd.Sum)).backward()
    grads["grouped"] = [t.grad for t in xs]
    out["grads"] = grads
    return out


def _process_sets():
    import torch

    import sparkhvd.collective.torch as hvd

    evens = hvd.ProcessSet([0, 2])
    hvd.init(process_sets=[evens])
    r = hvd.rank()
    out = {"set": (evens.process_set_id, evens.size(), evens.rank() if evens.included() else None,
                   evens.included()), "global": hvd.global_process_set.ranks}
    if evens.included():
        out["sum"] = hvd.allreduce(torch.tensor([r + 1.0]), op=hvd.Sum, process_set=evens)
        out["bcast"] = hvd.broadcast(torch.tensor([r]), root_rank=2, process_set=evens)  # a job-wide rank
        out["gather"] = hvd.allgather(torch.tensor([r]), process_set=evens)
        out["object"] = hvd.broadcast_object(f"from {r}", root_rank=2, process_set=evens)
        try:
            hvd.broadcast(torch.tensor([r]), root_rank=1, process_set=evens)
        except ValueError as exc:
            out["root_outside"] = str(exc)
    else:
        try:
            hvd.allreduce(torch.ones(1), process_set=evens)
        except ValueError as exc:
            out["outsider"] = str(exc)
        try:
            evens.rank()
        except ValueError as exc:
            out["outsider_rank"] = str(exc)
    out["global_after"] = hvd.allreduce(torch.tensor([1.0]), op=hvd.Sum)
    try:
        hvd.add_process_set([0, 2])
    except ValueError as exc:
        out["dup_set"] = str(exc)
    try:
        hvd.add_process_set([0, 7])
    except ValueError as exc:
        out["bad_set"] = str(exc)
    out["removed"] = (hvd.remove_process_set(evens), hvd.remove_process_set(hvd.global_process_set))
    out["after_remove"] = (evens.size(), evens.rank(), evens.included())
    try:
        hvd.allreduce(torch.ones(1), process_set=evens)
    except ValueError as exc:
        out["removed_use"] = str(exc)
    return out


@pytest.fixture(scope="module", params=[2, 3], ids=["np2", "np3"])
def ranks(request):
    return HorovodRunner(np=-request.param).run_all(_ops).values


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("dims", [1, 2, 3])
def test_every_cpu_dtype_and_rank(ranks, dtype, dims):
    n = len(ranks)
    base = (torch.arange(2 ** dims) + 1).reshape([2] * dims)
    inputs = [(base + r).to(dtype) for r in range(n)]
    total = sum((base + r) for r in range(n)).to(dtype)  # small integers: exact in every dtype
    average = total.floor_divide(n) if not dtype.is_floating_point else total / n
    for v in ranks:
        summed, averaged, bcast, gathered = v["matrix"][(str(dtype), dims)]
        assert summed.dtype == averaged.dtype == bcast.dtype == gathered.dtype == dtype
        assert torch.equal(summed, total)
        assert torch.equal(averaged, average)
        assert torch.equal(bcast, inputs[-1])
        assert torch.equal(gathered, torch.cat(inputs))


def test_topology_flags(ranks):
    mpi_built = importlib.util.find_spec("mpi4py") is not None  # the test extra installs it; MPI is not enabled
    assert all(v["flags"] == (True, True, mpi_built, False, 0, False, True, False, False, False)
               for v in ranks)  # CPU build of torch


def test_async_handles(ranks):
    n = len(ranks)
    for r, v in enumerate(ranks):
        summed, bcast, gathered, averaged, inplace, polled, untouched = v["async"]
        base = torch.arange(4.0)
        assert torch.equal(summed, n * base + sum(range(n)))
        assert torch.equal(bcast, torch.tensor([n - 1, n - 1]))
        assert torch.equal(gathered, torch.cat([torch.full((k + 1,), k) for k in range(n)]))
        assert torch.equal(averaged, base + sum(range(n)) / n) and averaged is inplace
        assert polled is True and untouched is True
        assert "another allreduce named 'a' is already in flight on this rank" in v["dup"]
        assert v["not_handle"] == "synchronize takes a handle returned by an *_async function, got str."


def test_grouped_allreduce_variants(ranks):
    n = len(ranks)
    s = sum(range(n))
    for v in ranks:
        a, b, c = v["grouped"]
        assert torch.equal(a, torch.tensor([n + s, 2.0 * n])) and torch.equal(b, torch.tensor([10 * n + s]))
        assert torch.equal(c, torch.ones(2, 2) * s)
        a, b, c = v["grouped_"]
        assert torch.equal(a, torch.tensor([(n + s) / n, 2.0])) and torch.equal(b, torch.tensor([(10 * n + s) // n]))
        assert torch.equal(v["grouped_async"][2], torch.ones(2, 2) * (n - 1))
        narrow = [torch.tensor([n + s, 2 * n], dtype=dtype) for dtype in (torch.int16, torch.int8, torch.uint8)]
        assert all(torch.equal(a, b) for a, b in zip(v["grouped_narrow"], narrow + [torch.tensor([True, False])]))
        assert v["grouped_devices"] == ("grouped_allreduce takes tensors on one device, got tensors on cpu, meta; "
                                        "move them to one device, or reduce each device's tensors in a group of "
                                        "their own.")
        mn, mx, prod = v["minmaxprod"]
        assert (mn.item(), mx.item(), prod.item()) == (1.0, float(n), float(torch.arange(1, n + 1).prod()))


def test_alltoall(ranks):
    n = len(ranks)
    for r, v in enumerate(ranks):
        out = v["alltoall_even"]  # without splits, Horovod returns the tensor alone
        assert torch.equal(out, torch.tensor([100 * k + 2 * r + j for k in range(n) for j in range(2)]))
        out, received = v["alltoall_splits"]
        assert torch.equal(received, torch.full((n,), r + 1, dtype=torch.int32))
        assert torch.equal(out, torch.cat([torch.full((r + 1, 2), k) for k in range(n)]))
        assert torch.equal(v["alltoall_split_tensor"], torch.full((n,), r + 1))  # the splits' own dtype, as Horovod


def test_reducescatter(ranks):
    n = len(ranks)
    rows = 2 * n + 1
    full = n * torch.arange(rows * 2.0).reshape(rows, 2) + sum(range(n))
    start = 0
    for r, v in enumerate(ranks):
        mine = 3 if r == 0 else 2  # rank 0 takes the extra row
        assert torch.equal(v["reducescatter_sum"], full[start:start + mine])
        assert torch.equal(v["reducescatter_avg"], torch.ones(mine) * (n + 1) / 2)
        a, b = v["grouped_reducescatter"]
        assert torch.equal(a, torch.ones(1) * sum(range(n))) and torch.equal(b, torch.ones(2) * n)
        start += mine


def test_allgather_object_and_compression(ranks):
    n = len(ranks)
    t = n * (n + 1) // 2
    for v in ranks:
        assert v["objects"] == [{"rank": k, "pad": "x" * k} for k in range(n)]
        assert v["fp16"].dtype == torch.float32 and torch.equal(v["fp16"], torch.tensor([1.5, 2.5]) * t)
        assert v["bf16"].dtype == torch.float32 and torch.equal(v["bf16"], torch.tensor([1.0, 2.0]) * t)


def test_half_precision_dtypes_on_gloo(ranks):
    n = len(ranks)
    t = n * (n + 1) // 2
    for dtype in (torch.float16, torch.bfloat16):
        got = ranks[0]["half"][str(dtype)]
        assert isinstance(got, torch.Tensor), f"gloo could not reduce {dtype}: {got}"
        assert got.dtype == dtype and torch.equal(got, torch.tensor([1.0, 2.0], dtype=dtype) * t)


def test_error_messages(ranks):
    n = len(ranks)
    e = ranks[0]["errors"]
    assert e["alltoall_indivisible"] == (f"alltoall without splits needs the first dimension ({2 * n + 1}) to be "
                                         f"divisible by the number of ranks ({n}); pass splits= to send uneven parts.")
    assert e["alltoall_bad_splits"].startswith(f"alltoall splits {[1] * (n + 1)} must be {n} non-negative counts")
    assert e["reducescatter_op"] == "reducescatter supports op=hvd.Average or hvd.Sum, got Max."
    assert e["alltoall_scalar"] == "alltoall needs a tensor with at least one dimension; got a scalar."


def test_gradients_match_analytic_values_in_horovods_convention(ranks):
    """Rank k's loss is weighted by k + 1 (or by 10k in allgather's). Horovod 0.28's gradients, kept on
    purpose: broadcast's and allgather's average the ranks' gradients (1/n of the derivative of the
    summed losses), reducescatter's is the allgather of the gradient times n for Sum."""
    n = len(ranks)
    t = n * (n + 1) // 2  # sum over ranks of (rank + 1)
    for r, v in enumerate(ranks):
        g = v["grads"]
        assert torch.equal(g["allreduce_Sum"], torch.full((3,), float(t)))
        assert torch.equal(g["allreduce_Average"], torch.full((3,), t / n))
        offset = r * (r + 1) // 2  # rows before this rank's in the gathered tensor
        summed = sum(torch.arange(offset, offset + r + 1, dtype=torch.float32) + 10 * k for k in range(n))
        assert torch.equal(g["allgather"], summed / n)
        assert torch.equal(g["broadcast"], torch.full((2,), t / n if r == 0 else 0.0))
        assert torch.equal(g["alltoall"], torch.cat([torch.full((k + 1,), k + 1.0) for k in range(n)]))
        counts = [3 if k == 0 else 2 for k in range(n)]
        owner = torch.cat([torch.full((c,), k + 1.0) for k, c in enumerate(counts)])
        assert torch.equal(g["reducescatter"], owner * n)
        assert all(torch.equal(x, torch.full_like(x, float(t))) for x in g["grouped"])


def test_process_sets_at_np3():
    values = HorovodRunner(np=-3).run_all(_process_sets).values
    assert [v["set"] for v in values] == [(1, 2, 0, True), (1, 2, None, False), (1, 2, 1, True)]
    assert all(v["global"] == [0, 1, 2] for v in values)
    for r in (0, 2):
        v = values[r]
        assert torch.equal(v["sum"], torch.tensor([4.0]))
        assert torch.equal(v["bcast"], torch.tensor([2]))
        assert torch.equal(v["gather"], torch.tensor([0, 2]))
        assert v["object"] == "from 2"
        assert v["root_outside"] == ("root_rank=1 is not a member of process set [0, 2]; root_rank is a "
                                     "job-wide rank (hvd.rank()), also within a process set, as in Horovod.")
    assert "rank 1 is not in process set [0, 2]; call a process set's collectives only on its members" in \
        values[1]["outsider"]
    assert values[1]["outsider_rank"] == ("rank 1 is not a member of process set [0, 2], so it has no rank in "
                                          "it; check process_set.included() first.")
    assert all(torch.equal(v["global_after"], torch.tensor([3.0])) for v in values)
    assert values[0]["dup_set"] == "a process set with ranks [0, 2] already exists (id 1)."
    assert values[0]["bad_set"] == "process set ranks [0, 7] must be a non-empty list of ranks in 0..2."
    assert all(v["removed"] == (True, False) for v in values)
    assert [v["after_remove"] for v in values] == [(None, None, True), (None, None, False), (None, None, True)]
    assert "has not been added; call hvd.add_process_set() on every rank first" in values[0]["removed_use"]


def _disagreements():
    import torch

    import sparkhvd.collective.torch as hvd

    hvd.init()
    r = hvd.rank()
    cases = {
        "shape": lambda: hvd.allreduce(torch.ones(4 + r)),
        "dtype": lambda: hvd.allreduce(torch.ones(4, dtype=torch.float32 if r == 0 else torch.float64)),
        "op": lambda: hvd.allreduce(torch.ones(4), op=hvd.Sum if r == 0 else hvd.Max),
        "broadcast_shape": lambda: hvd.broadcast(torch.ones(4 + r), root_rank=0),
        "broadcast_root": lambda: hvd.broadcast(torch.ones(4), root_rank=r),
        "grouped": lambda: hvd.grouped_allreduce([torch.ones(2)] * (1 + r)),
        "allgather_dtype": lambda: hvd.allgather(torch.ones(r + 1, dtype=torch.int32 if r else torch.int64)),
        "reducescatter": lambda: hvd.reducescatter(torch.ones(4 + r)),
        "alltoall": lambda: hvd.alltoall(torch.ones(2, 1 + r)),
    }
    out = {}
    for key, call in cases.items():
        try:
            call()
            out[key] = "no error"
        except (ValueError, RuntimeError) as exc:  # RuntimeError: hvd.HorovodInternalError, as Horovod's
            out[key] = f"{type(exc).__name__}: {exc}"
    out["still_works"] = hvd.allreduce(torch.tensor([1.0]), op=hvd.Sum).item()
    return out


def test_ranks_that_disagree_get_the_same_clear_error():
    v0, v1 = HorovodRunner(np=-2).run_all(_disagreements).values
    assert v0 == v1  # every rank raises the same error
    rule = ("Every rank must call the ops of a name (unnamed ops are matched in the order each rank calls them) with "
            "the same dtype, device and shape")
    assert v0["shape"] == (f"HorovodInternalError: ranks disagree on the 1st unnamed allreduce: rank 0: "
                           f"allreduce(op=Average: float32[4] on cpu); rank 1: allreduce(op=Average: float32[5] on "
                           f"cpu). {rule} (and the same op and root_rank).")
    assert "rank 0: allreduce(op=Average: float32[4] on cpu); rank 1: allreduce(op=Average: float64[4] on cpu)" in v0["dtype"]
    assert "rank 0: allreduce(op=Sum: float32[4] on cpu); rank 1: allreduce(op=Max: float32[4] on cpu)" in v0["op"]
    assert "rank 0: broadcast(root_rank=0: float32[4] on cpu); rank 1: broadcast(root_rank=0: float32[5] on cpu)" in \
        v0["broadcast_shape"]
    assert "rank 0: broadcast(root_rank=0: float32[4] on cpu); rank 1: broadcast(root_rank=1: float32[4] on cpu)" in \
        v0["broadcast_root"]
    assert "rank 1: grouped_allreduce(op=Average: float32[2] on cpu, float32[2] on cpu)" in v0["grouped"]
    assert "rank 0: allgather(int64[*] on cpu); rank 1: allgather(int32[*] on cpu)" in v0["allgather_dtype"]
    assert "rank 0: reducescatter(op=Average: float32[4] on cpu)" in v0["reducescatter"]
    assert "rank 0: alltoall(float32[*, 1] on cpu); rank 1: alltoall(float32[*, 2] on cpu)" in v0["alltoall"]
    assert v0["still_works"] == 2.0


def test_timeline_is_horovods_format_with_each_ops_negotiation_and_bytes(tmp_path):
    def train(folder):
        import json

        import torch

        import sparkhvd.collective.torch as hvd

        hvd.init()
        hvd.start_timeline(f"{folder}/trace.json", mark_cycles=True)  # rank 1 writes trace.rank1.json
        path = f"{folder}/trace.json" if hvd.rank() == 0 else f"{folder}/trace.rank1.json"
        hvd.allreduce(torch.ones(256), name="grads")
        hvd.synchronize(hvd.broadcast_async(torch.ones(8, dtype=torch.float64), root_rank=0))
        hvd.barrier()
        hvd.stop_timeline()
        hvd.barrier()  # in a set of two, rank 0's next small reduction reaches rank 1 at once: after it stopped
        hvd.allreduce(torch.ones(4))  # after stop: not recorded
        error = None
        try:
            hvd.start_timeline(f"{folder}/missing/trace.json")
        except ValueError as exc:
            error = str(exc)
        with open(path) as f:
            return json.load(f), error

    for events, error in HorovodRunner(np=-2).run_all(train, folder=str(tmp_path)).values:
        assert "start_time_since_epoch_in_micros" in events[0]["args"]
        names = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name" and e["pid"]}
        assert sorted(names.values()) == ["allreduce.grads", "barrier.noname.0", "broadcast.noname.0"]
        spans = [(names[e["pid"]], e["ph"], e.get("name"), e.get("args", {}).get("bytes"))
                 for e in events if e["ph"] in "BE"]
        assert spans == [
            ("allreduce.grads", "B", "NEGOTIATE_ALLREDUCE", None), ("allreduce.grads", "E", None, None),
            ("allreduce.grads", "B", "ALLREDUCE", None), ("allreduce.grads", "E", None, 1024),
            ("broadcast.noname.0", "B", "NEGOTIATE_BROADCAST", None), ("broadcast.noname.0", "E", None, None),
            ("broadcast.noname.0", "B", "BROADCAST", None), ("broadcast.noname.0", "E", None, 64),
            ("barrier.noname.0", "B", "NEGOTIATE_BARRIER", None), ("barrier.noname.0", "E", None, None),
            ("barrier.noname.0", "B", "BARRIER", None), ("barrier.noname.0", "E", None, 0)]
        times = [e["ts"] for e in events if e["ph"] in "BE"]
        assert times == sorted(times) and times[0] >= 0
        assert sum(e.get("name") == "CYCLE_START" for e in events) == 3  # one batch of answers per op here
        assert error == f"start_timeline: the folder {tmp_path}/missing does not exist; create it or pick another path."


def _one_rank_wrong():
    import torch

    import sparkhvd.collective.torch as hvd

    hvd.init()
    r = hvd.rank()
    out = {}
    for key, call in {
        # only rank 0 has a first dimension the ranks cannot divide
        "alltoall": lambda: hvd.alltoall(torch.ones(6 if r else 5)),
        "root": lambda: hvd.broadcast(torch.ones(2), root_rank=0 if r else 9),
        # every rank has "n" in flight; rank 0 reuses the name (an error there only, as in Horovod) while the
        # others start "m", which no one else submits: it waits, and holds up nothing else
        "name": lambda: hvd.allreduce_async(torch.ones(1), name="n" if r == 0 else "m"),
    }.items():
        if key == "name":
            first = hvd.allreduce_async(torch.ones(1), name="n")
        try:
            call()
            out[key] = "no error"
        except ValueError as exc:
            out[key] = str(exc)
    out["first"] = hvd.synchronize(first).item()
    out["after"] = hvd.allreduce(torch.ones(1), op=hvd.Sum).item()  # the ranks are still in step
    pair = hvd.add_process_set([1, 2])
    if r in (1, 2):
        hvd.allreduce(torch.ones(1), process_set=pair)
    out["last"] = hvd.join()  # process-set exchanges do not confuse join's bookkeeping
    bn = hvd.SyncBatchNorm(1, affine=False, track_running_stats=False).eval()
    out["bn_eval"] = bn(torch.tensor([[float(r)]]))  # no running stats: batch stats over all ranks
    model = torch.nn.Linear(1, 1)
    dup = torch.optim.SGD([model.weight, model.weight, model.bias], lr=0.1)
    opt = hvd.DistributedOptimizer(dup)
    for _ in range(2):
        opt.zero_grad()
        model(torch.ones(1, 1)).sum().backward()
        opt.step()
    out["dup_param"] = len(opt._hvd_buckets._where)
    return out


def test_a_problem_on_one_rank_fails_every_rank_without_a_hang():
    v = HorovodRunner(np=-3).run_all(_one_rank_wrong).values
    assert v[0]["alltoall"] == v[1]["alltoall"] == v[2]["alltoall"] == (
        "rank 0: alltoall without splits needs the first dimension (5) to be divisible by the number of ranks (3); "
        "pass splits= to send uneven parts.")
    assert v[1]["root"] == "rank 0: root_rank=9 is outside the ranks 0..2 of this job."
    assert v[0]["name"].startswith("another allreduce named 'n' is already in flight on this rank")
    assert v[1]["name"] == v[2]["name"] == "no error"
    assert [x["after"] for x in v] == [3.0, 3.0, 3.0] and [x["first"] for x in v] == [1.0, 1.0, 1.0]
    assert [x["last"] for x in v] == [2, 2, 2]
    expected = (torch.tensor([0.0, 1.0, 2.0]) - 1.0) / torch.sqrt(torch.tensor(2 / 3 + 1e-5))
    torch.testing.assert_close(torch.cat([x["bn_eval"] for x in v]).flatten(), expected)
    assert v[0]["dup_param"] == 2


def _inline_and_wire(numels):
    import torch

    import sparkhvd.collective.torch as hvd
    from sparkhvd.collective._core._inline import capacity as inline_capacity

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    out = {"capacity": inline_capacity(n)}
    for numel in numels:  # one that rides in the control exchange, one that does not
        base = torch.arange(numel, dtype=torch.float64) % 7 + r
        t = base.clone()
        hvd.allreduce_(t, op=hvd.Sum, prescale_factor=2.0)
        plain = base.clone()
        hvd.allreduce_(plain, op=hvd.Sum)  # reduced into the input itself, which is also this rank's payload
        strided = torch.stack([base, base], 1)[:, 0]
        hvd.allreduce_(strided, op=hvd.Max)
        strided_bcast = torch.stack([base, base], 1)[:, 1]
        hvd.broadcast_(strided_bcast, root_rank=n - 1)
        out[numel] = {
            "sum_": t, "plain_": plain, "strided_": strided, "strided_bcast": strided_bcast,
            "avg": hvd.allreduce(base), "min": hvd.allreduce(base, op=hvd.Min),
            "max": hvd.allreduce(base.float(), op=hvd.Max), "prod": hvd.allreduce(base.int() + 1, op=hvd.Product),
            "post": hvd.allreduce(base, op=hvd.Sum, postscale_factor=0.5),
            "grouped": hvd.grouped_allreduce([base, base.float(), base.long()], op=hvd.Average),
            "async": hvd.synchronize(hvd.allreduce_async(base.half(), op=hvd.Sum)),
        }
    return out


@pytest.mark.parametrize("np_", [2, 3])
def test_reductions_inside_and_beyond_the_control_frame(np_):
    numels = [1000, 200_000]  # 8 KB and 1.6 MB of float64: under and over every set's frame
    values = HorovodRunner(np=-np_).run_all(_inline_and_wire, numels=numels).values
    assert 1000 * 8 <= values[0]["capacity"] < 200_000 * 8
    for numel in numels:
        per_rank = [torch.arange(numel, dtype=torch.float64) % 7 + r for r in range(np_)]
        total = sum(per_rank)
        for v in values:
            got = v[numel]
            assert torch.equal(got["sum_"], total * 2)
            assert torch.equal(got["plain_"], total) and torch.equal(got["strided_"], per_rank[-1])
            assert torch.equal(got["strided_bcast"], per_rank[-1])
            assert torch.equal(got["avg"], total / np_)
            assert torch.equal(got["min"], per_rank[0]) and torch.equal(got["max"], per_rank[-1].float())
            assert torch.equal(got["prod"], torch.stack([p.int() + 1 for p in per_rank]).prod(0).int())
            assert torch.equal(got["post"], total * 0.5)
            assert [g.dtype for g in got["grouped"]] == [torch.float64, torch.float32, torch.int64]
            assert torch.equal(got["grouped"][0], total / np_)
            assert torch.equal(got["grouped"][1], (total / np_).float())
            assert torch.equal(got["grouped"][2], total.long() // np_)
            assert torch.equal(got["async"], total.half())


def _review_cases():
    import torch

    import sparkhvd.collective.torch as hvd

    hvd.init()
    r = hvd.rank()
    out = {}
    pair = hvd.add_process_set([1, 2])
    model = torch.nn.Linear(2, 1, bias=False)
    torch.nn.init.zeros_(model.weight)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0), process_set=pair)
    model(torch.full((1, 2), r + 1.0)).sum().backward()  # gradient: r + 1 in both columns
    opt.step()  # ranks 1 and 2 average theirs; rank 0, outside the set, trains alone (as in Horovod)
    out["outsider"] = model.weight.detach()
    t = torch.ones(3 + r)  # the ranks disagree: the op fails, and the tensor must stay as it was
    try:
        hvd.grouped_allreduce_([t], op=hvd.Sum, prescale_factor=2.0)
    except RuntimeError:  # hvd.HorovodInternalError
        pass
    out["untouched"] = t
    for numel in (4, 100_000):  # inside and beyond the control frame; truncated toward zero, as Horovod
        out[f"int_prescale_{numel}"] = hvd.allreduce_(torch.full((numel,), 3, dtype=torch.int64), op=hvd.Sum,
                                                      prescale_factor=0.5)  # 1 each
        out[f"int_average_{numel}"] = hvd.allreduce(torch.full((numel,), -2 if r == 0 else 0), postscale_factor=3)
        out[f"int_postscale_{numel}"] = hvd.allreduce(torch.full((numel,), 1 - 2 * r), op=hvd.Sum,
                                                      postscale_factor=0.5)
    x = torch.ones(2 * hvd.size() + 1, requires_grad=True)
    (hvd.reducescatter(x, op=hvd.Sum, prescale_factor=3.0, postscale_factor=0.5) * (r + 1)).sum().backward()
    out["rs_grad"] = x.grad
    return out


def test_outsiders_untouched_inputs_integer_scaling_and_scaled_gradients():
    values = HorovodRunner(np=-3).run_all(_review_cases).values
    assert torch.equal(values[0]["outsider"], torch.full((1, 2), -1.0))  # its own gradient, 1
    assert torch.equal(values[1]["outsider"], torch.full((1, 2), -2.5))  # the average of 2 and 3
    assert torch.equal(values[2]["outsider"], torch.full((1, 2), -2.5))
    for r, v in enumerate(values):
        assert torch.equal(v["untouched"], torch.ones(3 + r))
        for numel in (4, 100_000):
            assert torch.equal(v[f"int_prescale_{numel}"], torch.full((numel,), 3))  # 1 + 1 + 1
            assert torch.equal(v[f"int_average_{numel}"], torch.full((numel,), -2))  # trunc(-2 * 3 / 3)
            assert torch.equal(v[f"int_postscale_{numel}"], torch.full((numel,), -1))  # trunc(-3 / 2), not floor
        # 7 rows over 3 ranks: 3, 2, 2; each row's gradient is its owner's weight times the scales, times
        # the set's size for Sum (Horovod's convention)
        owner_weight = torch.tensor([1.0] * 3 + [2.0] * 2 + [3.0] * 2)
        assert torch.equal(v["rs_grad"], owner_weight * 1.5 * 3)


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


def _horovod_signatures():
    import torch

    import sparkhvd.collective.torch as hvd

    out = {}
    for key, call in {
        "bad_sets": lambda: hvd.init(process_sets="static"),
        "subset_comm": lambda: hvd.init(comm=[0]),
    }.items():
        try:
            call()
        except ValueError as exc:
            out[key] = str(exc)
    hvd.init(comm=[1, 0], process_sets="dynamic")  # Horovod's forms: every rank, sets added later
    r = hvd.rank()
    try:
        hvd.mpi_threads_supported()
    except ValueError as exc:
        out["mpi_threads"] = str(exc)
    out["internal_error"] = issubclass(hvd.HorovodInternalError, RuntimeError)
    # a name may be in flight once per kind of op, as Horovod prefixes names with the op
    h1 = hvd.allreduce_async(torch.tensor([1.0 + r]), name="x", op=hvd.Sum)
    h2 = hvd.broadcast_async(torch.tensor([r]), root_rank=1, name="x")
    out["same_name"] = (hvd.synchronize(h1), hvd.synchronize(h2))
    gathered = hvd.grouped_allgather_async([torch.tensor([r]), torch.tensor([[r, r]])], name="g")
    scattered = hvd.grouped_reducescatter_async([torch.arange(4.0) * (r + 1)], op=hvd.Sum)
    sparse = hvd.sparse_allreduce_async(torch.sparse_coo_tensor([[r]], [1.0 + r], (3,)), name="s", op=hvd.Sum)
    out["sparse"] = sparse().to_dense()  # Horovod returns a function to call
    try:
        hvd.sparse_allreduce_async(torch.ones(2))
    except ValueError as exc:
        out["sparse_dense"] = str(exc)
    for n in (4, 1_100_000):  # gloo has no 16-bit integers: reduced through int32
        out[f"int16_{n}"] = hvd.allreduce(torch.full((n,), 3 + r, dtype=torch.int16), op=hvd.Sum)
    out["average_0"] = hvd.allreduce(torch.tensor([1.0]), average=0)  # falsy: Sum, as Horovod
    big = torch.tensor([60000.0], dtype=torch.float16)  # out of place is the same op: sum, then divide
    out["fp16_average"] = (hvd.allreduce(big), hvd.allreduce_(big.clone()))
    out["grouped"] = (hvd.synchronize(gathered), hvd.synchronize(scattered),
                      hvd.grouped_allreduce([torch.ones(1)]), hvd.grouped_allreduce_([torch.ones(1)]))
    model = torch.nn.Linear(2, 1)
    torch.nn.init.constant_(model.weight, float(r))
    hvd.broadcast_parameters(list(model.parameters()), root_rank=1)  # bare tensors, as Horovod allows
    out["params"] = model.weight.detach().clone()
    opt = torch.optim.SGD(model.parameters(), lr=0.1 * (r + 1))
    hvd.broadcast_optimizer_state(opt, 1, model=model)  # Horovod's third argument
    out["lr"] = opt.param_groups[0]["lr"]
    try:
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), backward_passes_per_step=0)
    except ValueError as exc:
        out["passes_0"] = str(exc)
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    opt.set_backward_passes_per_step(2)
    for _ in range(2):
        model(torch.ones(1, 2)).sum().backward()
    try:
        opt.set_backward_passes_per_step(1)
    except RuntimeError as exc:
        out["passes_in_flight"] = str(exc)
    opt.step()
    out["passes"] = (opt.backward_passes_per_step, model.bias.grad.clone())
    return out


def test_horovod_call_forms_and_flags():
    values = HorovodRunner(np=-2).run_all(_horovod_signatures).values
    for r, v in enumerate(values):
        assert v["bad_sets"] == "init(process_sets='static'): pass a list of ProcessSets or \"dynamic\"."
        assert v["subset_comm"] == ("init(comm=[0]): sparkhvd always runs on every rank of the job ([0, 1]); pass "
                                    "comm=None, and put a subset of ranks in a process set (hvd.add_process_set).")
        assert v["mpi_threads"].startswith("MPI is not enabled: this process did not join its job through MPI")
        assert v["internal_error"] is True
        assert torch.equal(v["same_name"][0], torch.tensor([3.0])) and torch.equal(v["same_name"][1], torch.tensor([1]))
        assert torch.equal(v["sparse"], torch.tensor([1.0, 2.0, 0.0]))
        assert v["sparse_dense"] == ("sparse_allreduce_async takes a sparse COO tensor, got torch.strided; use "
                                     "allreduce_async for dense ones.")
        for n in (4, 1_100_000):
            assert torch.equal(v[f"int16_{n}"], torch.full((n,), 7, dtype=torch.int16))
        assert torch.equal(v["average_0"], torch.tensor([2.0]))
        assert all(torch.isinf(t).all() for t in v["fp16_average"])  # 120000 overflows fp16 before the division
        gathered, scattered, grouped, grouped_ = v["grouped"]
        assert isinstance(gathered, tuple) and isinstance(grouped, tuple) and isinstance(grouped_, tuple)
        assert torch.equal(gathered[0], torch.tensor([0, 1]))
        assert torch.equal(gathered[1], torch.tensor([[0, 0], [1, 1]]))
        assert torch.equal(scattered[0], (torch.arange(4.0) * 3)[2 * r:2 * r + 2])
        assert torch.equal(v["params"], torch.ones(1, 2))
        assert v["lr"] == pytest.approx(0.2)
        assert v["passes_0"] == "backward_passes_per_step must be a whole number of 1 or more, got 0."
        assert v["passes_in_flight"] == ("set_backward_passes_per_step() was called while gradients were being "
                                         "reduced; call it right after optimizer.step().")
        assert v["passes"][0] == 2 and torch.equal(v["passes"][1], torch.tensor([2.0]))  # two passes, summed


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


def _one_rank_differs():
    import numpy as np
    import torch

    import sparkhvd.collective.torch as hvd

    hvd.init()
    r = hvd.rank()
    out = {}
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
    out["b"] = b.weight.detach().clone()
    for key, call in {  # a wrong argument on rank 1 only: every rank raises it
        "sparse": lambda: hvd.sparse_allreduce_async(
            torch.ones(3) if r == 1 else torch.sparse_coo_tensor([[r]], [1.0], (3,)))(),
        "reducescatter": lambda: hvd.reducescatter(torch.tensor(1.0) if r == 1 else torch.ones(3)),
        "alltoall": lambda: hvd.alltoall(torch.tensor(1.0) if r == 1 else torch.ones(3)),
    }.items():
        try:
            call()
        except ValueError as exc:
            out[key] = str(exc)
    hvd.allreduce_async(torch.ones(1), name="left")  # never synchronized
    hvd.shutdown()
    hvd.init()
    out["after_reinit"] = hvd.synchronize(hvd.allreduce_async(torch.ones(1), name="left", op=hvd.Sum))
    return out


def test_optimizers_and_argument_errors_when_one_rank_differs():
    values = HorovodRunner(np=-3).run_all(_one_rank_differs).values
    for v in values:
        assert torch.equal(v["b"], values[0]["b"])  # the global optimizer's buckets paired up
        assert v["sparse"] == ("rank 1: sparse_allreduce_async takes a sparse COO tensor, got torch.strided; use "
                               "allreduce_async for dense ones.")
        assert v["reducescatter"] == "rank 1: reducescatter needs a tensor with at least one dimension; got a scalar."
        assert v["alltoall"] == "rank 1: alltoall needs a tensor with at least one dimension; got a scalar."
        assert torch.equal(v["after_reinit"], torch.tensor([3.0]))
