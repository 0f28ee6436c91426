"""The rest of Horovod's TensorFlow API at np=2, in one pair of rank processes: graph-time topology
ops, ``hvd.util``, in-place broadcast, object broadcast, grouped allgather, sparse gradients
(tf.IndexedSlices), grouped allreduce's gradient, PartialDistributedGradientTape and
SyncBatchNormalization. Inputs come from the rank; expected values are exact."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

from sparkhvd import HorovodRunner  # noqa: E402


def _errors(calls):
    out = {}
    for key, call in calls.items():
        try:
            call()
        except Exception as exc:  # noqa: BLE001 - the test compares type and message
            out[key] = (type(exc).__name__, str(exc))
    return out


def _in_session(build):
    """Run ``build()``'s tensor in a TF1 graph and session."""
    with tf.Graph().as_default():
        out = build()
        with tf.compat.v1.Session() as session:
            return session.run(out)


def _topology_and_broadcasts(hvd, r):
    out = {}
    ps = hvd.add_process_set([0])
    traced = {}

    @tf.function
    def graph_ops():
        traced["eager"] = (hvd.util._executing_eagerly(), hvd._executing_eagerly())
        return (hvd.rank_op(), hvd.local_rank_op(), hvd.size_op(), hvd.local_size_op(),
                hvd.process_set_included_op(), hvd.process_set_included_op(ps), hvd.size_op(ps))

    out["ops_eager"] = [int(t) for t in (hvd.rank_op(), hvd.local_rank_op(), hvd.size_op(), hvd.local_size_op(),
                                         hvd.process_set_included_op(), hvd.process_set_included_op(ps),
                                         hvd.size_op(process_set_id=ps))]
    out["ops_graph"] = [int(t) for t in graph_ops()]
    out["ops_dtype"] = hvd.rank_op().dtype.name
    out["eagerly"] = (hvd.util._executing_eagerly(), traced["eager"])
    hvd.remove_process_set(ps)
    v = tf.Variable(1.0)
    out["refs"] = hvd.util.refs_to_vars(hvd.util.vars_to_refs([v, [v]])) == [v, [v]]

    import keras

    floats = tf.Variable([float(r), r + 0.5])
    ints = tf.Variable([[r, 2 * r]], dtype=tf.int32)
    flags = tf.Variable([r == 0, r == 1])
    kvar = keras.Variable(np.full([2], float(r)))  # a Keras 3 variable wraps a tf.Variable
    returned = hvd.broadcast_([floats, ints, flags, kvar], root_rank=1)
    out["inplace"] = ([t.numpy().tolist() for t in returned],
                      [x.numpy().tolist() for x in (floats, ints, flags, kvar)])
    graph_var = tf.Variable([r, r + 1.0])

    @tf.function
    def inplace_graph():
        return hvd.broadcast_([graph_var], root_rank=0)[0]

    out["inplace_graph"] = (inplace_graph().numpy().tolist(), graph_var.numpy().tolist())
    many = [tf.Variable(tf.fill([3], float(r))), tf.Variable(r * 10)]
    hvd.broadcast_variables(many, root_rank=1, inplace=True)
    out["variables_inplace"] = [m.numpy().tolist() for m in many]
    with tf.Graph().as_default():  # TF1: the op to run, over every global variable
        global_var = tf.compat.v1.Variable([float(r), 2.0 * r])
        op = hvd.broadcast_global_variables(1)
        with tf.compat.v1.Session() as session:
            session.run(tf.compat.v1.global_variables_initializer())
            session.run(op)
            out["global_variables_graph"] = session.run(global_var).tolist()
    out["object_fn"] = hvd.broadcast_object_fn(root_rank=1)({"r": r})
    out["object_session_arg"] = hvd.broadcast_object({"r": r}, 1, None)  # Horovod's (obj, root_rank, session)
    out["allgather_object"] = hvd.allgather_object(r, None)
    out["errors"] = _errors({
        "broadcast_tensor": lambda: hvd.broadcast_([tf.constant(1.0)], 0),
        "size_op_id": lambda: hvd.size_op(process_set_id=5),
        "global_eager": lambda: hvd.broadcast_global_variables(0),
    })
    return out


