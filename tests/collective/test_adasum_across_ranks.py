"""op=hvd.Adasum across real ranks: allreduce (every form) and DistributedOptimizer against the NumPy copy of
Horovod's algorithm (tests/_adasum_oracle.py), bit for bit where every dot product is exact, what Horovod refuses,
and the TensorFlow and Keras APIs. One case per op (tests/_cases.py), one test per case."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _adasum_oracle import assert_adasum, horovod_close, np_pair, np_tree, tolerance
from _cases import add_to, named, run_cases, values
from _tf_ranks import tf_ranks

from sparkhvd import HorovodRunner


def _inputs(rank: int, size: int) -> dict:
    """Each rank's tensors, built from its rank (the test rebuilds every rank's)."""
    rng = np.random.default_rng(100 + rank)
    ints = rng.integers(-8, 9, 11)
    cases = {f"int_{np.dtype(d).name}": ints.astype(d) for d in (np.float16, np.float32, np.float64)}
    cases.update({f"random_{np.dtype(d).name}": rng.normal(size=13).astype(d) for d in (np.float32, np.float64)})
    cases["zero_or_not"] = np.zeros(4) if rank == 0 else np.arange(4.0) + rank
    shared = np.random.default_rng(7)  # Horovod's orthogonal and parallel vectors (test_adasum_pytorch.py)
    for d in (np.float16, np.float32):
        q, _ = np.linalg.qr(shared.normal(size=(size * 20 - 17, size)))
        cases[f"orthogonal_{np.dtype(d).name}"] = q[:, rank].astype(d)
        a, r = shared.normal(size=(size * 2 + 1, 1)), shared.normal(size=(size, 1))
        cases[f"parallel_{np.dtype(d).name}"] = np.dot(a, r.T)[:, rank].astype(d)
    cases["group"] = [rng.normal(size=(2, 3)), rng.normal(size=5).astype(np.float32), np.arange(3.0) * (rank + 1)]
    # past HALVING_MIN_ELEMENTS: Horovod's vector halving; odd lengths, and tensors that straddle the halves
    cases["large_int_float32"] = rng.integers(-8, 9, 50001).astype(np.float32)
    cases["large_random_float16"] = rng.normal(size=40003).astype(np.float16)
    cases["large_group"] = [rng.normal(size=20000), rng.normal(size=7), rng.normal(size=(3, 10001))]
    return cases


def _attempt(call) -> str:
    """The type and message of what ``call()`` raises, or "no error"."""
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - the test compares type and message
        return f"{type(exc).__name__}: {exc}"
    return "no error"


# ---- allreduce, at np=2 and np=4 ------------------------------------------------------------------------------

ALLREDUCES: dict = {}
allreduce = add_to(ALLREDUCES)
VECTORS = [key for key in _inputs(0, 2) if not key.endswith("group")]


def _allreduce_of(key):
    def case(hvd, r, n, fused):
        return hvd.allreduce(torch.from_numpy(_inputs(r, n)[key]), op=hvd.Adasum).numpy()
    return case


for _key in VECTORS:
    ALLREDUCES[_key] = _allreduce_of(_key)


def _group(r, n):
    return [torch.from_numpy(g) for g in _inputs(r, n)["group"]]


@allreduce
def grouped(hvd, r, n, fused):
    return [t.numpy() for t in hvd.grouped_allreduce(_group(r, n), op=hvd.Adasum)]


@allreduce
def large_grouped(hvd, r, n, fused):
    tensors = [torch.from_numpy(g) for g in _inputs(r, n)["large_group"]]
    return [t.numpy() for t in hvd.grouped_allreduce(tensors, op=hvd.Adasum)]


@allreduce
def async_fused(hvd, r, n, fused):
    # Fused for sure: the other ranks' requests are in before the coordinator's (the barrier comes after them on
    # the links), and its two go in together within a cycle of the barrier's answer.
    doubles = [t for t in _group(r, n) if t.dtype == torch.float64]
    handles = [hvd.allreduce_async(t, op=hvd.Adasum) for t in doubles] if r else []
    hvd.barrier()
    handles = handles or [hvd.allreduce_async(t, op=hvd.Adasum) for t in doubles]
    return [hvd.synchronize(h).numpy() for h in handles]


def _random_float64(r, n):
    return torch.from_numpy(_inputs(r, n)["random_float64"])


@allreduce
def scaled(hvd, r, n, fused):
    return hvd.allreduce(_random_float64(r, n), op=hvd.Adasum, prescale_factor=2.0, postscale_factor=0.25).numpy()


@allreduce
def in_place(hvd, r, n, fused):
    inplace = _random_float64(r, n).clone()
    return hvd.allreduce_(inplace, op=hvd.Adasum) is inplace, inplace.numpy()


@allreduce
def async_in_place(hvd, r, n, fused):
    return hvd.synchronize(hvd.allreduce_async_(_random_float64(r, n).clone(), op=hvd.Adasum, name="mine")).numpy()


@allreduce
def grouped_async_in_place(hvd, r, n, fused):
    group_ = [t.clone() for t in _group(r, n)]
    hvd.synchronize(hvd.grouped_allreduce_async_(group_, op=hvd.Adasum))
    return [t.numpy() for t in group_]


@allreduce
def gradient(hvd, r, n, fused):
    leaf = torch.full((3,), float(r + 1), requires_grad=True)
    hvd.allreduce(leaf, op=hvd.Adasum).mul(torch.tensor([1.0, 2.0, 3.0])).sum().backward()
    return leaf.grad.numpy()  # Horovod's gradient: the same Adasum of each rank's gradient


_ERRORS = {
    "int": lambda hvd: hvd.allreduce(torch.ones(2, dtype=torch.int32), op=hvd.Adasum),
    "bfloat16": lambda hvd: hvd.allreduce(torch.ones(2, dtype=torch.bfloat16), op=hvd.Adasum),
    "process_set": lambda hvd: hvd.allreduce(torch.ones(2), op=hvd.Adasum, process_set=hvd.add_process_set([0])),
    "reducescatter": lambda hvd: hvd.reducescatter(torch.ones(2), op=hvd.Adasum),
}


def _error_of(key):
    def case(hvd, r, n, fused):
        return _attempt(lambda: _ERRORS[key](hvd))
    return case


for _key in _ERRORS:
    ALLREDUCES[f"error_{_key}"] = _error_of(_key)


@allreduce
def fused_sizes(hvd, r, n, fused):
    return fused[0]  # every fused launch of the run, read last


@allreduce
def halvings(hvd, r, n, fused):
    return fused[1][0]  # how many reductions went by the vector halving, read last


def _allreduces(halving_from: int | None = None):
    import os

    import sparkhvd.collective.torch as hvd
    from sparkhvd.collective._core import _adasum

    os.environ["HOROVOD_CYCLE_TIME"] = "20"  # async ops submitted together are fused
    if halving_from is not None:  # every buffer of one element per rank by the vector halving, the small ones too
        _adasum.HALVING_MIN_ELEMENTS = halving_from
    hvd.init()
    fused, halved = [], [0]
    launch_fused, halving_doubling = _adasum._launch_fused, _adasum.halving_doubling
    _adasum._launch_fused = lambda ops, item: fused.append(len(ops)) or launch_fused(ops, item)

    def counted(*args):
        halved[0] += 1
        return halving_doubling(*args)

    _adasum.halving_doubling = counted
    return run_cases(ALLREDUCES, hvd, hvd.rank(), hvd.size(), (fused, halved))


@pytest.fixture(scope="module")
def two_ranks():
    return HorovodRunner(np=-2).run_all(_allreduces).values


@pytest.fixture(scope="module")
def four_ranks():
    return HorovodRunner(np=-4).run_all(_allreduces).values


@pytest.fixture(scope="module")
def four_ranks_halving():
    return HorovodRunner(np=-4).run_all(_allreduces, halving_from=0).values


@pytest.fixture(params=["two_ranks", "four_ranks", "four_ranks_halving"], ids=["np2", "np4", "np4-halving"])
def ranks(request):
    return request.getfixturevalue(request.param)


def _every_input(n):
    return [_inputs(r, n) for r in range(n)]


@pytest.mark.parametrize("key", ["random_float32", "random_float64", "grouped", "async_fused", "orthogonal_float16",
                                 "large_random_float16", "large_grouped"])
def test_every_rank_gets_the_same_bits(ranks, key):
    def bits(value):
        return [np.asarray(x).tobytes() for x in value] if isinstance(value, list) else [value.tobytes()]

    got = values(ranks, key)
    assert all(bits(v) == bits(got[0]) for v in got[1:])


@pytest.mark.parametrize("key", [k for k in VECTORS if k.startswith(("int_", "random_", "zero_", "large_"))])
def test_allreduce_matches_horovods_algorithm(ranks, key):
    n = len(ranks)
    exact = key.startswith(("int_", "large_int")) and n == 2  # every dot product exact, one level
    assert_adasum(values(ranks, key)[0], [i[key] for i in _every_input(n)], exact=exact)


def test_a_zero_vector_gives_the_others_result_exactly(ranks):
    inputs = _every_input(len(ranks))
    np.testing.assert_array_equal(values(ranks, "zero_or_not")[0], np_tree([i["zero_or_not"] for i in inputs]))


@pytest.mark.parametrize("dtype", [np.float16, np.float32], ids=lambda d: np.dtype(d).name)
def test_horovods_orthogonal_vectors_add_and_parallel_ones_average(ranks, dtype):
    name, inputs = np.dtype(dtype).name, _every_input(len(ranks))
    orthogonal, parallel = [i[f"orthogonal_{name}"] for i in inputs], [i[f"parallel_{name}"] for i in inputs]
    got_orthogonal, got_parallel = values(ranks, f"orthogonal_{name}")[0], values(ranks, f"parallel_{name}")[0]
    # Horovod's own cases and criterion; and the oracle's
    assert horovod_close(np.sum(np.asarray(orthogonal, np.float64), axis=0), got_orthogonal, dtype)
    assert horovod_close(np.mean(np.asarray(parallel, np.float64), axis=0), got_parallel, dtype)
    assert_adasum(got_orthogonal, orthogonal)
    assert_adasum(got_parallel, parallel)


@pytest.mark.parametrize("key", ["grouped", "large_grouped"])
def test_grouped_allreduce_reduces_each_tensor_as_if_alone(ranks, key):
    inputs, group = _every_input(len(ranks)), key.replace("grouped", "group")
    for k, got in enumerate(values(ranks, key)[0]):  # per tensor, as if each were reduced alone
        assert got.shape == inputs[0][group][k].shape
        assert_adasum(got, [i[group][k] for i in inputs])


def test_grouped_allreduce_async_in_place_equals_grouped_allreduce(ranks):
    for got, want in zip(values(ranks, "grouped_async_in_place")[0], values(ranks, "grouped")[0]):
        np.testing.assert_array_equal(got, want)


def test_async_adasums_fused_keep_tensor_boundaries(ranks):
    inputs = _every_input(len(ranks))
    doubles = [i["group"][0].reshape(-1) for i in inputs], [i["group"][2] for i in inputs]
    for got, vectors in zip(values(ranks, "async_fused")[0], doubles):
        assert_adasum(got, vectors)


def test_large_buffers_go_by_the_vector_halving_and_small_ones_where_told(two_ranks, four_ranks, four_ranks_halving):
    # the two large vectors, and the large group (float64 only: one buffer)
    assert values(two_ranks, "halvings")[0] == values(four_ranks, "halvings")[0] == 3
    assert values(four_ranks_halving, "halvings")[0] > 20  # every case's reductions but the errors'


def test_the_two_async_adasums_were_one_fused_data_op(ranks):
    assert values(ranks, "fused_sizes")[0] == [2]  # the two async ops were one data op (and nothing else fused)


def test_in_place_and_async_in_place_equal_out_of_place(ranks):
    out_of_place = values(ranks, "random_float64")[0]
    is_input, inplace = values(ranks, "in_place")[0]
    assert is_input
    np.testing.assert_array_equal(inplace, out_of_place)
    np.testing.assert_array_equal(values(ranks, "async_in_place")[0], out_of_place)


def test_prescale_and_postscale(ranks):
    x = [i["random_float64"] for i in _every_input(len(ranks))]
    got = values(ranks, "scaled")[0]
    assert_adasum(got * 4.0, [2.0 * v for v in x])  # the sum scaled by 2 first, by 0.25 after (exact)
    np.testing.assert_allclose(got, 0.5 * values(ranks, "random_float64")[0], rtol=1e-14)  # Adasum(2a, 2b) = 2 Adasum


def test_the_gradient_is_the_adasum_of_the_gradients(ranks):
    # equal gradients: their average
    np.testing.assert_allclose(values(ranks, "gradient")[0], [1.0, 2.0, 3.0], rtol=1e-7)


def test_four_ranks_combine_pairs_of_pairs_not_one_after_another(four_ranks):
    x = [_inputs(r, 4)["random_float64"] for r in range(4)]
    in_a_row = np_pair(np_pair(np_pair(x[0], x[1], [13]), x[2], [13]), x[3], [13])
    assert np.abs(values(four_ranks, "random_float64")[0] - in_a_row).max() > 1e3 * tolerance(x, [13])


@pytest.mark.parametrize("key, check", named(
    ("int", lambda e: e == "ValueError: allreduce(op=hvd.Adasum) reduces float16, float32 and float64 tensors, as "
                          "Horovod's, got int32; cast them to a floating type, or use op=hvd.Sum or hvd.Average."),
    ("bfloat16", lambda e: e.startswith("ValueError: allreduce(op=hvd.Adasum) reduces float16, float32 and float64 "
                                        "tensors, as Horovod's, got bfloat16;")),
    ("process_set", lambda e: e == "NotImplementedError: allreduce(op=hvd.Adasum) runs on the global process set "
                                   "only, as Horovod's (\"Adasum does not support non-global process sets yet\"), but "
                                   "got process set [0]; use op=hvd.Average on a process set."),
    ("reducescatter", lambda e: e == "NotImplementedError: reducescatter does not support op=hvd.Adasum (nor does "
                                     "Horovod); use op=hvd.Average or hvd.Sum, or allreduce with op=hvd.Adasum.")
))
def test_adasum_errors_name_the_values_and_the_fix(two_ranks, key, check):
    for message in values(two_ranks, f"error_{key}"):
        assert check(message), message


# ---- DistributedOptimizer(op=hvd.Adasum), at np=2 -------------------------------------------------------------

LR, MOMENTUM = 0.1, 0.9


def _batch(rank: int, step: int, k: int):
    g = torch.Generator().manual_seed(1000 * rank + 10 * step + k)
    return torch.randn(4, 3, generator=g), torch.randn(4, 2, generator=g)


def _model():
    torch.manual_seed(0)  # the same start on every rank
    return torch.nn.Linear(3, 2)


OPTIMIZER: dict = {}
optimizer = add_to(OPTIMIZER)


def _steps(passes):
    def case(hvd, r, state):
        model = _model()
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM),
                                       named_parameters=model.named_parameters(), op=hvd.Adasum,
                                       backward_passes_per_step=passes)
        out = {}
        for step in range(2):
            opt.zero_grad()
            for k in range(passes):
                x, y = _batch(r, step, k)
                torch.nn.functional.mse_loss(model(x), y).backward()
            if step == 0:
                out["in_flight"] = model.weight.detach().clone()  # the local change, until step()
            opt.step()
        out["weights"] = [p.detach().clone() for p in model.parameters()]
        out["momentum"] = opt.state[model.weight]["momentum_buffer"].clone()
        out["class"] = type(opt).__name__, isinstance(opt, torch.optim.SGD)
        return out
    return case


OPTIMIZER["passes_1"] = _steps(1)
OPTIMIZER["passes_2"] = _steps(2)


@optimizer
def zero_grad_while_reducing(hvd, r, state):
    model = state["model"] = _model()
    opt = state["opt"] = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR), op=hvd.Adasum)
    model(torch.ones(1, 3)).sum().backward()
    return _attempt(opt.zero_grad)


@optimizer
def set_passes_while_reducing(hvd, r, state):
    return _attempt(lambda: state["opt"].set_backward_passes_per_step(2))


@optimizer
def more_passes_than_declared(hvd, r, state):
    return _attempt(lambda: state["model"](torch.ones(1, 3)).sum().backward())


@optimizer
def skip_synchronize(hvd, r, state):
    state["opt"].step()
    return _attempt(lambda: state["opt"].skip_synchronize().__enter__())


@optimizer
def wrapped_twice(hvd, r, state):
    return _attempt(lambda: hvd.DistributedOptimizer(state["opt"], op=hvd.Adasum))


@optimizer
def process_set(hvd, r, state):
    one = hvd.add_process_set([0])
    plain = torch.optim.SGD(_model().parameters(), lr=LR)
    error = _attempt(lambda: hvd.DistributedOptimizer(plain, op=hvd.Adasum, process_set=one))
    return error, type(plain) is torch.optim.SGD


def _optimizer_steps():
    import sparkhvd.collective.torch as hvd

    hvd.init()
    return run_cases(OPTIMIZER, hvd, hvd.rank(), {})


def _reference_steps(size: int, passes: int, combine=np_tree):
    """The delta rule in plain torch and the NumPy oracle: each rank's own SGD (its own momentum) takes a local
    step from the common weights; the weights become start + Adasum of the ranks' changes, tensor by tensor."""
    common = [p.detach().clone() for p in _model().parameters()]
    models = [_model() for _ in range(size)]
    opts = [torch.optim.SGD(m.parameters(), lr=LR, momentum=MOMENTUM) for m in models]
    changes = []
    for step in range(2):
        deltas = []
        for rank, (model, opt) in enumerate(zip(models, opts)):
            with torch.no_grad():
                for p, c in zip(model.parameters(), common):
                    p.copy_(c)
            opt.zero_grad()
            for k in range(passes):  # the gradients are summed over the passes
                x, y = _batch(rank, step, k)
                torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            deltas.append([(p.detach() - c).numpy() for p, c in zip(model.parameters(), common)])
        changes.append(deltas)
        common = [c + torch.from_numpy(combine([d[i] for d in deltas]).reshape(c.shape)) for i, c in enumerate(common)]
    return common, changes, [opt.state[m.weight]["momentum_buffer"] for m, opt in zip(models, opts)]


