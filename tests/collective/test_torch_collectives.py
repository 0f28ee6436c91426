"""Each torch collective's exact values, call forms (async, in place, grouped) and argument errors, in real rank
processes: one run per job size, one case per op (tests/_cases.py), one test per case. Inputs are built
from the rank; expected values are exact."""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch
from _cases import add_to, message_of, named, run_cases, values

from sparkhvd import HorovodRunner

DTYPES = (torch.int32, torch.int64, torch.float16, torch.bfloat16, torch.float32, torch.float64)
KINDS = ("sum", "average", "broadcast", "allgather")
FRAME_NUMELS = (1000, 200_000)  # 8 KB and 1.6 MB of float64: under and over every set's control frame
INT_NUMELS = (4, 100_000)  # inside and beyond the control frame


def _name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _counts(n: int) -> list:
    """Rows per rank when 2n + 1 rows are scattered: rank 0 takes the extra one."""
    return [3 if k == 0 else 2 for k in range(n)]


# ---- the cases, at np=2 and np=3 ------------------------------------------------------------------------------

OPS: dict = {}
op = add_to(OPS)


@op
def build_flags(hvd, r, n):
    return (hvd.is_homogeneous(), hvd.gloo_built(), hvd.mpi_built(), hvd.cuda_built(), hvd.nccl_built(),
            hvd.mpi_enabled(), hvd.gloo_enabled(), hvd.ddl_built(), hvd.ccl_built(), hvd.rocm_built())


@op
def async_ops_in_flight_together(hvd, r, n):
    """Four handles in flight at once, and an op under a name already in flight."""
    x = torch.arange(4.0) + r
    h1 = hvd.allreduce_async(x, op=hvd.Sum, name="a")
    h2 = hvd.broadcast_async(torch.tensor([r, r]), root_rank=n - 1, name="b")
    h3 = hvd.allgather_async(torch.full((r + 1,), r))
    y = x.clone()
    h4 = hvd.allreduce_async_(y, name="c")
    out = {"duplicate_name": message_of(lambda: hvd.allreduce_async(x, name="a"), ValueError)}
    out["allreduce"], out["broadcast"], out["allgather"] = hvd.synchronize(h1), hvd.synchronize(h2), hvd.synchronize(h3)
    averaged = hvd.synchronize(h4)
    out["allreduce_"] = (averaged, averaged is y)
    out["polled"], out["input_kept"] = hvd.poll(h1), torch.equal(x, torch.arange(4.0) + r)
    return out


@op
def synchronize_not_a_handle(hvd, r, n):
    return message_of(lambda: hvd.synchronize("nope"), ValueError)


def _grouped_inputs(r):
    return [torch.tensor([1.0 + r, 2.0]), torch.tensor([10 + r]), torch.ones(2, 2) * r]


@op
def grouped_allreduce_sum(hvd, r, n):
    return hvd.grouped_allreduce(_grouped_inputs(r), op=hvd.Sum)


@op
def grouped_allreduce_in_place(hvd, r, n):
    tensors = _grouped_inputs(r)
    hvd.grouped_allreduce_(tensors)
    return tensors


@op
def grouped_allreduce_async_max(hvd, r, n):
    return hvd.synchronize(hvd.grouped_allreduce_async(_grouped_inputs(r), op=hvd.Max))


@op
def grouped_allreduce_narrow_ints_and_bools(hvd, r, n):
    narrow = [torch.tensor([1 + r, 2], dtype=dtype) for dtype in (torch.int16, torch.int8, torch.uint8)]
    return hvd.grouped_allreduce(narrow + [torch.tensor([r == 0, False])], op=hvd.Sum)


@op
def grouped_allreduce_across_devices(hvd, r, n):
    return message_of(lambda: hvd.grouped_allreduce([torch.ones(1), torch.ones(1, device="meta")]), RuntimeError)


@op
def allreduce_min(hvd, r, n):
    return hvd.allreduce(torch.tensor([r + 1.0]), op=hvd.Min)


@op
def allreduce_max(hvd, r, n):
    return hvd.allreduce(torch.tensor([r + 1.0]), op=hvd.Max)


@op
def allreduce_product(hvd, r, n):
    return hvd.allreduce(torch.tensor([r + 1.0]), op=hvd.Product)


@op
def alltoall_even(hvd, r, n):
    return hvd.alltoall(torch.arange(2 * n) + 100 * r)


@op
def alltoall_splits(hvd, r, n):
    splits = [k + 1 for k in range(n)]  # rank r sends k+1 rows to rank k
    return hvd.alltoall(torch.full((sum(splits), 2), r), splits=splits)


