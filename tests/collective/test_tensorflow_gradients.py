"""Gradients through Horovod's TensorFlow API at np=2, in one pair of rank processes: each collective's gradient in
Horovod's convention (eagerly, in tf.function and in TF1 graphs), DistributedGradientTape (sparse gradients too),
PartialDistributedGradientTape and SyncBatchNormalization against BatchNormalization on every rank's rows. One case
per behaviour (tests/_cases.py), one test per case; expected values are exact."""

from __future__ import annotations

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

from _cases import add_to, error_of, message_of, named, rows_to_each, run_cases, values  # noqa: E402
from _tf_ranks import tf_ranks  # noqa: E402

GRADS: dict = {}
grad = add_to(GRADS)




# ---- each collective's gradient: each rank's loss weights the op's output by (r + 1) ---------------------------

@grad
def allreduce_sum(hvd, r, n):
    v = tf.Variable(tf.ones([2]) * (r + 1))
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(hvd.allreduce(v, op=hvd.Sum) * (r + 1))
    return tape.gradient(loss, v).numpy()


_OPS = {
    "allgather": lambda hvd, t, n: hvd.allgather(t),
    "broadcast": lambda hvd, t, n: hvd.broadcast(t, root_rank=1),
    "alltoall": lambda hvd, t, n: hvd.alltoall(t, splits=rows_to_each(n))[0],
    "reducescatter_sum": lambda hvd, t, n: hvd.reducescatter(t, op=hvd.Sum),
    "reducescatter_average": lambda hvd, t, n: hvd.reducescatter(t, op=hvd.Average),
    "reducescatter_scaled": lambda hvd, t, n: hvd.reducescatter(t, op=hvd.Sum, prescale_factor=3.0,
                                                                postscale_factor=0.5),
}


def _gradient_of(key):
    def case(hvd, r, n):
        t = tf.Variable(tf.ones([sum(rows_to_each(n)) if key == "alltoall" else 2 * n + 1]))
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(_OPS[key](hvd, t, n) * (r + 1.0))
        return tape.gradient(loss, t).numpy()
    return case


for _key in _OPS:
    GRADS[_key] = _gradient_of(_key)


@grad
def alltoall_in_tf_function(hvd, r, n):
    splits = rows_to_each(n)

    @tf.function
    def graph_grad(t):
        with tf.GradientTape() as tape:
            tape.watch(t)
            loss = tf.reduce_sum(hvd.alltoall(t, splits=splits)[0] * (r + 1.0))
        return tape.gradient(loss, t)

    return graph_grad(tf.ones([sum(splits)])).numpy()


@grad
def allgather_in_tf_function_five_times(hvd, r, n):
    @tf.function
    def allgather_graph_grad(t):  # two collectives in the gradient: their order must not race
        with tf.GradientTape() as tape:
            tape.watch(t)
            loss = tf.reduce_sum(hvd.allgather(t) * (r + 1.0))
        return tape.gradient(loss, t)

    return [allgather_graph_grad(tf.ones([2 * n + 1])).numpy() for _ in range(5)]


@grad
def grouped_allgather(hvd, r, n):
    a, b = tf.Variable(tf.ones([r + 1, 2])), tf.Variable([1.0, 2.0])
    with tf.GradientTape() as tape:
        ga, gb = hvd.grouped_allgather([a, b])
        loss = tf.reduce_sum(ga) * (r + 1.0) + tf.reduce_sum(gb * gb)
    return [g.numpy().tolist() for g in tape.gradient(loss, [a, b])]


@grad
def grouped_allreduce(hvd, r, n):
    x, y = tf.Variable([1.0, 2.0]), tf.Variable([[3.0]], dtype=tf.float64)
    with tf.GradientTape(persistent=True) as tape:
        sx, sy = hvd.grouped_allreduce([x, y], op=hvd.Sum)
    return [tape.gradient(sx, x).numpy().tolist(), tape.gradient(sy, y).numpy().tolist()]


@grad
def grouped_allreduce_in_tf_function(hvd, r, n):
    x, y = tf.Variable([1.0, 2.0]), tf.Variable([[3.0]], dtype=tf.float64)

    @tf.function
    def grouped_grad_graph():
        with tf.GradientTape() as tape:
            sx, sy = hvd.grouped_allreduce([x, y], op=hvd.Sum, prescale_factor=0.5)
            loss = tf.reduce_sum(sx) * (r + 1.0) + tf.cast(tf.reduce_sum(sy), tf.float32)
        return tape.gradient(loss, [x, y])

    return [g.numpy().tolist() for g in grouped_grad_graph()]


