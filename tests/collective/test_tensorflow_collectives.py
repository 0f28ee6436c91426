"""Horovod's TensorFlow collectives at np=2, in one pair of rank processes: eager, in tf.function and in TF1
graphs, exact values, static shapes, graph-time topology ops, ``hvd.util``, in-place and object broadcasts, grouped
allgather, sparse tensors (tf.IndexedSlices), join, and failures raised as Horovod's TensorFlow errors. One case per
op (tests/_cases.py), one test per case; inputs come from the rank."""

from __future__ import annotations

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

from _cases import add_to, error_of, named, rows_to_each, run_cases, values  # noqa: E402
from _tf_ranks import tf_ranks  # noqa: E402

OPS: dict = {}
op = add_to(OPS)



def _in_session(build):
    """Run ``build()``'s tensor in a TF1 graph and session."""
    with tf.Graph().as_default():
        out = build()
        with tf.compat.v1.Session() as session:
            return session.run(out)


def _x(r):
    return tf.constant([1.0, 2.0, 3.0]) + r



# ---- eager ops ------------------------------------------------------------------------------------------------

@op
def topology(hvd, r, n):
    return hvd.rank(), hvd.size(), hvd.local_rank()


@op
def allreduce_sum(hvd, r, n):
    return hvd.allreduce(_x(r), op=hvd.Sum).numpy()


@op
def allreduce_average(hvd, r, n):
    return hvd.allreduce(_x(r)).numpy()


@op
def allreduce_int(hvd, r, n):
    return hvd.allreduce(tf.constant([1, 2]) * (r + 1), op=hvd.Sum).numpy()


@op
def allreduce_bfloat16(hvd, r, n):
    return hvd.allreduce(tf.constant([1.0, 2.0], dtype=tf.bfloat16) * (r + 1), op=hvd.Sum)


@op
def allreduce_fp16_compression(hvd, r, n):
    return hvd.allreduce(_x(r), op=hvd.Sum, compression=hvd.Compression.fp16)


@op
def broadcast(hvd, r, n):
    return hvd.broadcast(tf.constant([r, r]), root_rank=1).numpy()


@op
def allgather(hvd, r, n):
    return hvd.allgather(tf.fill([r + 1, 2], r)).numpy()


@op
def grouped_allreduce(hvd, r, n):
    return [t.numpy() for t in hvd.grouped_allreduce([_x(r), tf.constant([r])], op=hvd.Sum)]


@op
def alltoall_even(hvd, r, n):
    return hvd.alltoall(tf.range(2 * n) + 100 * r).numpy()


@op
def alltoall_splits(hvd, r, n):
    splits = rows_to_each(n)
    sent, received = hvd.alltoall(tf.fill([sum(splits), 2], r), splits=splits)
    return sent.numpy(), received.numpy(), received.dtype


@op
def reducescatter_sum(hvd, r, n):
    rows = 2 * n + 1  # uneven: rank 0 gets the extra row
    return hvd.reducescatter(tf.reshape(tf.range(rows * 2.0), [rows, 2]) + r, op=hvd.Sum).numpy()


@op
def reducescatter_average(hvd, r, n):
    return hvd.reducescatter(tf.ones([2 * n + 1]) * (r + 1)).numpy()


@op
def broadcast_variables(hvd, r, n):
    variables = [tf.Variable(np.full([2], float(r))), tf.Variable(r + 10)]
    hvd.broadcast_variables(variables, root_rank=1)
    return [v.numpy() for v in variables]


@op
def broadcast_object(hvd, r, n):
    return hvd.broadcast_object({"r": r}, root_rank=1)


# ---- in tf.function ------------------------------------------------------------------------------------------

@op
def in_tf_function(hvd, r, n):
    static = {}

    @tf.function
    def graph(v):
        s = hvd.allreduce(v, op=hvd.Sum)
        g = hvd.allgather(tf.reshape(v, [-1, 1]))
        b = hvd.broadcast(v, root_rank=0)
        static["s"], static["g"] = s.shape.as_list(), g.shape.as_list()  # while tracing
        return s, g, b

    s, g, b = graph(_x(r))
    return s.numpy(), g.numpy(), b.numpy(), static["s"], static["g"]


