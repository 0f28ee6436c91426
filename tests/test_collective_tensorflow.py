"""sparkhvd.collective.tensorflow at np=2 in real rank processes: eager and tf.function, exact values."""

from __future__ import annotations

import importlib.util
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
    out["alltoall_even"] = hvd.alltoall(tf.range(2 * n) + 100 * r).numpy()
    splits = [k + 1 for k in range(n)]  # rank r sends k + 1 rows to rank k
    sent, received = hvd.alltoall(tf.fill([sum(splits), 2], r), splits=splits)
    out["alltoall_splits"] = (sent.numpy(), received.numpy(), received.dtype)
    rows = 2 * n + 1  # uneven: rank 0 gets the extra row
    out["reducescatter_sum"] = hvd.reducescatter(tf.reshape(tf.range(rows * 2.0), [rows, 2]) + r, op=hvd.Sum).numpy()
    out["reducescatter_avg"] = hvd.reducescatter(tf.ones([rows]) * (r + 1)).numpy()

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

    @tf.function
    def graph_more(v):
        sent, received = hvd.alltoall(tf.fill([sum(splits), 2], r), splits=splits)
        scattered = hvd.reducescatter(tf.reshape(tf.range(rows * 2.0), [rows, 2]) + r, op=hvd.Sum)
        grouped = hvd.grouped_allreduce([v, tf.constant([r])], op=hvd.Sum)
        static["more"] = [t.shape.as_list() for t in (sent, received, scattered, *grouped)]
        return sent, received, scattered, grouped

    sent, received, scattered, grouped = graph_more(x)
    out["graph_more"] = (sent.numpy(), received.numpy(), scattered.numpy(), [t.numpy() for t in grouped],
                         static["more"])
    v = tf.Variable(tf.ones([2]) * (r + 1))
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(hvd.allreduce(v, op=hvd.Sum) * (r + 1))
    out["grad_allreduce"] = tape.gradient(loss, v).numpy()
    grads = {}
    ops = {  # each rank's loss weights the op's output by (r + 1)
        "allgather": lambda t: hvd.allgather(t),
        "broadcast": lambda t: hvd.broadcast(t, root_rank=1),
        "alltoall": lambda t: hvd.alltoall(t, splits=splits)[0],
        "reducescatter_sum": lambda t: hvd.reducescatter(t, op=hvd.Sum),
        "reducescatter_avg": lambda t: hvd.reducescatter(t, op=hvd.Average),
        "reducescatter_scaled": lambda t: hvd.reducescatter(t, op=hvd.Sum, prescale_factor=3.0,
                                                            postscale_factor=0.5),
    }
    for key, op in ops.items():
        t = tf.Variable(tf.ones([sum(splits) if key == "alltoall" else rows]))
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(op(t) * (r + 1.0))
        grads[key] = tape.gradient(loss, t).numpy()

    @tf.function
    def graph_grad(t):
        with tf.GradientTape() as tape:
            tape.watch(t)
            loss = tf.reduce_sum(hvd.alltoall(t, splits=splits)[0] * (r + 1.0))
        return tape.gradient(loss, t)

    grads["alltoall_graph"] = graph_grad(tf.ones([sum(splits)])).numpy()

    @tf.function
    def allgather_graph_grad(t):  # two collectives in the gradient: their order must not race
        with tf.GradientTape() as tape:
            tape.watch(t)
            loss = tf.reduce_sum(hvd.allgather(t) * (r + 1.0))
        return tape.gradient(loss, t)

    grads["allgather_graph"] = [allgather_graph_grad(tf.ones([rows])).numpy() for _ in range(5)]
    out["grads"] = grads
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