def _grouped_and_sparse(hvd, r):
    out = {}
    pieces = [tf.fill([r + 1, 2], r), tf.constant([r + 0.5])]
    out["grouped_allgather"] = [t.numpy().tolist() for t in hvd.grouped_allgather(pieces)]

    @tf.function
    def gather_graph():
        return hvd.grouped_allgather(pieces)

    out["grouped_allgather_graph"] = [t.numpy().tolist() for t in gather_graph()]
    a, b = tf.Variable(tf.ones([r + 1, 2])), tf.Variable([1.0, 2.0])
    with tf.GradientTape() as tape:
        ga, gb = hvd.grouped_allgather([a, b])
        loss = tf.reduce_sum(ga) * (r + 1.0) + tf.reduce_sum(gb * gb)
    out["grouped_allgather_grad"] = [g.numpy().tolist() for g in tape.gradient(loss, [a, b])]

    # Rank r holds row r of a [3, 2] tensor, with value r + 1.
    slices = tf.IndexedSlices(tf.fill([1, 2], r + 1.0), tf.constant([r]), dense_shape=tf.constant([3, 2]))
    summed = hvd.allreduce(slices, op=hvd.Sum)
    averaged = hvd.allreduce(slices)
    out["sparse"] = [(type(t).__name__, t.values.numpy().tolist(), t.indices.numpy().tolist(),
                      t.dense_shape.numpy().tolist()) for t in (summed, averaged)]
    mixed = hvd.grouped_allreduce([slices, tf.constant([r + 1.0]), slices], op=hvd.Sum)
    out["sparse_grouped"] = [(type(t).__name__, tf.convert_to_tensor(t).numpy().tolist()) for t in mixed]

    @tf.function
    def sparse_graph():
        s = hvd.grouped_allreduce([slices, tf.constant([r + 1.0])])
        return tf.convert_to_tensor(s[0]), s[1]

    out["sparse_graph"] = [t.numpy().tolist() for t in sparse_graph()]
    emb = tf.Variable(tf.zeros([3, 2]))
    for key, dense in (("tape_sparse", False), ("tape_sparse_as_dense", True)):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.gather(emb, [r]) * (r + 1.0))  # an IndexedSlices gradient
        g = hvd.DistributedGradientTape(tape, sparse_as_dense=dense).gradient(loss, [emb])[0]
        out[key] = (type(g).__name__, tf.convert_to_tensor(g).numpy().tolist())

    # grouped_allreduce's gradient, eagerly, in tf.function and in a TF1 graph (tf.gradients)
    x, y = tf.Variable([1.0, 2.0]), tf.Variable([[3.0]], dtype=tf.float64)
    with tf.GradientTape(persistent=True) as tape:
        sx, sy = hvd.grouped_allreduce([x, y], op=hvd.Sum)
    out["grouped_grad"] = [tape.gradient(sx, x).numpy().tolist(), tape.gradient(sy, y).numpy().tolist()]

    @tf.function
    def grouped_grad_graph():
        with tf.GradientTape() as tape:
            sx, sy = hvd.grouped_allreduce([x, y], op=hvd.Sum, prescale_factor=0.5)
            loss = tf.reduce_sum(sx) * (r + 1.0) + tf.cast(tf.reduce_sum(sy), tf.float32)
        return tape.gradient(loss, [x, y])

    out["grouped_grad_function"] = [g.numpy().tolist() for g in grouped_grad_graph()]
    with tf.Graph().as_default():
        tensors = [tf.constant([1.0, 2.0]), tf.constant([[3.0]], dtype=tf.float64)]
        reduced = hvd.grouped_allreduce(tensors, op=hvd.Sum)
        grads = [tf.gradients(s, t, tf.ones_like(s))[0] for s, t in zip(reduced, tensors)]
        with tf.compat.v1.Session() as session:
            out["grouped_grad_v1_graph"] = [session.run(g).tolist() for g in grads]  # one collective per run
    with tf.Graph().as_default():  # broadcast's gradient alone: the non-root must still join the allreduce
        t = tf.fill([2], float(r))
        grads = [tf.gradients(hvd.broadcast(t, root), t, tf.fill([2], r + 1.0))[0] for root in (0, 1)]
        with tf.compat.v1.Session() as session:
            out["broadcast_grad_v1_graph"] = [session.run(g).tolist() for g in grads]

    @tf.function
    def independent():  # TF runs these on several threads in any order: they must pair by graph op, not order
        sums = [hvd.allreduce(tf.fill([4], float(i) * (r + 1)), op=hvd.Sum) for i in range(8)]
        scattered = hvd.grouped_reducescatter([tf.fill([4], float(i) * (r + 1)) for i in range(4)], op=hvd.Sum)
        return sums, scattered

    sums, scattered = independent()
    out["graph_independent"] = ([s.numpy().tolist() for s in sums], [s.numpy().tolist() for s in scattered])
    one = tf.IndexedSlices(tf.ones([1, 3]), tf.constant([r]))
    out["errors"] = _errors({
        "sparse_max": lambda: hvd.allreduce(one, op=hvd.Max),
        "sparse_scaled": lambda: hvd.grouped_allreduce([one], op=hvd.Sum, prescale_factor=0.5),
        # Horovod's TF error types: ranks that disagree, and an argument problem on one rank
        "mismatch": lambda: hvd.allreduce(tf.ones([2 + r])),
        "mismatch_graph": lambda: tf.function(lambda: hvd.allreduce(tf.ones([2 + r])))(),
        "mismatch_session": lambda: _in_session(lambda: hvd.allreduce(tf.ones([2 + r]))),
        "mismatch_dtype_graph": lambda: tf.function(lambda: hvd.broadcast(tf.ones([2], tf.int32 if r else tf.float32),
                                                                          root_rank=0))(),
        "mismatch_after_graph": lambda: tf.function(lambda: hvd.allgather(tf.ones([1, 2 + r])))(),
        "bad_splits": lambda: hvd.alltoall(tf.ones([3 if r else 4])),
        "bad_splits_graph": lambda: tf.function(lambda: hvd.alltoall(tf.ones([3 if r else 4])))(),
    })
    return out