@op
def alltoall_split_tensor(hvd, r, n):
    splits = [k + 1 for k in range(n)]
    return hvd.alltoall(torch.full((sum(splits),), r), splits=torch.tensor(splits))[1]


@op
def reducescatter_sum(hvd, r, n):
    rows = 2 * n + 1  # uneven: rank 0 gets the extra row
    return hvd.reducescatter(torch.arange(rows * 2.0).reshape(rows, 2) + r, op=hvd.Sum)


@op
def reducescatter_average(hvd, r, n):
    return hvd.reducescatter(torch.ones(2 * n + 1) * (r + 1))


@op
def grouped_reducescatter(hvd, r, n):
    return hvd.grouped_reducescatter([torch.ones(n) * r, torch.ones(2 * n)], op=hvd.Sum)


@op
def allgather_object(hvd, r, n):
    return hvd.allgather_object({"rank": r, "pad": "x" * r})


@op
def compression_fp16(hvd, r, n):
    return hvd.allreduce(torch.tensor([1.5, 2.5]) * (r + 1), op=hvd.Sum, compression=hvd.Compression.fp16)


@op
def compression_bf16(hvd, r, n):
    return hvd.allreduce(torch.tensor([1.0, 2.0]) * (r + 1), op=hvd.Sum, compression=hvd.Compression.bf16)


@op
def allreduce_float16(hvd, r, n):
    return hvd.allreduce(torch.tensor([1.0, 2.0], dtype=torch.float16) * (r + 1), op=hvd.Sum)


@op
def allreduce_bfloat16(hvd, r, n):
    return hvd.allreduce(torch.tensor([1.0, 2.0], dtype=torch.bfloat16) * (r + 1), op=hvd.Sum)


def _on_every_shape(kind, dtype):
    """A case: one op on a tensor of ``dtype`` of 1, 2 and 3 dimensions."""
    def case(hvd, r, n):
        out = {}
        for dims in (1, 2, 3):
            x = (torch.arange(2 ** dims) + 1 + r).to(dtype).reshape([2] * dims)
            out[dims] = {"sum": lambda: hvd.allreduce(x, op=hvd.Sum), "average": lambda: hvd.allreduce(x),
                         "broadcast": lambda: hvd.broadcast(x, root_rank=n - 1),
                         "allgather": lambda: hvd.allgather(x)}[kind]()
        return out
    return case


for _dtype in DTYPES:
    for _kind in KINDS:
        OPS[f"{_kind}_{_name(_dtype)}"] = _on_every_shape(_kind, _dtype)


@op
def alltoall_indivisible(hvd, r, n):
    return message_of(lambda: hvd.alltoall(torch.arange(2 * n + 1)), ValueError)


@op
def alltoall_bad_splits(hvd, r, n):
    return message_of(lambda: hvd.alltoall(torch.arange(4), splits=[1] * (n + 1)), ValueError)


@op
def reducescatter_max(hvd, r, n):
    return message_of(lambda: hvd.reducescatter(torch.ones(n), op=hvd.Max), ValueError)


@op
def alltoall_scalar(hvd, r, n):
    return message_of(lambda: hvd.alltoall(torch.tensor(1.0)), ValueError)


@op
def inline_capacity(hvd, r, n):
    from sparkhvd.collective._core._inline import capacity

    return capacity(n)


def _in_place(reduce, t, **kwargs):
    reduce(t, **kwargs)
    return t


# Each reduction on float64 inputs of FRAME_NUMELS elements: one that rides in the control exchange, one that does not.
_BESIDE_THE_FRAME = {
    "sum_prescaled_in_place": lambda hvd, base, n: _in_place(hvd.allreduce_, base.clone(), op=hvd.Sum,
                                                             prescale_factor=2.0),
    # reduced into the input itself, which is also this rank's payload
    "sum_in_place": lambda hvd, base, n: _in_place(hvd.allreduce_, base.clone(), op=hvd.Sum),
    "max_in_place_strided": lambda hvd, base, n: _in_place(hvd.allreduce_, torch.stack([base, base], 1)[:, 0],
                                                           op=hvd.Max),
    "broadcast_in_place_strided": lambda hvd, base, n: _in_place(hvd.broadcast_, torch.stack([base, base], 1)[:, 1],
                                                                 root_rank=n - 1),
    "average": lambda hvd, base, n: hvd.allreduce(base),
    "min": lambda hvd, base, n: hvd.allreduce(base, op=hvd.Min),
    "max_float32": lambda hvd, base, n: hvd.allreduce(base.float(), op=hvd.Max),
    "product_int32": lambda hvd, base, n: hvd.allreduce(base.int() + 1, op=hvd.Product),
    "sum_postscaled": lambda hvd, base, n: hvd.allreduce(base, op=hvd.Sum, postscale_factor=0.5),
    "grouped_average": lambda hvd, base, n: hvd.grouped_allreduce([base, base.float(), base.long()], op=hvd.Average),
    "sum_async_float16": lambda hvd, base, n: hvd.synchronize(hvd.allreduce_async(base.half(), op=hvd.Sum)),
}