@grad
def grouped_allreduce_in_a_tf1_graph(hvd, r, n):
    with tf.Graph().as_default():
        tensors = [tf.constant([1.0, 2.0]), tf.constant([[3.0]], dtype=tf.float64)]
        reduced = hvd.grouped_allreduce(tensors, op=hvd.Sum)
        grads = [tf.gradients(s, t, tf.ones_like(s))[0] for s, t in zip(reduced, tensors)]
        with tf.compat.v1.Session() as session:
            return [session.run(g).tolist() for g in grads]  # one collective per run


@grad
def broadcast_in_a_tf1_graph(hvd, r, n):
    with tf.Graph().as_default():  # broadcast's gradient alone: the non-root must still join the allreduce
        t = tf.fill([2], float(r))
        grads = [tf.gradients(hvd.broadcast(t, root), t, tf.fill([2], r + 1.0))[0] for root in (0, 1)]
        with tf.compat.v1.Session() as session:
            return [session.run(g).tolist() for g in grads]


# ---- DistributedGradientTape ----------------------------------------------------------------------------------

def _tape_of(r):
    w = tf.Variable([1.0, 1.0])
    tape = tf.GradientTape()
    with tape:
        loss = tf.reduce_sum(w * (r + 1.0))
    return w, tape, loss


@grad
def tape_average(hvd, r, n):
    w, tape, loss = _tape_of(r)
    return hvd.DistributedGradientTape(tape).gradient(loss, [w])[0].numpy()


@grad
def tape_sum(hvd, r, n):
    w, tape, loss = _tape_of(r)
    return hvd.DistributedGradientTape(tape, op=hvd.Sum).gradient(loss, w).numpy()


@grad
def tape_in_tf_function(hvd, r, n):
    w = tf.Variable([1.0, 1.0])

    @tf.function
    def graph_tape():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(w * (r + 1.0))
        return hvd.DistributedGradientTape(tape).gradient(loss, [w])[0]

    return graph_tape().numpy()


@grad
def tape_with_max(hvd, r, n):
    _, tape, _ = _tape_of(r)
    return message_of(lambda: hvd.DistributedGradientTape(tape, op=hvd.Max), ValueError)


def _sparse_tape(dense):
    def case(hvd, r, n):
        emb = tf.Variable(tf.zeros([3, 2]))
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.gather(emb, [r]) * (r + 1.0))  # an IndexedSlices gradient
        g = hvd.DistributedGradientTape(tape, sparse_as_dense=dense).gradient(loss, [emb])[0]
        return type(g).__name__, tf.convert_to_tensor(g).numpy().tolist()
    return case


GRADS["tape_sparse"] = _sparse_tape(False)
GRADS["tape_sparse_as_dense"] = _sparse_tape(True)


# ---- PartialDistributedGradientTape ---------------------------------------------------------------------------

def _two_layers(r):
    import keras

    first = keras.layers.Dense(1, use_bias=False, kernel_initializer="ones")
    second = keras.layers.Dense(1, use_bias=False, kernel_initializer="ones")
    x = tf.constant([[r + 1.0]])  # d loss / d each kernel = r + 1
    return first, second, x


def _partial(local_layers, scale):
    def case(hvd, r, n):
        first, second, x = _two_layers(r)
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(second(first(x)))
        local = {"first": [first], "first alone": first, "none": None}[local_layers]
        tape = hvd.PartialDistributedGradientTape(tape, local_layers=local, scale_local_gradients=scale)
        return [g.numpy().ravel().tolist() for g in tape.gradient(loss, [first.kernel, second.kernel])]
    return case


GRADS["partial"] = _partial("first", True)
GRADS["partial_unscaled"] = _partial("first alone", False)
GRADS["partial_none"] = _partial("none", True)


@grad
def local_and_global_gradients(hvd, r, n):
    first, second, x = _two_layers(r)
    with tf.GradientTape(persistent=True) as tape:
        loss = tf.reduce_sum(second(first(x)))
    tape = hvd.DistributedGradientTape(tape)
    tape.register_local_source(second.kernel)
    local, everywhere = tape.get_local_and_global_gradients(loss, [first.kernel, second.kernel])
    return ([(v.path, g.numpy().ravel().tolist()) for v, g in local],
            [(v.path, g.numpy().ravel().tolist()) for v, g in everywhere], [first.kernel.path, second.kernel.path])


@grad
def tape_as_its_own_context_manager(hvd, r, n):
    first, _, x = _two_layers(r)
    with hvd.DistributedGradientTape(tf.GradientTape()) as tape:  # usable as the context manager itself
        loss = tf.reduce_sum(first(x))
    return tape.gradient(loss, [first.kernel])[0].numpy().ravel().tolist()


@grad
def local_layers_that_are_not_layers(hvd, r, n):
    first, _, _ = _two_layers(r)
    return error_of(lambda: hvd.PartialDistributedGradientTape(tf.GradientTape(), local_layers=[first, "x"]))