@pytest.fixture(scope="module")
def optimizer_ranks():
    return HorovodRunner(np=-2).run_all(_optimizer_steps).values


@pytest.mark.parametrize("passes", [1, 2])
def test_optimizer_reduces_each_ranks_local_change_by_adasum(optimizer_ranks, passes):
    expected, changes, momentum = _reference_steps(2, passes)
    got = values(optimizer_ranks, f"passes_{passes}")
    for rank, v in enumerate(got):
        for weight, want in zip(v["weights"], expected):  # float32; sums in another order: a few ulps over two steps
            np.testing.assert_allclose(weight.numpy(), want.numpy(), rtol=0, atol=1e-6)
        # the local step ran in the backward hook: the weight holds this rank's change until step()
        np.testing.assert_array_equal(v["in_flight"].numpy(), changes[0][rank][0])
        # each rank's optimizer state is its own (momentum from its own gradients), as in Horovod
        torch.testing.assert_close(v["momentum"], momentum[rank], rtol=1e-5, atol=1e-6)
    assert not torch.equal(got[0]["momentum"], got[1]["momentum"])
    averaged, _, _ = _reference_steps(2, passes, combine=lambda ds: np.mean(ds, axis=0))  # not what averaging gives
    assert max((weight - a).abs().max() for weight, a in zip(got[0]["weights"], averaged)) > 1e-3