def _tapes_and_batch_norm(hvd, r):
    import keras

    out = {}
    first = keras.layers.Dense(1, use_bias=False, kernel_initializer="ones")
    second = keras.layers.Dense(1, use_bias=False, kernel_initializer="ones")
    x = tf.constant([[r + 1.0]])  # d loss / d each kernel = r + 1
    for key, local, scale in (("partial", [first], True), ("partial_unscaled", first, False),
                              ("partial_none", None, True)):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(second(first(x)))
        tape = hvd.PartialDistributedGradientTape(tape, local_layers=local, scale_local_gradients=scale)
        variables = [first.kernel, second.kernel]
        grads = tape.gradient(loss, variables)
        out[key] = [g.numpy().ravel().tolist() for g in grads]
    with tf.GradientTape(persistent=True) as tape:
        loss = tf.reduce_sum(second(first(x)))
    tape = hvd.DistributedGradientTape(tape)
    tape.register_local_source(second.kernel)
    local, everywhere = tape.get_local_and_global_gradients(loss, [first.kernel, second.kernel])
    out["split"] = ([(v.path, g.numpy().ravel().tolist()) for v, g in local],
                    [(v.path, g.numpy().ravel().tolist()) for v, g in everywhere], [first.kernel.path,
                                                                                   second.kernel.path])
    with hvd.DistributedGradientTape(tf.GradientTape()) as tape:  # usable as the context manager itself
        loss = tf.reduce_sum(first(x))
    out["context"] = tape.gradient(loss, [first.kernel])[0].numpy().ravel().tolist()

    # SyncBatchNormalization on uneven batches (rank r: 3 + 2r rows) against BatchNormalization on all rows.
    data = [np.arange((3 + 2 * k) * 2, dtype=np.float32).reshape(-1, 2) * (k + 1) + k for k in range(2)]
    weights = [np.arange(d.size, dtype=np.float32).reshape(d.shape) % 3 + 1 for d in data]
    mine = tf.constant(data[r])
    sync = hvd.SyncBatchNormalization(momentum=0.5)
    with tf.GradientTape() as tape:
        tape.watch(mine)
        y = sync(mine, training=True)
        loss = tf.reduce_sum(y * weights[r])
    out["bn"] = (y.numpy(), tape.gradient(loss, mine).numpy(), sync.moving_mean.numpy(),
                 sync.moving_variance.numpy(), sync.name)

    @tf.function
    def bn_graph(t):
        return sync(t, training=True)

    out["bn_graph"] = bn_graph(mine).numpy()
    out["bn_inference"] = sync(mine, training=False).numpy()
    out["errors"] = _errors({
        "bn_fused": lambda: hvd.SyncBatchNormalization(fused=True),
        "local_layers": lambda: hvd.PartialDistributedGradientTape(tf.GradientTape(), local_layers=[first, "x"]),
        "predivide_sum": lambda: hvd.DistributedGradientTape(tf.GradientTape(), op=hvd.Sum,
                                                             gradient_predivide_factor=2.0),
    })
    return out