@grad
def predivide_with_sum(hvd, r, n):
    return error_of(lambda: hvd.DistributedGradientTape(tf.GradientTape(), op=hvd.Sum, gradient_predivide_factor=2.0))


# ---- SyncBatchNormalization on uneven batches (rank r: 3 + 2r rows) --------------------------------------------

def _bn_data():
    data = [np.arange((3 + 2 * k) * 2, dtype=np.float32).reshape(-1, 2) * (k + 1) + k for k in range(2)]
    weights = [np.arange(d.size, dtype=np.float32).reshape(d.shape) % 3 + 1 for d in data]
    return data, weights


@grad
def sync_batch_normalization(hvd, r, n):
    data, weights = _bn_data()
    mine = tf.constant(data[r])
    sync = hvd.SyncBatchNormalization(momentum=0.5)
    with tf.GradientTape() as tape:
        tape.watch(mine)
        y = sync(mine, training=True)
        loss = tf.reduce_sum(y * weights[r])
    out = {"training": (y.numpy(), tape.gradient(loss, mine).numpy(), sync.moving_mean.numpy(),
                        sync.moving_variance.numpy(), sync.name)}

    @tf.function
    def bn_graph(t):
        return sync(t, training=True)

    out["graph"] = bn_graph(mine).numpy()
    out["inference"] = sync(mine, training=False).numpy()
    return out


@grad
def sync_batch_normalization_fused(hvd, r, n):
    return error_of(lambda: hvd.SyncBatchNormalization(fused=True))


def _gradients():
    import sparkhvd.collective.tensorflow as hvd

    hvd.init()
    return run_cases(GRADS, hvd, hvd.rank(), hvd.size())


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return tf_ranks("gradients", tmp_path_factory)[0]  # _gradients, in the ranks the TF modules share


# Horovod 0.28's convention (kept on purpose): allgather and broadcast average the ranks' gradients, reducescatter's
# is the gathered gradient, times size() for Sum

def test_allreduce_sum_gradient(ranks):
    for v in values(ranks, "allreduce_sum"):
        np.testing.assert_array_equal(v, [3.0, 3.0])  # sum over ranks of (r + 1)


def test_allgather_gradient(ranks):
    for v in values(ranks, "allgather"):
        np.testing.assert_array_equal(v, [1.5] * 5)  # every rank's loss reads every row


def test_allgather_gradient_in_tf_function_does_not_race(ranks):
    for v in values(ranks, "allgather_in_tf_function_five_times"):
        np.testing.assert_array_equal(v, [[1.5] * 5] * 5)


def test_broadcast_gradient_goes_to_the_root(ranks):
    for r, v in enumerate(values(ranks, "broadcast")):
        np.testing.assert_array_equal(v, [1.5 if r == 1 else 0.0] * 5)  # the root gets it all


@pytest.mark.parametrize("name", ["alltoall", "alltoall_in_tf_function"])
def test_alltoall_gradient_returns_to_the_sender(ranks, name):
    sent_to = [k + 1.0 for k in range(2) for _ in range(k + 1)]  # rows sent to rank k carry k + 1
    for v in values(ranks, name):
        np.testing.assert_array_equal(v, sent_to)


@pytest.mark.parametrize("name, expected", named(("reducescatter_sum", [2.0, 2.0, 2.0, 4.0, 4.0]),  # owner's weight x 2
                                                 ("reducescatter_average", [1.0, 1.0, 1.0, 2.0, 2.0]),
                                                 ("reducescatter_scaled", [3.0, 3.0, 3.0, 6.0, 6.0])))
def test_reducescatter_gradient(ranks, name, expected):
    for v in values(ranks, name):
        np.testing.assert_array_equal(v, expected)


def test_grouped_allgather_gradient(ranks):
    # Horovod's gradient: this rank's rows of the average over ranks; the loss weights rank k's sum by k + 1
    # (first tensor) and squares the second (d/db = 2 * gathered b, the same on every rank)
    for r, v in enumerate(values(ranks, "grouped_allgather")):
        assert v == [[[1.5, 1.5]] * (r + 1), [2.0, 4.0]]


@pytest.mark.parametrize("name", ["grouped_allreduce", "grouped_allreduce_in_a_tf1_graph"])
def test_grouped_allreduce_gradient(ranks, name):
    assert values(ranks, name) == [[[2.0, 2.0], [[2.0]]]] * 2  # Sum over 2 ranks: the summed upstream gradients


def test_grouped_allreduce_gradient_in_tf_function(ranks):
    # prescale 0.5, upstream (r + 1) summed over ranks = 3, and 2 for the second tensor
    assert values(ranks, "grouped_allreduce_in_tf_function") == [[[1.5, 1.5], [[1.0]]]] * 2