def test_the_adasum_optimizer_keeps_its_class(optimizer_ranks):
    assert values(optimizer_ranks, "passes_2")[0]["class"] == ("SGD", True)


@pytest.mark.parametrize("key, check", named(
    ("zero_grad_while_reducing", lambda e: e == (
        "RuntimeError: optimizer.zero_grad() was called after loss.backward() but before optimizer.step(), while "
        "parameter changes were being reduced; call zero_grad() before the backward pass (with "
        "backward_passes_per_step=N, after the N-th step).")),
    ("set_passes_while_reducing", lambda e: e == (
        "RuntimeError: set_backward_passes_per_step() was called while parameter changes were being reduced; call it "
        "right after optimizer.step().")),
    ("more_passes_than_declared", lambda e: e == (
        "RuntimeError: gradients were computed 2 times before optimizer.step(), more than backward_passes_per_step=1; "
        "pass backward_passes_per_step=2 to DistributedOptimizer to accumulate them locally.")),
    ("skip_synchronize", lambda e: e.startswith(
        "AssertionError: optimizer.skip_synchronize() is not supported with op=hvd.Adasum (as in Horovod)")),
    ("wrapped_twice", lambda e: e == (
        "ValueError: this optimizer is already a DistributedOptimizer; wrap the original optimizer once."))
))
def test_optimizer_errors_name_the_values_and_the_fix(optimizer_ranks, key, check):
    message = values(optimizer_ranks, key)[0]
    assert check(message), message


