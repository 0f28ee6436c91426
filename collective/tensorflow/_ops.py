"""Collectives on tf.Tensors, eager and in tf.function, with gradients; DistributedGradientTape."""

from __future__ import annotations

import tensorflow as tf

from ..torch import _ops as _torch_ops
from ..torch._handles import synchronize
from ._bridge import run, to_tf, to_torch


class Compression:
    """``Compression.none`` and ``Compression.fp16`` for tf.Tensors."""

    class none:
        @staticmethod
        def compress(tensor):
            return tensor, None

        @staticmethod
        def decompress(tensor, ctx):
            return tensor

    class fp16:
        @staticmethod
        def compress(tensor):
            if tensor.dtype.is_floating and tensor.dtype != tf.float16:
                return tf.cast(tensor, tf.float16), tensor.dtype
            return tensor, None

        @staticmethod
        def decompress(tensor, ctx):
            return tensor if ctx is None else tf.cast(tensor, ctx)


def _reduce_now(tensor, op, prescale, postscale):
    t = to_torch(tensor).clone()
    _torch_ops.allreduce_(t, op=op, prescale_factor=prescale, postscale_factor=postscale)
    return to_tf(t, tensor.dtype)


def allreduce(tensor, average=None, name=None, op=None, compression=Compression.none, prescale_factor=1.0,
              postscale_factor=1.0):
    """Reduce ``tensor`` across the ranks (default: Average); differentiable."""
    op = _torch_ops._resolve_op(op, average)
    tensor = tf.convert_to_tensor(tensor)
    wire, ctx = compression.compress(tensor)

    @tf.custom_gradient
    def reduce(x):
        out = run(lambda v: _reduce_now(v, op, prescale_factor, postscale_factor), x, x.shape)
        return out, lambda dy: allreduce(dy, op=op, prescale_factor=prescale_factor,
                                         postscale_factor=postscale_factor)

    return compression.decompress(reduce(wire), ctx)


def grouped_allreduce(tensors, average=None, name=None, op=None, compression=Compression.none):
    """Reduce a list of tensors in one fused operation (one reduction per dtype); returns new tensors.

    Inside ``tf.function`` the whole group is one ``py_function``.
    """
    op = _torch_ops._resolve_op(op, average)
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    if not tensors:
        return []
    if tf.executing_eagerly():
        return _grouped_eager(tensors, op, compression)
    outs = tf.py_function(lambda *ts: _grouped_eager(list(ts), op, compression), tensors,
                          Tout=[t.dtype for t in tensors])
    for out, t in zip(outs, tensors):
        out.set_shape(t.shape)
    return list(outs)


def _grouped_eager(tensors, op, compression, prescale=1.0, postscale=1.0):
    wires = [compression.compress(t) for t in tensors]
    torch_tensors = [to_torch(w).clone() for w, _ in wires]
    synchronize(_torch_ops.grouped_allreduce_async_(torch_tensors, op=op, prescale_factor=prescale,
                                                    postscale_factor=postscale))
    return [compression.decompress(to_tf(t, w.dtype), c) for t, (w, c) in zip(torch_tensors, wires)]


def broadcast(tensor, root_rank, name=None):
    """Rank ``root_rank``'s value of ``tensor``; differentiable (the root gets the summed gradient)."""
    tensor = tf.convert_to_tensor(tensor)

    def now(v):
        t = to_torch(v).clone()
        _torch_ops.broadcast_(t, root_rank)
        return to_tf(t, v.dtype)

    @tf.custom_gradient
    def bcast(x):
        out = run(now, x, x.shape)

        def grad(dy):
            summed = allreduce(dy, op=_torch_ops.Sum)
            return summed if _torch_ops._engine.topology().rank == root_rank else tf.zeros_like(summed)

        return out, grad

    return bcast(tensor)


def allgather(tensor, name=None):
    """Every rank's ``tensor`` concatenated along the first dimension (which may differ)."""
    tensor = tf.convert_to_tensor(tensor)

    def now(v):
        return to_tf(synchronize(_torch_ops.allgather_async(to_torch(v))), v.dtype)

    @tf.custom_gradient
    def gather(x):
        out = run(now, x, tf.TensorShape([None]).concatenate(x.shape[1:]) if x.shape.rank else [None])
        rows = tf.shape(x)[0] if x.shape.rank else 1

        def grad(dy):
            summed = allreduce(dy, op=_torch_ops.Sum)
            counts = allgather(tf.reshape(tf.cast(rows, tf.int64), [1]))
            start = tf.reduce_sum(counts[:_torch_ops._engine.topology().rank])
            return tf.reshape(summed[start:start + tf.cast(rows, tf.int64)], tf.shape(x))

        return out, grad

    return gather(tensor)


def broadcast_variables(variables, root_rank: int = 0) -> None:
    """Assign every rank's variables rank ``root_rank``'s values."""
    for v in variables:
        v.assign(broadcast(v, root_rank))


class DistributedGradientTape:
    """Wraps a ``tf.GradientTape``: ``gradient()`` returns gradients averaged across the ranks.

    ``op``: Average (default) or Sum; ``compression``: Compression.none or fp16;
    ``sparse_as_dense``: IndexedSlices become dense tensors first (otherwise they are refused);
    ``gradient_predivide_factor`` splits the averaging before and after the sum, as in Horovod.
    """

    def __init__(self, gradtape, device_dense="", device_sparse="", compression=Compression.none,
                 sparse_as_dense=False, op=_torch_ops.Average, gradient_predivide_factor=1.0):
        op = _torch_ops._resolve_op(op, None)
        if op not in (_torch_ops.Average, _torch_ops.Sum):
            raise ValueError(f"DistributedGradientTape reduces with op=hvd.Average or hvd.Sum, got {op.name}.")
        self._tape = gradtape
        self._compression = compression
        self._sparse_as_dense = sparse_as_dense
        self._op = op
        self._predivide = float(gradient_predivide_factor)

    def __getattr__(self, name):
        return getattr(self._tape, name)

    def gradient(self, target, sources, output_gradients=None, **kwargs):
        grads = self._tape.gradient(target, sources, output_gradients, **kwargs)
        flat = tf.nest.flatten(grads)
        dense = []
        for g in flat:
            if isinstance(g, tf.IndexedSlices):
                if not self._sparse_as_dense:
                    raise ValueError("a gradient is tf.IndexedSlices (from an embedding lookup); pass "
                                     "sparse_as_dense=True to DistributedGradientTape to reduce it as a dense tensor.")
                g = tf.convert_to_tensor(g)
            dense.append(g)
        present = [g for g in dense if g is not None]
        pre, post = 1.0, 1.0
        if self._op == _torch_ops.Average and self._predivide != 1.0:
            pre, post = 1.0 / self._predivide, self._predivide
        scaled = [g * pre if pre != 1.0 else g for g in present]
        reduced = grouped_allreduce(scaled, op=self._op, compression=self._compression)
        reduced = [r * post if post != 1.0 else r for r in reduced]
        it = iter(reduced)
        return tf.nest.pack_sequence_as(grads, [next(it) if g is not None else None for g in dense])