def test_alltoall_and_reducescatter(ranks):
    import numpy as np

    n, rows = len(ranks), 2 * len(ranks) + 1
    for r, v in enumerate(ranks):
        np.testing.assert_array_equal(v["alltoall_even"], [100 * k + 2 * r + j for k in range(n) for j in range(2)])
        sent, received, dtype = v["alltoall_splits"]
        assert dtype == tf.int32 and received.tolist() == [r + 1] * n
        np.testing.assert_array_equal(sent, np.concatenate([np.full((r + 1, 2), k) for k in range(n)]))
        mine = slice(0, 3) if r == 0 else slice(3, 5)  # 5 rows: rank 0 takes the extra one
        total = np.arange(rows * 2.0).reshape(rows, 2) * n + sum(range(n))
        np.testing.assert_array_equal(v["reducescatter_sum"], total[mine])
        np.testing.assert_array_equal(v["reducescatter_avg"], np.full(3 if r == 0 else 2, (n + 1) / 2))
        sent, received, scattered, grouped, shapes = v["graph_more"]
        np.testing.assert_array_equal(sent, np.concatenate([np.full((r + 1, 2), k) for k in range(n)]))
        assert received.tolist() == [r + 1] * n
        np.testing.assert_array_equal(scattered, total[mine])
        np.testing.assert_array_equal(grouped[0], [3.0, 5.0, 7.0])
        np.testing.assert_array_equal(grouped[1], [1])
        assert shapes == [[None, 2], [n], [None, 2], [3], [1]]


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

    for r, v in enumerate(ranks):
        np.testing.assert_array_equal(v["grad_allreduce"], [3.0, 3.0])  # sum over ranks of (r + 1)
        g = v["grads"]
        # Horovod 0.28's convention (kept on purpose): allgather and broadcast average the ranks' gradients,
        # reducescatter's is the gathered gradient, times size() for Sum
        np.testing.assert_array_equal(g["allgather"], [1.5] * 5)  # every rank's loss reads every row
        np.testing.assert_array_equal(g["allgather_graph"], [[1.5] * 5] * 5)
        np.testing.assert_array_equal(g["broadcast"], [1.5 if r == 1 else 0.0] * 5)  # the root gets it all
        sent_to = [k + 1.0 for k in range(2) for _ in range(k + 1)]  # rows sent to rank k carry k + 1
        np.testing.assert_array_equal(g["alltoall"], sent_to)
        np.testing.assert_array_equal(g["alltoall_graph"], sent_to)
        np.testing.assert_array_equal(g["reducescatter_sum"], [2.0, 2.0, 2.0, 4.0, 4.0])  # the owner's weight x 2
        np.testing.assert_array_equal(g["reducescatter_avg"], [1.0, 1.0, 1.0, 2.0, 2.0])
        np.testing.assert_array_equal(g["reducescatter_scaled"], [3.0, 3.0, 3.0, 6.0, 6.0])
        np.testing.assert_array_equal(v["tape"], [1.5, 1.5])  # averaged
        np.testing.assert_array_equal(v["tape_sum"], [3.0, 3.0])
        np.testing.assert_array_equal(v["graph_tape"], [1.5, 1.5])
        assert v["errors"]["tape_op"] == ("DistributedGradientTape reduces with op=hvd.Average, hvd.Sum or hvd.Adasum, "
                                          "got Max.")


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


_MISALIGNED = """
import sys
import numpy as np, tensorflow as tf, torch
from torch.utils import dlpack
from sparkhvd.collective.tensorflow._bridge import to_tf
t = torch.from_numpy(np.arange(1 + 64 * 64, dtype=np.float32))[1:]  # 4 bytes past an aligned start
assert t.data_ptr() % 64, t.data_ptr()
x = to_tf(t, tf.float32) if sys.argv[1] == "bridge" else tf.experimental.dlpack.from_dlpack(dlpack.to_dlpack(t))
print(float(tf.reduce_sum(x + 1.0)))
"""


@pytest.mark.parametrize("path", ["bridge", "raw"])
def test_misaligned_buffer_reaches_tf_aligned(path):
    # The raw DLPack hand-over is the control: TF aborts the process on the unaligned buffer.
    out = subprocess.run([sys.executable, "-c", _MISALIGNED, path], capture_output=True, text=True, timeout=120)
    if path == "bridge":
        assert out.returncode == 0, out.stderr[-2000:]
        assert float(out.stdout.strip()) == sum(range(1, 64 * 64 + 1)) + 64 * 64
    else:
        assert out.returncode != 0 and "IsAligned" in out.stderr


def test_bridge_shares_memory_both_ways():
    import torch

    from sparkhvd.collective.tensorflow._bridge import to_tf, to_torch

    t = torch.arange(1024, dtype=torch.float32)
    x = to_tf(t, tf.float32)
    assert to_torch(x).data_ptr() == t.data_ptr()  # torch -> TF -> torch without a copy
    for dtype in (tf.bfloat16, tf.float16, tf.int32, tf.int64, tf.bool):
        value = tf.cast(tf.range(6) % 2, dtype)
        back = to_tf(to_torch(value), dtype)
        assert back.dtype == dtype and back.numpy().tolist() == value.numpy().tolist()
    view = torch.arange(17, dtype=torch.float64)[1:]  # 8 bytes off: copied once, into aligned memory
    assert to_tf(view, tf.float64).numpy().tolist() == view.tolist()


def test_tensorflow_and_keras_export_horovods_build_flags():
    code = ("import sparkhvd.collective.keras as k, sparkhvd.collective.tensorflow as t\n"
            "names = ['mpi_enabled', 'mpi_built', 'gloo_enabled', 'gloo_built', 'nccl_built', 'ddl_built', "
            "'ccl_built', 'cuda_built', 'rocm_built']\n"
            "print([getattr(m, n)() for m in (t, k) for n in names])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env=dict(os.environ))
    mpi_built = importlib.util.find_spec("mpi4py") is not None  # the test extra installs it; MPI is not enabled
    assert out.stdout.strip() == str([False, mpi_built, True, True, 0, False, False, False, False] * 2), out.stderr