def test_the_optimizer_on_a_process_set_is_refused_and_left_as_it_was(optimizer_ranks):
    message, unchanged = values(optimizer_ranks, "process_set")[0]
    assert message.startswith("NotImplementedError: DistributedOptimizer(op=hvd.Adasum) runs on the global process "
                              "set only")
    assert unchanged


# ---- three ranks ----------------------------------------------------------------------------------------------

def _three_ranks():
    import torch

    import sparkhvd.collective.torch as hvd

    hvd.init()
    errors = {}
    for name, call in {
        "allreduce": lambda: hvd.allreduce(torch.ones(2), op=hvd.Adasum),
        "grouped": lambda: hvd.grouped_allreduce_([torch.ones(2)], op=hvd.Adasum),
        "optimizer": lambda: hvd.DistributedOptimizer(torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=0.1),
                                                      op=hvd.Adasum),
    }.items():
        errors[name] = _attempt(call)
    return errors


@pytest.fixture(scope="module")
def three_ranks_errors():
    return HorovodRunner(np=-3).run(_three_ranks)


@pytest.mark.parametrize("what, name", [("allreduce", "allreduce"), ("grouped_allreduce", "grouped"),
                                        ("DistributedOptimizer", "optimizer")])
def test_three_ranks_are_refused_as_horovod_refuses_them(three_ranks_errors, what, name):
    assert three_ranks_errors[name] == (
        f"NotImplementedError: {what}(op=hvd.Adasum) combines ranks pairwise and needs a power-of-2 number of "
        "ranks, as Horovod's (\"Running Adasum with non-power of 2 ranks is not supported yet\"), but this job "
        "has 3; run 1, 2, 4, 8, ... ranks, or use op=hvd.Average.")