@op
def alltoall_reducescatter_grouped_in_tf_function(hvd, r, n):
    splits, rows, static = rows_to_each(n), 2 * n + 1, {}

    @tf.function
    def graph_more(v):
        sent, received = hvd.alltoall(tf.fill([sum(splits), 2], r), splits=splits)
        scattered = hvd.reducescatter(tf.reshape(tf.range(rows * 2.0), [rows, 2]) + r, op=hvd.Sum)
        grouped = hvd.grouped_allreduce([v, tf.constant([r])], op=hvd.Sum)
        static["more"] = [t.shape.as_list() for t in (sent, received, scattered, *grouped)]
        return sent, received, scattered, grouped

    sent, received, scattered, grouped = graph_more(_x(r))
    return sent.numpy(), received.numpy(), scattered.numpy(), [t.numpy() for t in grouped], static["more"]


@op
def independent_ops_in_a_graph(hvd, r, n):
    @tf.function
    def independent():  # TF runs these on several threads in any order: they must pair by graph op, not order
        sums = [hvd.allreduce(tf.fill([4], float(i) * (r + 1)), op=hvd.Sum) for i in range(8)]
        scattered = hvd.grouped_reducescatter([tf.fill([4], float(i) * (r + 1)) for i in range(4)], op=hvd.Sum)
        return sums, scattered

    sums, scattered = independent()
    return [s.numpy().tolist() for s in sums], [s.numpy().tolist() for s in scattered]


# ---- topology ops, hvd.util, broadcasts in place and of objects -----------------------------------------------

@op
def topology_ops(hvd, r, n):
    ps = hvd.add_process_set([0])
    traced = {}

    @tf.function
    def graph_ops():
        traced["eager"] = (hvd.util._executing_eagerly(), hvd._executing_eagerly())
        return (hvd.rank_op(), hvd.local_rank_op(), hvd.size_op(), hvd.local_size_op(),
                hvd.process_set_included_op(), hvd.process_set_included_op(ps), hvd.size_op(ps))

    out = {"eager": [int(t) for t in (hvd.rank_op(), hvd.local_rank_op(), hvd.size_op(), hvd.local_size_op(),
                                      hvd.process_set_included_op(), hvd.process_set_included_op(ps),
                                      hvd.size_op(process_set_id=ps))]}
    out["graph"] = [int(t) for t in graph_ops()]
    out["dtype"] = hvd.rank_op().dtype.name
    out["eagerly"] = (hvd.util._executing_eagerly(), traced["eager"])
    hvd.remove_process_set(ps)
    return out


@op
def size_op_of_a_process_set_id(hvd, r, n):
    return error_of(lambda: hvd.size_op(process_set_id=5))


@op
def util_refs_to_vars(hvd, r, n):
    v = tf.Variable(1.0)
    return hvd.util.refs_to_vars(hvd.util.vars_to_refs([v, [v]])) == [v, [v]]


@op
def broadcast_in_place(hvd, r, n):
    import keras

    floats = tf.Variable([float(r), r + 0.5])
    ints = tf.Variable([[r, 2 * r]], dtype=tf.int32)
    flags = tf.Variable([r == 0, r == 1])
    kvar = keras.Variable(np.full([2], float(r)))  # a Keras 3 variable wraps a tf.Variable
    returned = hvd.broadcast_([floats, ints, flags, kvar], root_rank=1)
    return [t.numpy().tolist() for t in returned], [x.numpy().tolist() for x in (floats, ints, flags, kvar)]


@op
def broadcast_in_place_in_tf_function(hvd, r, n):
    graph_var = tf.Variable([r, r + 1.0])

    @tf.function
    def inplace_graph():
        return hvd.broadcast_([graph_var], root_rank=0)[0]

    return inplace_graph().numpy().tolist(), graph_var.numpy().tolist()


@op
def broadcast_variables_in_place(hvd, r, n):
    many = [tf.Variable(tf.fill([3], float(r))), tf.Variable(r * 10)]
    hvd.broadcast_variables(many, root_rank=1, inplace=True)
    return [m.numpy().tolist() for m in many]