def _beside_the_frame(kind, numel):
    def case(hvd, r, n):
        return _BESIDE_THE_FRAME[kind](hvd, torch.arange(numel, dtype=torch.float64) % 7 + r, n)
    return case


for _numel in FRAME_NUMELS:
    for _kind in _BESIDE_THE_FRAME:
        OPS[f"{_kind}_{_numel}"] = _beside_the_frame(_kind, _numel)

# Integers scaled inside and beyond the control frame: truncated toward zero, as Horovod
_INT_SCALED = {
    "prescale": lambda hvd, r, numel: hvd.allreduce_(torch.full((numel,), 3, dtype=torch.int64), op=hvd.Sum,
                                                     prescale_factor=0.5),  # 1 each
    "average_postscale": lambda hvd, r, numel: hvd.allreduce(torch.full((numel,), -2 if r == 0 else 0),
                                                             postscale_factor=3),
    "sum_postscale": lambda hvd, r, numel: hvd.allreduce(torch.full((numel,), 1 - 2 * r), op=hvd.Sum,
                                                         postscale_factor=0.5),
}


def _int_scaled(kind, numel):
    def case(hvd, r, n):
        return _INT_SCALED[kind](hvd, r, numel)
    return case


for _numel in INT_NUMELS:
    for _kind in _INT_SCALED:
        OPS[f"int_{_kind}_{_numel}"] = _int_scaled(_kind, _numel)


def _ops():
    import sparkhvd.collective.torch as hvd

    hvd.init()
    return run_cases(OPS, hvd, hvd.rank(), hvd.size())


@pytest.fixture(scope="module", params=[2, 3], ids=["np2", "np3"])
def ranks(request):
    return HorovodRunner(np=-request.param).run_all(_ops).values


# ---- values ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
@pytest.mark.parametrize("kind", KINDS)
def test_each_op_on_every_cpu_dtype_and_shape(ranks, kind, dtype):
    n = len(ranks)
    for dims in (1, 2, 3):
        base = (torch.arange(2 ** dims) + 1).reshape([2] * dims)
        inputs = [(base + r).to(dtype) for r in range(n)]
        total = sum((base + r) for r in range(n)).to(dtype)  # small integers: exact in every dtype
        expected = {"sum": total, "average": total.floor_divide(n) if not dtype.is_floating_point else total / n,
                    "broadcast": inputs[-1], "allgather": torch.cat(inputs)}[kind]
        for got in values(ranks, f"{kind}_{_name(dtype)}"):
            assert got[dims].dtype == dtype
            assert torch.equal(got[dims], expected), dims


def test_build_flags_are_a_cpu_gloo_build(ranks):
    mpi_built = importlib.util.find_spec("mpi4py") is not None  # the test extra installs it; MPI is not enabled
    assert all(v == (True, True, mpi_built, False, 0, False, True, False, False, False)
               for v in values(ranks, "build_flags"))  # CPU build of torch


def test_allreduce_async_sums(ranks):
    n = len(ranks)
    for v in values(ranks, "async_ops_in_flight_together"):
        assert torch.equal(v["allreduce"], n * torch.arange(4.0) + sum(range(n)))


def test_broadcast_async_sends_the_roots_tensor(ranks):
    n = len(ranks)
    for v in values(ranks, "async_ops_in_flight_together"):
        assert torch.equal(v["broadcast"], torch.tensor([n - 1, n - 1]))


def test_allgather_async_of_uneven_lengths(ranks):
    n = len(ranks)
    for v in values(ranks, "async_ops_in_flight_together"):
        assert torch.equal(v["allgather"], torch.cat([torch.full((k + 1,), k) for k in range(n)]))


def test_allreduce_async_in_place_averages_into_its_input(ranks):
    n = len(ranks)
    for v in values(ranks, "async_ops_in_flight_together"):
        averaged, is_input = v["allreduce_"]
        assert torch.equal(averaged, torch.arange(4.0) + sum(range(n)) / n) and is_input