# ---- TensorFlow and Keras (one run: importing TensorFlow is slow) ---------------------------------------------

TENSORFLOW: dict = {}
tf_case = add_to(TENSORFLOW)


@tf_case
def eager(hvd, hvd_keras, r, n):
    import tensorflow as tf

    return hvd.allreduce(tf.constant(_inputs(r, n)["random_float64"]), op=hvd.Adasum).numpy()


@tf_case
def in_tf_function(hvd, hvd_keras, r, n):
    import tensorflow as tf

    in_graph = tf.function(lambda t: hvd.allreduce(t, op=hvd.Adasum))
    return in_graph(tf.constant(_inputs(r, n)["random_float32"])).numpy()


@tf_case
def grouped_tensors(hvd, hvd_keras, r, n):
    import tensorflow as tf

    return [t.numpy() for t in hvd.grouped_allreduce([tf.constant(g) for g in _inputs(r, n)["group"]], op=hvd.Adasum)]


def _tf_data(r):
    rng = np.random.default_rng(r)
    return rng.normal(size=(4, 3)).astype(np.float32), rng.normal(size=(4, 2)).astype(np.float32)


@tf_case
def tape(hvd, hvd_keras, r, n):
    import tensorflow as tf

    x, y = _tf_data(r)
    w, b = tf.Variable(tf.ones([3, 2])), tf.Variable(tf.zeros([2]))

    def loss():
        return tf.reduce_mean(tf.square(x @ w + b - y))

    with tf.GradientTape() as plain:
        local = plain.gradient(loss(), [w, b])
    with hvd.DistributedGradientTape(tf.GradientTape(), op=hvd.Adasum) as tape:
        value = loss()
    return {"local": [g.numpy() for g in local], "tape": [g.numpy() for g in tape.gradient(value, [w, b])]}


