"""Tensors cross between torch and TensorFlow without a copy (DLPack), and a misaligned torch buffer reaches
TensorFlow aligned instead of aborting it."""

from __future__ import annotations

import subprocess
import sys

import pytest

tf = pytest.importorskip("tensorflow")


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


@pytest.mark.unit
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
