"""Collectives on tf.Tensors, eager and in tf.function, with gradients; DistributedGradientTape."""

from __future__ import annotations

import tensorflow as tf

from .. import _engine
from ..torch import _ops as _torch_ops
from ..torch._handles import synchronize
from ..torch._process_sets import global_process_set
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


def _reduce_now(tensor, op, prescale, postscale, process_set):
    t = synchronize(_torch_ops.allreduce_async(to_torch(tensor), op=op, prescale_factor=prescale,
                                               postscale_factor=postscale, process_set=process_set))
    return to_tf(t, tensor.dtype)


def allreduce(tensor, average=None, device_dense="", device_sparse="", compression=Compression.none, op=None,
              prescale_factor=1.0, postscale_factor=1.0, name=None, process_set=global_process_set):
    """Reduce ``tensor`` across the ranks (default: Average); differentiable."""
    op = _torch_ops._resolve_op(op, average)
    tensor = tf.convert_to_tensor(tensor)
    wire, ctx = compression.compress(tensor)

    @tf.custom_gradient
    def reduce(x):
        out = run(lambda v: _reduce_now(v, op, prescale_factor, postscale_factor, process_set), x, x.shape)
        return out, lambda dy: allreduce(dy, op=op, prescale_factor=prescale_factor,
                                         postscale_factor=postscale_factor, process_set=process_set)

    return compression.decompress(reduce(wire), ctx)


def grouped_allreduce(tensors, average=None, device_dense="", device_sparse="", compression=Compression.none,
                      op=None, prescale_factor=1.0, postscale_factor=1.0, name=None,
                      process_set=global_process_set):
    """Reduce a list of tensors in one fused operation (one reduction per dtype); returns new tensors.

    Inside ``tf.function`` the whole group is one ``py_function``.
    """
    op = _torch_ops._resolve_op(op, average)
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    if not tensors:
        return []

    def now(*ts):
        wires = [compression.compress(t) for t in ts]
        torch_tensors = [to_torch(w).clone() for w, _ in wires]
        synchronize(_torch_ops.grouped_allreduce_async_(torch_tensors, op=op, prescale_factor=prescale_factor,
                                                        postscale_factor=postscale_factor, process_set=process_set))
        return [compression.decompress(to_tf(t, w.dtype), c) for t, (w, c) in zip(torch_tensors, wires)]

    if tf.executing_eagerly():
        return now(*tensors)
    outs = tf.py_function(now, tensors, Tout=[t.dtype for t in tensors])
    for out, t in zip(outs, tensors):
        out.set_shape(t.shape)
    return list(outs)


def broadcast(tensor, root_rank, name=None, ignore_name_scope=False, process_set=global_process_set):
    """Rank ``root_rank``'s value of ``tensor``; differentiable (the root gets the averaged gradient)."""
    tensor = tf.convert_to_tensor(tensor)

    def now(v):
        return to_tf(synchronize(_torch_ops.broadcast_async(to_torch(v), root_rank, process_set=process_set)),
                     v.dtype)

    @tf.custom_gradient
    def bcast(x):
        out = run(now, x, x.shape)

        def grad(dy):  # Horovod's convention: the average of the ranks' gradients, on the root
            averaged = allreduce(dy, op=_torch_ops.Average, process_set=process_set)
            return averaged if _engine.topology().rank == root_rank else tf.zeros_like(averaged)

        return out, grad

    return bcast(tensor)


def _first_dim_unknown(shape: tf.TensorShape) -> tf.TensorShape:
    return tf.TensorShape([None]).concatenate(shape[1:]) if shape.rank else tf.TensorShape([None])


