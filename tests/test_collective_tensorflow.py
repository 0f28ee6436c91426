"""sparkhvd.collective.tensorflow at np=2 in real rank processes: eager and tf.function, exact values."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

tf = pytest.importorskip("tensorflow")

from sparkhvd import HorovodRunner  # noqa: E402


def _tf_ops():
    import numpy as np
    import tensorflow as tf

    import sparkhvd.collective.tensorflow as hvd

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    out = {"topology": (hvd.rank(), hvd.size(), hvd.local_rank())}
    x = tf.constant([1.0, 2.0, 3.0]) + r
    out["eager_sum"] = hvd.allreduce(x, op=hvd.Sum).numpy()
    out["eager_avg"] = hvd.allreduce(x).numpy()
    out["int"] = hvd.allreduce(tf.constant([1, 2]) * (r + 1), op=hvd.Sum).numpy()
    out["bf16"] = hvd.allreduce(tf.constant([1.0, 2.0], dtype=tf.bfloat16) * (r + 1), op=hvd.Sum)
    out["fp16_wire"] = hvd.allreduce(x, op=hvd.Sum, compression=hvd.Compression.fp16)
    out["broadcast"] = hvd.broadcast(tf.constant([r, r]), root_rank=1).numpy()
    out["allgather"] = hvd.allgather(tf.fill([r + 1, 2], r)).numpy()
    out["grouped"] = [t.numpy() for t in hvd.grouped_allreduce([x, tf.constant([r])], op=hvd.Sum)]

    static = {}

    @tf.function
    def graph(v):
        s = hvd.allreduce(v, op=hvd.Sum)
        g = hvd.allgather(tf.reshape(v, [-1, 1]))
        b = hvd.broadcast(v, root_rank=0)
        static["s"], static["g"] = s.shape.as_list(), g.shape.as_list()  # while tracing
        return s, g, b

    s, g, b = graph(x)
    out["graph"] = (s.numpy(), g.numpy(), b.numpy(), static["s"], static["g"])
    v = tf.Variable(tf.ones([2]) * (r + 1))
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(hvd.allreduce(v, op=hvd.Sum) * (r + 1))
    out["grad_allreduce"] = tape.gradient(loss, v).numpy()
    w = tf.Variable([1.0, 1.0])
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(w * (r + 1.0))
    out["tape"] = hvd.DistributedGradientTape(tape).gradient(loss, [w])[0].numpy()
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(w * (r + 1.0))
    out["tape_sum"] = hvd.DistributedGradientTape(tape, op=hvd.Sum).gradient(loss, w).numpy()

    @tf.function
    def graph_tape():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(w * (r + 1.0))
        return hvd.DistributedGradientTape(tape).gradient(loss, [w])[0]

    out["graph_tape"] = graph_tape().numpy()
    variables = [tf.Variable(np.full([2], float(r))), tf.Variable(r + 10)]
    hvd.broadcast_variables(variables, root_rank=1)
    out["variables"] = [v.numpy() for v in variables]
    out["object"] = hvd.broadcast_object({"r": r}, root_rank=1)
    errors = {}
    for key, call in {"tape_op": lambda: hvd.DistributedGradientTape(tape, op=hvd.Max)}.items():
        try:
            call()
        except ValueError as exc:
            errors[key] = str(exc)
    out["errors"] = errors
    return out


@pytest.fixture(scope="module")
def ranks():
    return HorovodRunner(np=-2).run_all(_tf_ops).values


def test_eager_ops(ranks):
    import numpy as np

    for r, v in enumerate(ranks):
        assert v["topology"] == (r, 2, r)
        np.testing.assert_array_equal(v["eager_sum"], [3.0, 5.0, 7.0])
        np.testing.assert_array_equal(v["eager_avg"], [1.5, 2.5, 3.5])
        np.testing.assert_array_equal(v["int"], [3, 6])
        assert v["bf16"].dtype == tf.bfloat16 and v["bf16"].numpy().astype(float).tolist() == [3.0, 6.0]
        assert v["fp16_wire"].dtype == tf.float32 and v["fp16_wire"].numpy().tolist() == [3.0, 5.0, 7.0]
        np.testing.assert_array_equal(v["broadcast"], [1, 1])
        np.testing.assert_array_equal(v["allgather"], [[0, 0], [1, 1], [1, 1]])
        np.testing.assert_array_equal(v["grouped"][0], [3.0, 5.0, 7.0])
        np.testing.assert_array_equal(v["grouped"][1], [1])


def test_ops_inside_tf_function_keep_static_shapes(ranks):
    import numpy as np

    for v in ranks:
        s, g, b, s_shape, g_shape = v["graph"]
        np.testing.assert_array_equal(s, [3.0, 5.0, 7.0])
        np.testing.assert_array_equal(g.ravel(), [1.0, 2.0, 3.0, 2.0, 3.0, 4.0])
        np.testing.assert_array_equal(b, [1.0, 2.0, 3.0])
        assert s_shape == [3] and g_shape == [None, 1]


def test_gradients_and_distributed_gradient_tape(ranks):
    import numpy as np

    for v in ranks:
        np.testing.assert_array_equal(v["grad_allreduce"], [3.0, 3.0])  # sum over ranks of (r + 1)
        np.testing.assert_array_equal(v["tape"], [1.5, 1.5])  # averaged
        np.testing.assert_array_equal(v["tape_sum"], [3.0, 3.0])
        np.testing.assert_array_equal(v["graph_tape"], [1.5, 1.5])
        assert v["errors"]["tape_op"] == "DistributedGradientTape reduces with op=hvd.Average or hvd.Sum, got Max."


def test_broadcast_variables_and_objects(ranks):
    import numpy as np

    for v in ranks:
        np.testing.assert_array_equal(v["variables"][0], [1.0, 1.0])
        assert v["variables"][1] == 11
        assert v["object"] == {"r": 1}


def test_import_without_tensorflow_says_how_to_install_it():
    code = ("import sys\nsys.modules['tensorflow'] = None\n"
            "try:\n    import sparkhvd.collective.tensorflow\nexcept ModuleNotFoundError as e:\n    print(e)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ))
    assert out.stdout.strip() == "TensorFlow isn't installed: pip install 'sparkhvd[tensorflow]'", out.stderr