@op
def broadcast_global_variables_in_a_tf1_graph(hvd, r, n):
    with tf.Graph().as_default():  # TF1: the op to run, over every global variable
        global_var = tf.compat.v1.Variable([float(r), 2.0 * r])
        op = hvd.broadcast_global_variables(1)
        with tf.compat.v1.Session() as session:
            session.run(tf.compat.v1.global_variables_initializer())
            session.run(op)
            return session.run(global_var).tolist()


@op
def broadcast_object_fn(hvd, r, n):
    return hvd.broadcast_object_fn(root_rank=1)({"r": r})


@op
def broadcast_object_with_a_session_argument(hvd, r, n):
    return hvd.broadcast_object({"r": r}, 1, None)  # Horovod's (obj, root_rank, session)


@op
def allgather_object(hvd, r, n):
    return hvd.allgather_object(r, None)


@op
def broadcast_in_place_of_a_tensor(hvd, r, n):
    return error_of(lambda: hvd.broadcast_([tf.constant(1.0)], 0))


@op
def broadcast_global_variables_eagerly(hvd, r, n):
    return error_of(lambda: hvd.broadcast_global_variables(0))


# ---- grouped allgather and sparse tensors ---------------------------------------------------------------------

def _pieces(r):
    return [tf.fill([r + 1, 2], r), tf.constant([r + 0.5])]


@op
def grouped_allgather(hvd, r, n):
    return [t.numpy().tolist() for t in hvd.grouped_allgather(_pieces(r))]


@op
def grouped_allgather_in_tf_function(hvd, r, n):
    pieces = _pieces(r)

    @tf.function
    def gather_graph():
        return hvd.grouped_allgather(pieces)

    return [t.numpy().tolist() for t in gather_graph()]


def _slices(r):
    # Rank r holds row r of a [3, 2] tensor, with value r + 1.
    return tf.IndexedSlices(tf.fill([1, 2], r + 1.0), tf.constant([r]), dense_shape=tf.constant([3, 2]))


@op
def indexed_slices_allreduce(hvd, r, n):
    slices = _slices(r)
    summed, averaged = hvd.allreduce(slices, op=hvd.Sum), hvd.allreduce(slices)
    return [(type(t).__name__, t.values.numpy().tolist(), t.indices.numpy().tolist(), t.dense_shape.numpy().tolist())
            for t in (summed, averaged)]


@op
def indexed_slices_in_a_grouped_allreduce(hvd, r, n):
    slices = _slices(r)
    mixed = hvd.grouped_allreduce([slices, tf.constant([r + 1.0]), slices], op=hvd.Sum)
    return [(type(t).__name__, tf.convert_to_tensor(t).numpy().tolist()) for t in mixed]


@op
def indexed_slices_in_tf_function(hvd, r, n):
    slices = _slices(r)

    @tf.function
    def sparse_graph():
        s = hvd.grouped_allreduce([slices, tf.constant([r + 1.0])])
        return tf.convert_to_tensor(s[0]), s[1]

    return [t.numpy().tolist() for t in sparse_graph()]


@op
def indexed_slices_with_max(hvd, r, n):
    return error_of(lambda: hvd.allreduce(tf.IndexedSlices(tf.ones([1, 3]), tf.constant([r])), op=hvd.Max))


@op
def indexed_slices_scaled(hvd, r, n):
    one = tf.IndexedSlices(tf.ones([1, 3]), tf.constant([r]))
    return error_of(lambda: hvd.grouped_allreduce([one], op=hvd.Sum, prescale_factor=0.5))


# ---- Horovod's TF error types: ranks that disagree, and an argument problem on one rank ------------------------

_FAILURES = {
    "mismatch": lambda hvd, r: hvd.allreduce(tf.ones([2 + r])),
    "mismatch_graph": lambda hvd, r: tf.function(lambda: hvd.allreduce(tf.ones([2 + r])))(),
    "mismatch_session": lambda hvd, r: _in_session(lambda: hvd.allreduce(tf.ones([2 + r]))),
    "mismatch_dtype_graph": lambda hvd, r: tf.function(lambda: hvd.broadcast(
        tf.ones([2], tf.int32 if r else tf.float32), root_rank=0))(),
    # the next graph's collective after a failed one
    "mismatch_after_graph": lambda hvd, r: tf.function(lambda: hvd.allgather(tf.ones([1, 2 + r])))(),
    "bad_splits": lambda hvd, r: hvd.alltoall(tf.ones([3 if r else 4])),
    "bad_splits_graph": lambda hvd, r: tf.function(lambda: hvd.alltoall(tf.ones([3 if r else 4])))(),
}