@tf_case
def keras_fit(hvd, hvd_keras, r, n):
    import keras

    x, y = _tf_data(r)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2, kernel_initializer="ones")])
    model.compile(optimizer=hvd_keras.DistributedOptimizer(keras.optimizers.SGD(0.1), op=hvd_keras.Adasum),
                  loss="mse")
    model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    return model.get_weights()


@tf_case
def keras_op_max(hvd, hvd_keras, r, n):
    import keras

    try:
        hvd_keras.DistributedOptimizer(keras.optimizers.SGD(0.1), op=hvd_keras.Max)
    except ValueError as exc:
        return str(exc)
    return "no error"


def _tf_adasum():
    import sparkhvd.collective.keras as hvd_keras
    import sparkhvd.collective.tensorflow as hvd

    hvd.init()
    return run_cases(TENSORFLOW, hvd, hvd_keras, hvd.rank(), hvd.size())


@pytest.fixture(scope="module")
def tf_adasum(tmp_path_factory):
    return tf_ranks("adasum", tmp_path_factory)[0]  # _tf_adasum, in the ranks the TF modules share


@pytest.mark.parametrize("key, name", [("eager", "random_float64"), ("in_tf_function", "random_float32")])
def test_tensorflow_allreduce(tf_adasum, key, name):
    inputs = _every_input(2)
    for got in values(tf_adasum, key):
        assert_adasum(got, [i[name] for i in inputs])