def _join(hvd, r):
    """Rank 1 joins at once; rank 0 reduces alone (rank 1 stands in with zeros), then joins last."""
    out = {}
    if r == 0:
        out["while_joined"] = hvd.allreduce(tf.constant([3.0]), op=hvd.Sum).numpy().tolist()
    joined = hvd.join()
    out["eager"] = (joined.dtype.name, joined.shape.rank, int(joined))
    if r == 1:  # in a graph, rank 0 joins first this time
        out["while_joined"] = hvd.allreduce(tf.constant([4.0]), op=hvd.Sum).numpy().tolist()
    out["graph"] = int(tf.function(hvd.join)())
    return out


def _api():
    import sparkhvd.collective.tensorflow as hvd

    hvd.init()
    r = hvd.rank()
    return {**{f"a.{k}": v for k, v in _topology_and_broadcasts(hvd, r).items()},
            **{f"b.{k}": v for k, v in _grouped_and_sparse(hvd, r).items()},
            **{f"c.{k}": v for k, v in _tapes_and_batch_norm(hvd, r).items()},
            **{f"d.{k}": v for k, v in _join(hvd, r).items()}}


@pytest.fixture(scope="module")
def ranks():
    return HorovodRunner(np=-2).run_all(_api).values


def test_topology_ops_read_at_run_time_and_util(ranks):
    for r, v in enumerate(ranks):
        expected = [r, r, 2, 2, 1, 1 if r == 0 else 0, 1]
        assert v["a.ops_eager"] == expected and v["a.ops_graph"] == expected
        assert v["a.ops_dtype"] == "int32"
        assert v["a.eagerly"] == (True, (False, False))
        assert v["a.refs"] is True
        assert v["a.errors"]["size_op_id"] == (
            "ValueError", "size_op(process_set_id=5): sparkhvd finds a process set by its object, not its id; pass "
            "the ProcessSet itself (size_op(process_set_id=my_set)), or 0 for every rank.")


def test_inplace_broadcast_and_object_broadcast(ranks):
    for r, v in enumerate(ranks):
        root = [[1.0, 1.5], [[1, 2]], [False, True], [1.0, 1.0]]
        assert v["a.inplace"] == (root, root)  # returned values, and the variables themselves
        assert v["a.inplace_graph"] == ([0.0, 1.0], [0.0, 1.0])
        assert v["a.variables_inplace"] == [[1.0, 1.0, 1.0], 10]
        assert v["a.global_variables_graph"] == [1.0, 2.0]
        assert v["a.errors"]["global_eager"] == (
            "RuntimeError", "hvd.broadcast_global_variables() needs a TF1 graph, but TensorFlow is executing eagerly; "
            "use hvd.broadcast_variables(model.variables, root_rank) instead.")
        assert v["a.object_fn"] == {"r": 1} and v["a.object_session_arg"] == {"r": 1}
        assert v["a.allgather_object"] == [0, 1]
        assert v["a.errors"]["broadcast_tensor"] == (
            "TypeError", "broadcast_ assigns tf.Variables in place, got EagerTensor; use hvd.broadcast(tensor, "
            "root_rank) for a tensor.")


def test_grouped_allgather_and_its_gradient(ranks):
    for r, v in enumerate(ranks):
        gathered = [[[0, 0], [1, 1], [1, 1]], [0.5, 1.5]]
        assert v["b.grouped_allgather"] == gathered and v["b.grouped_allgather_graph"] == gathered
        # Horovod's gradient: this rank's rows of the average over ranks; the loss weights rank k's sum by k + 1
        # (first tensor) and squares the second (d/db = 2 * gathered b, the same on every rank)
        assert v["b.grouped_allgather_grad"] == [[[1.5, 1.5]] * (r + 1), [2.0, 4.0]]