def _failure(call):
    def case(hvd, r, n):
        return error_of(lambda: call(hvd, r))
    return case


for _key, _call in _FAILURES.items():
    OPS[_key] = _failure(_call)


@op
def join(hvd, r, n):
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


def _ops():
    import sparkhvd.collective.tensorflow as hvd

    hvd.init()
    return run_cases(OPS, hvd, hvd.rank(), hvd.size())


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return tf_ranks("collectives", tmp_path_factory)[0]  # _ops, in the ranks the TF modules share


def test_topology(ranks):
    assert values(ranks, "topology") == [(0, 2, 0), (1, 2, 1)]


@pytest.mark.parametrize("name, expected", named(("allreduce_sum", [3.0, 5.0, 7.0]),
                                                 ("allreduce_average", [1.5, 2.5, 3.5]),
                                                 ("allreduce_int", [3, 6]), ("broadcast", [1, 1]),
                                                 ("allgather", [[0, 0], [1, 1], [1, 1]])))
def test_eager_ops(ranks, name, expected):
    for v in values(ranks, name):
        np.testing.assert_array_equal(v, expected)


def test_allreduce_of_bfloat16(ranks):
    for v in values(ranks, "allreduce_bfloat16"):
        assert v.dtype == tf.bfloat16 and v.numpy().astype(float).tolist() == [3.0, 6.0]


def test_fp16_compression_keeps_the_dtype(ranks):
    for v in values(ranks, "allreduce_fp16_compression"):
        assert v.dtype == tf.float32 and v.numpy().tolist() == [3.0, 5.0, 7.0]


def test_grouped_allreduce(ranks):
    for v in values(ranks, "grouped_allreduce"):
        np.testing.assert_array_equal(v[0], [3.0, 5.0, 7.0])
        np.testing.assert_array_equal(v[1], [1])


def _total(n, rows):
    return np.arange(rows * 2.0).reshape(rows, 2) * n + sum(range(n))


def _mine(r):
    return slice(0, 3) if r == 0 else slice(3, 5)  # 5 rows: rank 0 takes the extra one


def test_alltoall_without_splits(ranks):
    n = len(ranks)
    for r, v in enumerate(values(ranks, "alltoall_even")):
        np.testing.assert_array_equal(v, [100 * k + 2 * r + j for k in range(n) for j in range(2)])


def test_alltoall_with_splits(ranks):
    n = len(ranks)
    for r, (sent, received, dtype) in enumerate(values(ranks, "alltoall_splits")):
        assert dtype == tf.int32 and received.tolist() == [r + 1] * n
        np.testing.assert_array_equal(sent, np.concatenate([np.full((r + 1, 2), k) for k in range(n)]))


def test_reducescatter_sum(ranks):
    n = len(ranks)
    for r, v in enumerate(values(ranks, "reducescatter_sum")):
        np.testing.assert_array_equal(v, _total(n, 2 * n + 1)[_mine(r)])


def test_reducescatter_average(ranks):
    n = len(ranks)
    for r, v in enumerate(values(ranks, "reducescatter_average")):
        np.testing.assert_array_equal(v, np.full(3 if r == 0 else 2, (n + 1) / 2))


def test_broadcast_variables(ranks):
    for v in values(ranks, "broadcast_variables"):
        np.testing.assert_array_equal(v[0], [1.0, 1.0])
        assert v[1] == 11


def test_broadcast_object(ranks):
    assert values(ranks, "broadcast_object") == [{"r": 1}, {"r": 1}]


