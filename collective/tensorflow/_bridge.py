"""TensorFlow tensors on the shared torch engine, both ways through DLPack without copies.

``to_torch`` views a TF tensor's memory as a torch tensor (callers clone before writing into
it). ``to_tf`` hands a torch result to TF the same way, after making sure its memory is
64-byte aligned: TF aborts the whole process (``Check failed: IsAligned()``) the first time an
op reads an unaligned buffer, and a view into the middle of a torch or NumPy buffer can be
anywhere. torch's CPU allocator aligns to 64 bytes, so an unaligned result is cloned once.
Inside ``tf.function`` the op runs through ``tf.py_function`` and the static shape is restored.
"""

from __future__ import annotations

import itertools
import weakref

import tensorflow as tf
import torch
from torch.utils import dlpack as torch_dlpack

ALIGNMENT = 64  # bytes; TF's Tensor::IsAligned (EIGEN_MAX_ALIGN_BYTES)


def to_torch(tensor) -> torch.Tensor:
    """A torch tensor over the TF tensor's own memory (no copy): read it, do not write it."""
    return torch_dlpack.from_dlpack(tf.experimental.dlpack.to_dlpack(tf.convert_to_tensor(tensor)))


def to_tf(t: torch.Tensor, dtype: tf.DType) -> tf.Tensor:
    """A TF tensor over ``t``'s memory (no copy when ``t`` is contiguous and 64-byte aligned).

    TF takes ownership of a reference: the caller must not write into ``t`` afterwards.
    """
    t = t.detach()
    if not t.is_contiguous() or t.data_ptr() % ALIGNMENT:
        t = t.clone(memory_format=torch.contiguous_format)  # a fresh, aligned allocation
    out = tf.experimental.dlpack.from_dlpack(torch_dlpack.to_dlpack(t))
    return out if out.dtype == dtype else tf.cast(out, dtype)


_graph_ops = itertools.count()  # graph ops built so far in this process: alike on every rank


def in_graph(fn):
    """``fn`` for a py_function built now: its collectives are named after this graph op (numbered in the
    order the graph is built, alike on every rank), because TensorFlow runs a graph's independent ops
    on several threads in any order, and unnamed ops would pair by the order they happened to run in."""
    from .._background import named

    prefix = f"tf.{next(_graph_ops)}"

    def named_fn(*args):
        with named(prefix):
            return fn(*args)

    return named_fn


_latest = weakref.WeakKeyDictionary()  # graph -> the latest collective op built in it


def chained(build):
    """``build()`` a collective's py_function after the graph's previous one (a control dependency).

    A py_function blocks its TensorFlow thread until the peers have run the same op; were a graph's
    collectives free to run in any order, each rank could fill its few threads with ops whose peers
    are blocked in others, and wait forever. In build order they run alike on every rank.
    """
    graph = tf.compat.v1.get_default_graph()
    previous = _latest.get(graph)
    with tf.control_dependencies([previous] if previous is not None else []):
        out = build()
    _latest[graph] = (out[0] if isinstance(out, (list, tuple)) else out).op
    return out


def run(fn, tensor, out_shape):
    """Apply ``fn`` (tf.Tensor -> tf.Tensor, eager) here or, in a graph, through py_function."""
    if tf.executing_eagerly():
        return fn(tensor)
    out = chained(lambda: tf.py_function(in_graph(fn), [tensor], Tout=tensor.dtype))
    out.set_shape(out_shape)
    return out
