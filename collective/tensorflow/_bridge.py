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

from .._engine.ops import named
from . import _op_error

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


def graph_op(fn, inputs, dtypes):
    """``fn`` (eager tf.Tensors -> list of tf.Tensors of ``dtypes``) as a collective's py_function in this graph.

    It runs ``chained`` and ``in_graph``. A ``tf.errors.OpError`` that ``fn`` raises (FailedPrecondition when
    the ranks disagree) reaches the caller as that class, with its message: py_function alone would make it
    UnknownError (see ``_op_error``), so the py_function returns the error's key, and the op after it raises it.
    """
    named = in_graph(fn)
    dtypes = list(dtypes)
    if _op_error.raise_op() is None:  # no C API: errors arrive as UnknownError
        return list(chained(lambda: tf.py_function(named, list(inputs), Tout=dtypes)))

    def guarded(*args):
        try:
            return list(named(*args)) + [tf.constant(0, tf.int64)]
        except tf.errors.OpError as exc:  # outputs nobody reads: the op after this one fails
            return [tf.zeros([0], d) for d in dtypes] + [tf.constant(_op_error.park(exc), tf.int64)]

    *outs, key = chained(lambda: tf.py_function(guarded, list(inputs), Tout=dtypes + [tf.int64]))

    def failed():
        with tf.control_dependencies([_op_error.raise_if_failed(key)]):
            return tf.identity(key)

    # Only a failure runs the raising op (it calls back into Python): a success costs one cond.
    checked = tf.cond(key > 0, failed, lambda: key)
    with tf.control_dependencies([checked]):
        return [tf.identity(out) for out in outs]


def run(fn, tensor, out_shape):
    """Apply ``fn`` (tf.Tensor -> tf.Tensor, eager) here or, in a graph, through py_function."""
    if tf.executing_eagerly():
        return fn(tensor)
    out, = graph_op(lambda v: [fn(v)], [tensor], [tensor.dtype])
    out.set_shape(out_shape)
    return out