def test_indexed_slices_are_allgathered(ranks):
    for v in ranks:
        summed, averaged = v["b.sparse"]
        assert summed == ("IndexedSlices", [[1.0, 1.0], [2.0, 2.0]], [0, 1], [3, 2])
        assert averaged == ("IndexedSlices", [[0.5, 0.5], [1.0, 1.0]], [0, 1], [3, 2])
        dense = [[1.0, 1.0], [2.0, 2.0], [0.0, 0.0]]
        assert v["b.sparse_grouped"] == [("IndexedSlices", dense), ("EagerTensor", [3.0]), ("IndexedSlices", dense)]
        assert v["b.sparse_graph"] == [[[0.5, 0.5], [1.0, 1.0], [0.0, 0.0]], [1.5]]
        averaged_dense = [[0.5, 0.5], [1.0, 1.0], [0.0, 0.0]]
        assert v["b.tape_sparse"] == ("IndexedSlices", averaged_dense)
        assert v["b.tape_sparse_as_dense"] == ("EagerTensor", averaged_dense)
        assert v["b.errors"]["sparse_max"] == (
            "NotImplementedError", "allreduce of tf.IndexedSlices supports op=hvd.Average or hvd.Sum, got Max; pass "
            "sparse_as_dense=True (or tf.convert_to_tensor the slices) to reduce them as a dense tensor with Max.")
        assert v["b.errors"]["sparse_scaled"] == (
            "NotImplementedError", "grouped_allreduce of tf.IndexedSlices does not scale (got prescale_factor=0.5, "
            "postscale_factor=1.0); multiply the slices' values yourself, or convert them to a dense tensor first.")


def test_grouped_allreduce_gradient_in_every_mode(ranks):
    for v in ranks:
        assert v["b.grouped_grad"] == [[2.0, 2.0], [[2.0]]]  # Sum over 2 ranks: the summed upstream gradients
        assert v["b.grouped_grad_v1_graph"] == [[2.0, 2.0], [[2.0]]]
        # prescale 0.5, upstream (r + 1) summed over ranks = 3, and 2 for the second tensor
        assert v["b.grouped_grad_function"] == [[1.5, 1.5], [[1.0]]]
    # broadcast's gradient: the average of the upstream gradients (1 and 2) on the root, zeros elsewhere
    assert [v["b.broadcast_grad_v1_graph"] for v in ranks] == [[[1.5, 1.5], [0.0, 0.0]], [[0.0, 0.0], [1.5, 1.5]]]


def test_partial_distributed_gradient_tape(ranks):
    for r, v in enumerate(ranks):
        own = r + 1.0
        assert v["c.partial"] == [[own / 2], [1.5]]  # local: own gradient / size; global: averaged
        assert v["c.partial_unscaled"] == [[own], [1.5]]
        assert v["c.partial_none"] == [[1.5], [1.5]]
        local, everywhere, (first, second) = v["c.split"]
        assert local == [(second, [own / 2])] and everywhere == [(first, [1.5])]
        assert v["c.context"] == [1.5]
        assert v["c.errors"]["local_layers"] == (
            "ValueError", "local_layers must be Keras layers, got str; pass the model's layers (for example "
            "model.layers[:2]).")
        assert v["c.errors"]["predivide_sum"] == (
            "ValueError", "gradient_predivide_factor=2.0 splits an average, but op is Sum; use op=hvd.Average, or "
                          "leave gradient_predivide_factor at 1.0.")