def test_a_synchronized_handle_polls_done_and_its_input_is_kept(ranks):
    for v in values(ranks, "async_ops_in_flight_together"):
        assert v["polled"] is True and v["input_kept"] is True


def test_a_name_already_in_flight_is_refused(ranks):
    for v in values(ranks, "async_ops_in_flight_together"):
        assert "another allreduce named 'a' is already in flight on this rank" in v["duplicate_name"]


def test_synchronize_refuses_what_is_not_a_handle(ranks):
    assert values(ranks, "synchronize_not_a_handle") == [
        "synchronize takes a handle returned by an *_async function, got str."] * len(ranks)


def test_grouped_allreduce_sums_each_tensor(ranks):
    n = len(ranks)
    s = sum(range(n))
    for a, b, c in values(ranks, "grouped_allreduce_sum"):
        assert torch.equal(a, torch.tensor([n + s, 2.0 * n])) and torch.equal(b, torch.tensor([10 * n + s]))
        assert torch.equal(c, torch.ones(2, 2) * s)


def test_grouped_allreduce_in_place_averages(ranks):
    n = len(ranks)
    s = sum(range(n))
    for a, b, _ in values(ranks, "grouped_allreduce_in_place"):
        assert torch.equal(a, torch.tensor([(n + s) / n, 2.0])) and torch.equal(b, torch.tensor([(10 * n + s) // n]))


def test_grouped_allreduce_async_max(ranks):
    n = len(ranks)
    for v in values(ranks, "grouped_allreduce_async_max"):
        assert torch.equal(v[2], torch.ones(2, 2) * (n - 1))


def test_grouped_allreduce_of_narrow_integers_and_bools(ranks):
    n = len(ranks)
    s = sum(range(n))
    narrow = [torch.tensor([n + s, 2 * n], dtype=dtype) for dtype in (torch.int16, torch.int8, torch.uint8)]
    for v in values(ranks, "grouped_allreduce_narrow_ints_and_bools"):
        assert all(torch.equal(a, b) for a, b in zip(v, narrow + [torch.tensor([True, False])]))


def test_grouped_allreduce_refuses_tensors_on_two_devices(ranks):
    for v in values(ranks, "grouped_allreduce_across_devices"):
        assert v == ("grouped_allreduce takes tensors on one device, got tensors on cpu, meta; move them to one "
                     "device, or reduce each device's tensors in a group of their own.")


@pytest.mark.parametrize("name, expected", named(("allreduce_min", lambda n: 1.0), ("allreduce_max", float),
                                                 ("allreduce_product", lambda n: float(math.factorial(n)))))
def test_allreduce_min_max_and_product(ranks, name, expected):
    assert [v.item() for v in values(ranks, name)] == [expected(len(ranks))] * len(ranks)


def test_alltoall_without_splits_returns_the_tensor_alone(ranks):
    n = len(ranks)
    for r, out in enumerate(values(ranks, "alltoall_even")):  # without splits, Horovod returns the tensor alone
        assert torch.equal(out, torch.tensor([100 * k + 2 * r + j for k in range(n) for j in range(2)]))


def test_alltoall_with_splits_returns_the_received_splits(ranks):
    n = len(ranks)
    for r, (out, received) in enumerate(values(ranks, "alltoall_splits")):
        assert torch.equal(received, torch.full((n,), r + 1, dtype=torch.int32))
        assert torch.equal(out, torch.cat([torch.full((r + 1, 2), k) for k in range(n)]))


def test_alltoall_received_splits_keep_the_split_tensors_dtype(ranks):
    n = len(ranks)
    for r, received in enumerate(values(ranks, "alltoall_split_tensor")):
        assert torch.equal(received, torch.full((n,), r + 1))  # the splits' own dtype, as Horovod


def test_reducescatter_sum_of_uneven_rows(ranks):
    n = len(ranks)
    rows = 2 * n + 1
    full = n * torch.arange(rows * 2.0).reshape(rows, 2) + sum(range(n))
    assert torch.equal(torch.cat(values(ranks, "reducescatter_sum")), full)
    assert [len(v) for v in values(ranks, "reducescatter_sum")] == _counts(n)  # rank 0 takes the extra row


def test_reducescatter_average(ranks):
    n = len(ranks)
    for mine, got in zip(_counts(n), values(ranks, "reducescatter_average")):
        assert torch.equal(got, torch.ones(mine) * (n + 1) / 2)


def test_grouped_reducescatter(ranks):
    n = len(ranks)
    for a, b in values(ranks, "grouped_reducescatter"):
        assert torch.equal(a, torch.ones(1) * sum(range(n))) and torch.equal(b, torch.ones(2) * n)


def test_allgather_object(ranks):
    n = len(ranks)
    assert values(ranks, "allgather_object") == [[{"rank": k, "pad": "x" * k} for k in range(n)]] * n


@pytest.mark.parametrize("name, sent", named(("compression_fp16", [1.5, 2.5]), ("compression_bf16", [1.0, 2.0])))
def test_compression_keeps_the_dtype_and_the_exact_sum(ranks, name, sent):
    t = len(ranks) * (len(ranks) + 1) // 2
    for v in values(ranks, name):
        assert v.dtype == torch.float32 and torch.equal(v, torch.tensor(sent) * t)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=_name)
def test_half_precision_dtypes_on_gloo(ranks, dtype):
    t = len(ranks) * (len(ranks) + 1) // 2
    for got in values(ranks, f"allreduce_{_name(dtype)}"):
        assert got.dtype == dtype and torch.equal(got, torch.tensor([1.0, 2.0], dtype=dtype) * t)


@pytest.mark.parametrize("numel", FRAME_NUMELS)
@pytest.mark.parametrize("kind", [k for k in _BESIDE_THE_FRAME if k != "grouped_average"])
def test_reductions_inside_and_beyond_the_control_frame(ranks, kind, numel):
    n = len(ranks)
    per_rank = [torch.arange(numel, dtype=torch.float64) % 7 + r for r in range(n)]
    total = sum(per_rank)
    expected = {"sum_prescaled_in_place": total * 2, "sum_in_place": total, "max_in_place_strided": per_rank[-1],
                "broadcast_in_place_strided": per_rank[-1], "average": total / n, "min": per_rank[0],
                "max_float32": per_rank[-1].float(),
                "product_int32": torch.stack([p.int() + 1 for p in per_rank]).prod(0).int(),
                "sum_postscaled": total * 0.5, "sum_async_float16": total.half()}[kind]
    for got in values(ranks, f"{kind}_{numel}"):
        assert torch.equal(got, expected)


@pytest.mark.parametrize("numel", FRAME_NUMELS)
def test_grouped_average_inside_and_beyond_the_control_frame_keeps_each_dtype(ranks, numel):
    n = len(ranks)
    total = sum(torch.arange(numel, dtype=torch.float64) % 7 + r for r in range(n))
    for got in values(ranks, f"grouped_average_{numel}"):
        assert [g.dtype for g in got] == [torch.float64, torch.float32, torch.int64]
        assert torch.equal(got[0], total / n)
        assert torch.equal(got[1], (total / n).float())
        assert torch.equal(got[2], total.long() // n)


def test_the_control_frame_holds_the_small_tensors_and_not_the_large(ranks):
    assert all(FRAME_NUMELS[0] * 8 <= v < FRAME_NUMELS[1] * 8 for v in values(ranks, "inline_capacity"))


@pytest.mark.parametrize("numel", INT_NUMELS)
@pytest.mark.parametrize("kind", list(_INT_SCALED))
def test_scaled_integers_are_truncated_toward_zero_as_horovod(ranks, kind, numel):
    n = len(ranks)
    expected = {"prescale": n,  # trunc(3 * 0.5) on each rank, summed
                "average_postscale": math.trunc(-2 * 3 / n),  # rank 0 holds -2, the others 0
                "sum_postscale": math.trunc(sum(1 - 2 * r for r in range(n)) * 0.5)}[kind]  # not floor
    for got in values(ranks, f"int_{kind}_{numel}"):
        assert torch.equal(got, torch.full((numel,), expected))


# ---- argument errors ------------------------------------------------------------------------------------------

def test_alltoall_without_splits_needs_a_divisible_first_dimension(ranks):
    n = len(ranks)
    for v in values(ranks, "alltoall_indivisible"):
        assert v == (f"alltoall without splits needs the first dimension ({2 * n + 1}) to be divisible by the number "
                     f"of ranks ({n}); pass splits= to send uneven parts.")


def test_alltoall_splits_must_be_a_count_per_rank(ranks):
    n = len(ranks)
    for v in values(ranks, "alltoall_bad_splits"):
        assert v.startswith(f"alltoall splits {[1] * (n + 1)} must be {n} non-negative counts")


def test_reducescatter_refuses_max(ranks):
    for v in values(ranks, "reducescatter_max"):
        assert v == "reducescatter supports op=hvd.Average or hvd.Sum, got Max."


def test_alltoall_refuses_a_scalar(ranks):
    for v in values(ranks, "alltoall_scalar"):
        assert v == "alltoall needs a tensor with at least one dimension; got a scalar."