def test_ops_inside_tf_function_keep_static_shapes(ranks):
    for s, g, b, s_shape, g_shape in values(ranks, "in_tf_function"):
        np.testing.assert_array_equal(s, [3.0, 5.0, 7.0])
        np.testing.assert_array_equal(g.ravel(), [1.0, 2.0, 3.0, 2.0, 3.0, 4.0])
        np.testing.assert_array_equal(b, [1.0, 2.0, 3.0])
        assert s_shape == [3] and g_shape == [None, 1]


def test_alltoall_reducescatter_and_grouped_allreduce_in_tf_function(ranks):
    n = len(ranks)
    for r, v in enumerate(values(ranks, "alltoall_reducescatter_grouped_in_tf_function")):
        sent, received, scattered, grouped, shapes = v
        np.testing.assert_array_equal(sent, np.concatenate([np.full((r + 1, 2), k) for k in range(n)]))
        assert received.tolist() == [r + 1] * n
        np.testing.assert_array_equal(scattered, _total(n, 2 * n + 1)[_mine(r)])
        np.testing.assert_array_equal(grouped[0], [3.0, 5.0, 7.0])
        np.testing.assert_array_equal(grouped[1], [1])
        assert shapes == [[None, 2], [n], [None, 2], [3], [1]]


def test_independent_ops_in_a_graph_pair_by_graph_op(ranks):
    for sums, scattered in values(ranks, "independent_ops_in_a_graph"):
        assert sums == [[3.0 * i] * 4 for i in range(8)]  # i * (1 + 2) on both ranks
        assert scattered == [[3.0 * i] * 2 for i in range(4)]


def test_topology_ops_are_read_at_run_time(ranks):
    for r, v in enumerate(values(ranks, "topology_ops")):
        expected = [r, r, 2, 2, 1, 1 if r == 0 else 0, 1]
        assert v["eager"] == expected and v["graph"] == expected
        assert v["dtype"] == "int32"
        assert v["eagerly"] == (True, (False, False))


def test_size_op_takes_a_process_set_not_its_id(ranks):
    assert values(ranks, "size_op_of_a_process_set_id") == [(
        "ValueError", "size_op(process_set_id=5): sparkhvd finds a process set by its object, not its id; pass the "
        "ProcessSet itself (size_op(process_set_id=my_set)), or 0 for every rank.")] * 2


def test_util_refs_to_vars(ranks):
    assert values(ranks, "util_refs_to_vars") == [True, True]


def test_broadcast_in_place_returns_and_assigns_every_kind_of_variable(ranks):
    root = [[1.0, 1.5], [[1, 2]], [False, True], [1.0, 1.0]]
    assert values(ranks, "broadcast_in_place") == [(root, root)] * 2  # returned values, and the variables themselves


def test_broadcast_in_place_in_tf_function(ranks):
    assert values(ranks, "broadcast_in_place_in_tf_function") == [([0.0, 1.0], [0.0, 1.0])] * 2


def test_broadcast_variables_in_place(ranks):
    assert values(ranks, "broadcast_variables_in_place") == [[[1.0, 1.0, 1.0], 10]] * 2


def test_broadcast_global_variables_in_a_tf1_graph(ranks):
    assert values(ranks, "broadcast_global_variables_in_a_tf1_graph") == [[1.0, 2.0]] * 2


def test_object_broadcasts_in_horovods_forms(ranks):
    assert values(ranks, "broadcast_object_fn") == [{"r": 1}] * 2
    assert values(ranks, "broadcast_object_with_a_session_argument") == [{"r": 1}] * 2


def test_allgather_object(ranks):
    assert values(ranks, "allgather_object") == [[0, 1]] * 2


def test_broadcast_in_place_refuses_a_tensor(ranks):
    assert values(ranks, "broadcast_in_place_of_a_tensor") == [(
        "TypeError", "broadcast_ assigns tf.Variables in place, got EagerTensor; use hvd.broadcast(tensor, root_rank) "
        "for a tensor.")] * 2


def test_broadcast_global_variables_needs_a_tf1_graph(ranks):
    assert values(ranks, "broadcast_global_variables_eagerly") == [(
        "RuntimeError", "hvd.broadcast_global_variables() needs a TF1 graph, but TensorFlow is executing eagerly; use "
        "hvd.broadcast_variables(model.variables, root_rank) instead.")] * 2


