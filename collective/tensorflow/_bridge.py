"""TensorFlow tensors on the shared torch engine: through NumPy, into TF-owned memory on the way back.

``tensor.numpy()`` becomes a torch tensor without a copy (``torch.from_numpy``; bfloat16 goes
through a uint16 view, since NumPy has no bfloat16 of its own). The result goes back with
``tf.convert_to_tensor``, which copies into memory TensorFlow allocated itself, so TF never
sees a foreign buffer (it aborts the process on DLPack memory that is not 64-byte aligned).
Inside ``tf.function`` the op runs through ``tf.py_function`` and the static shape is restored.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf
import torch


def to_torch(tensor) -> torch.Tensor:
    """A torch tensor over (a copy of) the TF tensor's values."""
    # np.asarray keeps 0-d arrays 0-d (np.ascontiguousarray would make them 1-d).
    array = np.asarray(tensor.numpy() if hasattr(tensor, "numpy") else tensor, order="C")
    if tensor.dtype == tf.bfloat16:
        return torch.from_numpy(array.view(np.uint16)).view(torch.bfloat16)
    if array.dtype == np.bool_:
        return torch.from_numpy(array.astype(np.uint8))
    return torch.from_numpy(array)


def to_tf(t: torch.Tensor, dtype: tf.DType) -> tf.Tensor:
    """A TF tensor (TF-owned memory) with the torch tensor's values."""
    t = t.detach().cpu().contiguous()
    if dtype == tf.bfloat16:
        array = t.view(torch.uint16).numpy().view(tf.bfloat16.as_numpy_dtype)
    else:
        array = t.numpy()
    return tf.convert_to_tensor(array, dtype=dtype)


def run(fn, tensor, out_shape):
    """Apply ``fn`` (tf.Tensor -> tf.Tensor, eager) here or, in a graph, through py_function."""
    if tf.executing_eagerly():
        return fn(tensor)
    out = tf.py_function(fn, [tensor], Tout=tensor.dtype)
    out.set_shape(out_shape)
    return out
