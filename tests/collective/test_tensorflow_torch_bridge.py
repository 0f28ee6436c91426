"""Tensors cross between torch and TensorFlow without a copy (DLPack), and a misaligned torch buffer reaches
TensorFlow aligned instead of aborting it."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")


_MISALIGNED = """
import numpy as np, tensorflow as tf, torch
from torch.utils import dlpack
t = torch.from_numpy(np.arange(1 + 64 * 64, dtype=np.float32))[1:]  # 4 bytes past an aligned start
assert t.data_ptr() % 64, t.data_ptr()
print(float(tf.reduce_sum(tf.experimental.dlpack.from_dlpack(dlpack.to_dlpack(t)) + 1.0)))
"""


def test_the_raw_dlpack_hand_over_of_a_misaligned_buffer_aborts_tensorflow():
    """The control for the bridge's test below: TF aborts the process on the unaligned buffer (so: a process)."""
    out = subprocess.run([sys.executable, "-c", _MISALIGNED], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "IsAligned" in out.stderr


@pytest.mark.unit
def test_misaligned_buffer_reaches_tf_aligned():
    import torch

    from sparkhvd.collective.tensorflow._bridge import to_tf

    t = torch.from_numpy(np.arange(1 + 64 * 64, dtype=np.float32))[1:]  # as the control's: 4 bytes off
    assert t.data_ptr() % 64, t.data_ptr()
    assert float(tf.reduce_sum(to_tf(t, tf.float32) + 1.0)) == sum(range(1, 64 * 64 + 1)) + 64 * 64


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