def test_grouped_allgather_eagerly_and_in_tf_function(ranks):
    gathered = [[[0, 0], [1, 1], [1, 1]], [0.5, 1.5]]
    assert values(ranks, "grouped_allgather") == [gathered] * 2
    assert values(ranks, "grouped_allgather_in_tf_function") == [gathered] * 2


def test_indexed_slices_are_allgathered(ranks):
    for summed, averaged in values(ranks, "indexed_slices_allreduce"):
        assert summed == ("IndexedSlices", [[1.0, 1.0], [2.0, 2.0]], [0, 1], [3, 2])
        assert averaged == ("IndexedSlices", [[0.5, 0.5], [1.0, 1.0]], [0, 1], [3, 2])


def test_indexed_slices_in_a_grouped_allreduce_stay_slices(ranks):
    dense = [[1.0, 1.0], [2.0, 2.0], [0.0, 0.0]]
    assert values(ranks, "indexed_slices_in_a_grouped_allreduce") == [
        [("IndexedSlices", dense), ("EagerTensor", [3.0]), ("IndexedSlices", dense)]] * 2


def test_indexed_slices_in_tf_function(ranks):
    assert values(ranks, "indexed_slices_in_tf_function") == [[[[0.5, 0.5], [1.0, 1.0], [0.0, 0.0]], [1.5]]] * 2


def test_indexed_slices_refuse_max(ranks):
    assert values(ranks, "indexed_slices_with_max") == [(
        "NotImplementedError", "allreduce of tf.IndexedSlices supports op=hvd.Average or hvd.Sum, got Max; pass "
        "sparse_as_dense=True (or tf.convert_to_tensor the slices) to reduce them as a dense tensor with Max.")] * 2


def test_indexed_slices_refuse_scaling(ranks):
    assert values(ranks, "indexed_slices_scaled") == [(
        "NotImplementedError", "grouped_allreduce of tf.IndexedSlices does not scale (got prescale_factor=0.5, "
        "postscale_factor=1.0); multiply the slices' values yourself, or convert them to a dense tensor first.")] * 2


@pytest.mark.parametrize("name", ["mismatch", "mismatch_graph", "mismatch_session"])
def test_ranks_that_disagree_get_a_failed_precondition_error(ranks, name):
    for kind, text in values(ranks, name):
        # in a graph too (tf.function, TF1 session), although a py_function alone would make it UnknownError
        assert kind == "FailedPreconditionError", (kind, text)
        assert "UnknownError" not in text and "Traceback" not in text, text
        assert ": rank 0: allreduce(op=Average: float32[2] on cpu); rank 1: allreduce(op=Average: float32[3] " \
               "on cpu). Every rank must call" in text, text  # eager: the n-th unnamed allreduce; in a graph:
        # named after its graph op


def test_ranks_that_disagree_on_a_dtype_in_a_graph(ranks):
    for kind, text in values(ranks, "mismatch_dtype_graph"):
        assert kind == "FailedPreconditionError", (kind, text)
        assert "rank 0: broadcast(root_rank=0: float32[2] on cpu); rank 1: broadcast(root_rank=0: int32[2] on cpu)" \
               in text, text


def test_the_next_graphs_collective_after_a_failed_one(ranks):
    for kind, text in values(ranks, "mismatch_after_graph"):
        assert kind == "FailedPreconditionError", (kind, text)
        assert "rank 0: allgather(float32[*, 2] on cpu); rank 1: allgather(float32[*, 3] on cpu)" in text, text


@pytest.mark.parametrize("name", ["bad_splits", "bad_splits_graph"])
def test_an_argument_problem_on_one_rank_is_an_invalid_argument_error(ranks, name):
    for kind, text in values(ranks, name):  # in a graph too
        assert kind == "InvalidArgumentError", (kind, text)
        assert "rank 1: alltoall without splits needs the first dimension (3) to be divisible by the number " \
               "of ranks (2)" in text, text


def test_join_returns_the_rank_that_joined_last_as_a_tensor(ranks):
    joins = values(ranks, "join")
    assert [v["while_joined"] for v in joins] == [[3.0], [4.0]]
    for v in joins:
        assert v["eager"] == ("int32", 0, 0) and v["graph"] == 1