def test_broadcast_gradient_in_a_tf1_graph(ranks):
    # the average of the upstream gradients (1 and 2) on the root, zeros elsewhere
    assert values(ranks, "broadcast_in_a_tf1_graph") == [[[1.5, 1.5], [0.0, 0.0]], [[0.0, 0.0], [1.5, 1.5]]]


@pytest.mark.parametrize("name, expected", named(("tape_average", [1.5, 1.5]), ("tape_sum", [3.0, 3.0]),
                                                 ("tape_in_tf_function", [1.5, 1.5])))
def test_distributed_gradient_tape(ranks, name, expected):
    for v in values(ranks, name):
        np.testing.assert_array_equal(v, expected)


def test_distributed_gradient_tape_refuses_max(ranks):
    assert values(ranks, "tape_with_max") == [
        "DistributedGradientTape reduces with op=hvd.Average, hvd.Sum or hvd.Adasum, got Max."] * 2


@pytest.mark.parametrize("name, kind", [("tape_sparse", "IndexedSlices"), ("tape_sparse_as_dense", "EagerTensor")])
def test_sparse_gradients_through_the_tape(ranks, name, kind):
    assert values(ranks, name) == [(kind, [[0.5, 0.5], [1.0, 1.0], [0.0, 0.0]])] * 2


@pytest.mark.parametrize("name, local", named(("partial", lambda own: own / 2),  # local: own gradient / size
                                              ("partial_unscaled", lambda own: own), ("partial_none", lambda own: 1.5)))
def test_partial_distributed_gradient_tape(ranks, name, local):
    for r, v in enumerate(values(ranks, name)):
        assert v == [[local(r + 1.0)], [1.5]]  # global: averaged


def test_local_and_global_gradients_of_a_registered_local_source(ranks):
    for r, (local, everywhere, (first, second)) in enumerate(values(ranks, "local_and_global_gradients")):
        assert local == [(second, [(r + 1.0) / 2])] and everywhere == [(first, [1.5])]


def test_the_tape_is_its_own_context_manager(ranks):
    assert values(ranks, "tape_as_its_own_context_manager") == [[1.5]] * 2


def test_local_layers_must_be_keras_layers(ranks):
    assert values(ranks, "local_layers_that_are_not_layers") == [(
        "ValueError", "local_layers must be Keras layers, got str; pass the model's layers (for example "
        "model.layers[:2]).")] * 2


def test_gradient_predivide_factor_needs_average(ranks):
    assert values(ranks, "predivide_with_sum") == [(
        "ValueError", "gradient_predivide_factor=2.0 splits an average, but op is Sum; use op=hvd.Average, or leave "
        "gradient_predivide_factor at 1.0.")] * 2


@pytest.fixture(scope="module")
def batch_norm_on_every_row():
    """BatchNormalization on both ranks' rows in this process: outputs, input gradient and moving statistics."""
    import keras

    data, weights = _bn_data()
    everything = tf.constant(np.concatenate(data))
    bn = keras.layers.BatchNormalization(momentum=0.5)
    with tf.GradientTape() as tape:
        tape.watch(everything)
        y = bn(everything, training=True)
        loss = tf.reduce_sum(y * np.concatenate(weights))
    return y.numpy(), tape.gradient(loss, everything).numpy(), bn.moving_mean.numpy(), bn.moving_variance.numpy()


def test_sync_batch_normalization_equals_batch_norm_on_all_rows(ranks, batch_norm_on_every_row):
    y, grad, moving_mean, moving_variance = batch_norm_on_every_row
    rows = [slice(0, 3), slice(3, 8)]
    for r, v in enumerate(values(ranks, "sync_batch_normalization")):
        out, g, mean, var, name = v["training"]
        np.testing.assert_allclose(out, y[rows[r]], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(g, grad[rows[r]], rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(mean, moving_mean, rtol=1e-6)
        np.testing.assert_allclose(var, moving_variance, rtol=1e-5)
        assert name == "sync_batch_normalization"


def test_sync_batch_normalization_in_tf_function_equals_eager(ranks):
    for v in values(ranks, "sync_batch_normalization"):
        np.testing.assert_allclose(v["graph"], v["training"][0], rtol=1e-5, atol=1e-5)


def test_sync_batch_normalization_at_inference_uses_the_moving_statistics(ranks):
    for v in values(ranks, "sync_batch_normalization"):
        assert not np.allclose(v["inference"], v["training"][0])  # the moving statistics, not the batch's


def test_sync_batch_normalization_refuses_a_fused_kernel(ranks):
    assert values(ranks, "sync_batch_normalization_fused") == [(
        "ValueError", "SyncBatchNormalization(fused=True): a fused kernel cannot share statistics across ranks; leave "
        "fused=False.")] * 2