def allgather(tensor, name=None, ignore_name_scope=False, process_set=global_process_set):
    """Every rank's ``tensor`` concatenated along the first dimension (which may differ)."""
    tensor = tf.convert_to_tensor(tensor)

    def now(v):
        return to_tf(synchronize(_torch_ops.allgather_async(to_torch(v), process_set=process_set)), v.dtype)

    @tf.custom_gradient
    def gather(x):
        out = run(now, x, _first_dim_unknown(x.shape))
        rows = tf.shape(x)[0] if x.shape.rank else 1

        def grad(dy):  # Horovod's convention: this rank's rows of the average of the ranks' gradients
            averaged = allreduce(dy, op=_torch_ops.Average, process_set=process_set)
            with tf.control_dependencies([averaged]):  # in a graph, every rank runs the two in this order
                counts = allgather(tf.reshape(tf.cast(rows, tf.int64), [1]), process_set=process_set)
            start = tf.reduce_sum(counts[:process_set.rank()])
            return tf.reshape(averaged[start:start + tf.cast(rows, tf.int64)], tf.shape(x))

        return out, grad

    return gather(tensor)


def alltoall(tensor, splits=None, name=None, ignore_name_scope=False, process_set=global_process_set):
    """Send ``splits[i]`` rows of ``tensor`` to rank i (even parts without splits); differentiable.

    Returns the received tensor (rows from rank 0 first) and, as in Horovod, only when
    ``splits`` is given, also the received splits (int32): ``(tensor, received_splits)``.
    """
    tensor = tf.convert_to_tensor(tensor)
    given = splits is not None
    wire_splits = tf.cast(tf.convert_to_tensor(splits if given else [], dtype_hint=tf.int32), tf.int32)
    received = []

    def now(v, s):
        out, recv = synchronize(_torch_ops.alltoall_async(to_torch(v), to_torch(s) if given else None,
                                                          process_set=process_set))
        return to_tf(out, v.dtype), to_tf(recv, tf.int32)

    @tf.custom_gradient
    def exchange(x):
        if tf.executing_eagerly():
            out, recv = now(x, wire_splits)
        else:
            out, recv = tf.py_function(now, [x, wire_splits], Tout=[x.dtype, tf.int32])
            out.set_shape(_first_dim_unknown(x.shape))
            recv.set_shape([process_set.size()])
        received.append(recv)
        return out, lambda dy: alltoall(dy, splits=recv, process_set=process_set)[0]

    output = exchange(tensor)
    return (output, received[0]) if given else output


def reducescatter(tensor, device_dense="", compression=Compression.none, op=_torch_ops.Average, name=None,
                  process_set=global_process_set, ignore_name_scope=False, prescale_factor=1.0,
                  postscale_factor=1.0):
    """Reduce ``tensor`` across the ranks and keep this rank's rows of the result; differentiable.

    The first dimension is divided as evenly as possible; lower ranks take the extra rows.
    """
    op = _torch_ops._resolve_op(op, None)
    tensor = tf.convert_to_tensor(tensor)
    wire, ctx = compression.compress(tensor)

    def now(v):
        return to_tf(synchronize(_torch_ops.reducescatter_async(
            to_torch(v), op=op, process_set=process_set, prescale_factor=prescale_factor,
            postscale_factor=postscale_factor)), v.dtype)

    @tf.custom_gradient
    def scatter(x):
        out = run(now, x, _first_dim_unknown(x.shape))

        def grad(dy):  # Horovod's convention: the gathered gradients, times size() for Sum
            scale = prescale_factor * postscale_factor * (process_set.size() if op == _torch_ops.Sum else 1)
            return allgather(dy, process_set=process_set) * scale

        return out, grad

    return compression.decompress(scatter(wire), ctx)


def grouped_reducescatter(tensors, device_dense="", compression=Compression.none, op=_torch_ops.Average, name=None,
                          process_set=global_process_set, ignore_name_scope=False, prescale_factor=1.0,
                          postscale_factor=1.0):
    """``reducescatter`` of each tensor in a list."""
    return [reducescatter(t, compression=compression, op=op, process_set=process_set,
                          prescale_factor=prescale_factor, postscale_factor=postscale_factor) for t in tensors]


def broadcast_variables(variables, root_rank: int = 0, process_set=global_process_set) -> None:
    """Assign every rank's variables rank ``root_rank``'s values."""
    for v in variables:
        v.assign(broadcast(v, root_rank, process_set=process_set))


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