def test_tensorflow_grouped_allreduce(tf_adasum):
    inputs = _every_input(2)
    for v in values(tf_adasum, "grouped_tensors"):
        for k, got in enumerate(v):
            assert_adasum(got, [i["group"][k] for i in inputs])


def test_tensorflow_tape_combines_each_gradient_by_adasum(tf_adasum):
    tapes = values(tf_adasum, "tape")
    for v in tapes:
        for k, got in enumerate(v["tape"]):  # the tape combines each gradient by Adasum, as Horovod's
            assert_adasum(got, [w["local"][k] for w in tapes])


def test_keras_optimizer_combines_by_adasum_then_steps(tf_adasum):
    local = [w["local"] for w in values(tf_adasum, "tape")]
    start = [np.ones((3, 2), np.float32), np.zeros(2, np.float32)]
    for v in values(tf_adasum, "keras_fit"):
        for k, got in enumerate(v):  # Keras's optimizer: the same, then its SGD step
            np.testing.assert_allclose(got, start[k] - 0.1 * np_tree([w[k] for w in local]).reshape(start[k].shape),
                                       rtol=0, atol=1e-6)


def test_keras_optimizer_refuses_max(tf_adasum):
    assert values(tf_adasum, "keras_op_max") == [
        "DistributedOptimizer reduces gradients with op=hvd.Average, hvd.Sum or hvd.Adasum, got Max."] * 2