def test_sync_batch_normalization_equals_batch_norm_on_all_rows(ranks):
    import keras

    data = [np.arange((3 + 2 * k) * 2, dtype=np.float32).reshape(-1, 2) * (k + 1) + k for k in range(2)]
    weights = [np.arange(d.size, dtype=np.float32).reshape(d.shape) % 3 + 1 for d in data]
    everything = tf.constant(np.concatenate(data))
    bn = keras.layers.BatchNormalization(momentum=0.5)
    with tf.GradientTape() as tape:
        tape.watch(everything)
        y = bn(everything, training=True)
        loss = tf.reduce_sum(y * np.concatenate(weights))
    grad = tape.gradient(loss, everything).numpy()
    rows = [slice(0, 3), slice(3, 8)]
    for r, v in enumerate(ranks):
        out, g, mean, var, name = v["c.bn"]
        np.testing.assert_allclose(out, y.numpy()[rows[r]], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(g, grad[rows[r]], rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(mean, bn.moving_mean.numpy(), rtol=1e-6)
        np.testing.assert_allclose(var, bn.moving_variance.numpy(), rtol=1e-5)
        assert name == "sync_batch_normalization"
        np.testing.assert_allclose(v["c.bn_graph"], out, rtol=1e-5, atol=1e-5)
        assert not np.allclose(v["c.bn_inference"], out)  # the moving statistics, not the batch's
        assert v["c.errors"]["bn_fused"] == (
            "ValueError", "SyncBatchNormalization(fused=True): a fused kernel cannot share statistics across ranks; "
            "leave fused=False.")


def test_join_returns_the_rank_that_joined_last_as_a_tensor(ranks):
    assert [v["d.while_joined"] for v in ranks] == [[3.0], [4.0]]
    for v in ranks:
        assert v["d.eager"] == ("int32", 0, 0) and v["d.graph"] == 1


def test_tensorflow_and_keras_stand_on_the_core_not_on_the_torch_api():
    code = ("import sys, sparkhvd.collective.keras, sparkhvd.collective.tensorflow.keras\n"
            "print(sorted(m for m in sys.modules if m.startswith('sparkhvd.collective.')"
            " and m.split('.')[2] in ('torch', '_core')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env=dict(os.environ))
    loaded = out.stdout.strip()
    assert "sparkhvd.collective._core" in loaded and "sparkhvd.collective.torch" not in loaded, out.stderr[-2000:]


def test_keras_callbacks_namespace_as_in_horovod():
    code = ("import sparkhvd.collective.keras as k, sparkhvd.collective.tensorflow.keras as tk\n"
            "from sparkhvd.collective.tensorflow.keras.callbacks import MetricAverageCallback\n"
            "names = ['BroadcastGlobalVariablesCallback', 'MetricAverageCallback', 'LearningRateWarmupCallback', "
            "'LearningRateScheduleCallback', 'BestModelCheckpoint']\n"
            "print(all(getattr(k.callbacks, n) is getattr(k, n) is getattr(tk.callbacks, n) for n in names), "
            "MetricAverageCallback is k.MetricAverageCallback, tk.DistributedOptimizer is k.DistributedOptimizer)\n"
            "import sparkhvd.collective.tensorflow as t, sparkhvd.collective.torch as th\n"
            "print(k.start_timeline is t.start_timeline is th.start_timeline, k.stop_timeline is t.stop_timeline)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env=dict(os.environ))
    assert out.stdout.split() == ["True"] * 5, out.stderr[-2000:]


def test_failures_are_horovods_tensorflow_errors(ranks):
    for v in ranks:
        errors = v["b.errors"]
        for key in ("mismatch", "mismatch_graph", "mismatch_session"):
            kind, text = errors[key]
            # in a graph too (tf.function, TF1 session), although a py_function alone would make it UnknownError
            assert kind == "FailedPreconditionError", errors[key]
            assert "UnknownError" not in text and "Traceback" not in text, text
            assert ": rank 0: allreduce(op=Average: float32[2] on cpu); rank 1: allreduce(op=Average: float32[3] " \
                   "on cpu). Every rank must call" in text, text  # eager: the n-th unnamed allreduce; in a graph:
            # named after its graph op
        kind, text = errors["mismatch_dtype_graph"]
        assert kind == "FailedPreconditionError", errors["mismatch_dtype_graph"]
        assert "rank 0: broadcast(root_rank=0: float32[2] on cpu); rank 1: broadcast(root_rank=0: int32[2] on cpu)" \
               in text, text
        kind, text = errors["mismatch_after_graph"]  # the next graph's collective after a failed one
        assert kind == "FailedPreconditionError", errors["mismatch_after_graph"]
        assert "rank 0: allgather(float32[*, 2] on cpu); rank 1: allgather(float32[*, 3] on cpu)" in text, text
        for key in ("bad_splits", "bad_splits_graph"):  # in a graph too
            kind, text = errors[key]
            assert kind == "InvalidArgumentError", errors[key]
            assert "rank 1: alltoall without splits needs the first dimension (3) to be divisible by the number " \
                   "of ranks (2)" in text, text


def test_independent_ops_in_a_graph_pair_by_graph_op(ranks):
    for v in ranks:
        sums, scattered = v["b.graph_independent"]
        assert sums == [[3.0 * i] * 4 for i in range(8)]  # i * (1 + 2) on both ranks
        assert scattered == [[3.0 * i] * 2 for i in range(4)]
