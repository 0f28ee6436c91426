"""Collectives on tf.Tensors, eager and in tf.function, with Horovod's gradients.

Each op hands its tensors to the core's asynchronous functions (``collective/_core``, the ones
the torch API uses too) through DLPack (``_bridge.py``) and waits for the result; in a graph the whole op is one
``py_function``. ``tf.IndexedSlices`` (sparse gradients) are reduced as Horovod does: their
values and indices are allgathered, and Average divides the values by the set's size.
"""

from __future__ import annotations

import tensorflow as tf

from .. import _core
from .._core import Average, HorovodInternalError, Sum, global_process_set
from .._core import synchronize as _wait
from .._core._reduction import resolve_op
from ._bridge import graph_op, run, to_tf, to_torch
from ._compression import Compression


class InvalidArgumentError(tf.errors.InvalidArgumentError, ValueError):
    """InvalidArgumentError that a bare ``py_function`` passes on as such too (it maps ValueError to
    InvalidArgument), where ``_bridge.graph_op`` cannot register the op that keeps any error's class."""


def synchronize(handle):
    """Wait for an op on the shared engine; its failure as the TensorFlow error Horovod raises (in a graph
    too: ``_bridge.graph_op`` passes a py_function's tf.errors on with their class)."""
    try:
        return _wait(handle)
    except HorovodInternalError as exc:  # the ranks disagreed on the op
        raise tf.errors.FailedPreconditionError(None, None, str(exc)) from exc
    except ValueError as exc:  # an argument problem on some rank
        raise InvalidArgumentError(None, None, str(exc)) from exc


def _py_function(fn, tensors, shapes):
    """``fn`` (tf.Tensors -> list of tf.Tensors) here, or in a graph through one py_function."""
    if tf.executing_eagerly():
        return list(fn(*tensors))
    outs = graph_op(fn, tensors, [t.dtype for t in tensors])
    for out, shape in zip(outs, shapes):
        out.set_shape(shape)
    return list(outs)


def _first_dim_unknown(shape: tf.TensorShape) -> tf.TensorShape:
    return tf.TensorShape([None]).concatenate(shape[1:]) if shape.rank else tf.TensorShape([None])


def _differentiable(x) -> bool:
    return x.dtype.is_floating or x.dtype.is_complex


def _size(process_set, dtype):
    return tf.cast(process_set.size(), dtype)


# ---- allreduce -------------------------------------------------------------------------------

def _check_sparse(op, prescale_factor, postscale_factor, what):
    if op not in (Average, Sum):
        raise NotImplementedError(f"{what} of tf.IndexedSlices supports op=hvd.Average or hvd.Sum, got "
                                  f"{op.name}; pass sparse_as_dense=True (or tf.convert_to_tensor the slices) to "
                                  f"reduce them as a dense tensor with {op.name}.")
    if prescale_factor != 1.0 or postscale_factor != 1.0:
        raise NotImplementedError(f"{what} of tf.IndexedSlices does not scale (got prescale_factor="
                                  f"{prescale_factor}, postscale_factor={postscale_factor}); multiply the slices' "
                                  "values yourself, or convert them to a dense tensor first.")


def allreduce(tensor, average=None, device_dense="", device_sparse="", compression=Compression.none, op=None,
              prescale_factor=1.0, postscale_factor=1.0, name=None, process_set=global_process_set,
              ignore_name_scope=False):
    """Reduce ``tensor`` across the ranks (default: Average); differentiable.

    A ``tf.IndexedSlices`` is allgathered instead (values and indices), which reduces the dense
    tensor it stands for; Average divides the values by the set's size.
    """
    op = resolve_op(op, average)
    if isinstance(tensor, tf.IndexedSlices):
        _check_sparse(op, prescale_factor, postscale_factor, "allreduce")
        values, indices = grouped_allgather([tensor.values, tensor.indices], process_set=process_set)
        if op == Average:
            values = values / _size(process_set, values.dtype)
        return tf.IndexedSlices(values, indices, dense_shape=tensor.dense_shape)
    tensor = tf.convert_to_tensor(tensor)
    wire, ctx = compression.compress(tensor)

    def now(v):
        return to_tf(synchronize(_core.allreduce_async(to_torch(v), op=op, prescale_factor=prescale_factor,
                                                           postscale_factor=postscale_factor,
                                                           process_set=process_set)), v.dtype)

    @tf.custom_gradient
    def reduce(x):
        out = run(now, x, x.shape)
        return out, lambda dy: allreduce(dy, op=op, prescale_factor=prescale_factor,
                                         postscale_factor=postscale_factor, process_set=process_set)

    return compression.decompress(reduce(wire), ctx)


def _grouped_dense(tensors, op, prescale_factor, postscale_factor, compression, process_set):
    """One fused reduction (one per dtype) of dense tensors, with Horovod's gradient (the same reduction)."""

    def now(*ts):
        wires = [compression.compress(t) for t in ts]
        torch_tensors = [to_torch(w).clone() for w, _ in wires]
        synchronize(_core.grouped_allreduce_async_(torch_tensors, op=op, prescale_factor=prescale_factor,
                                                       postscale_factor=postscale_factor, process_set=process_set))
        return [compression.decompress(to_tf(t, w.dtype), c) for t, (w, c) in zip(torch_tensors, wires)]

    @tf.custom_gradient
    def reduce(*xs):
        outs = _py_function(now, xs, [x.shape for x in xs])

        def grad(*dys):  # an output nobody used has no gradient: it still takes part, as zeros
            real = [k for k, x in enumerate(xs) if _differentiable(x)]
            reduced = _grouped_dense([tf.zeros_like(xs[k]) if dys[k] is None else dys[k] for k in real], op,
                                     prescale_factor, postscale_factor, compression, process_set) if real else []
            grads = [None] * len(xs)
            for k, g in zip(real, reduced):
                grads[k] = g
            return grads

        return outs, grad

    return list(reduce(*tensors))


def grouped_allreduce(tensors, average=None, device_dense="", device_sparse="", compression=Compression.none,
                      op=None, prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set,
                      ignore_name_scope=False, name=None):
    """Reduce a list of tensors in one fused operation (one reduction per dtype); differentiable.

    ``tf.IndexedSlices`` in the list are allgathered together, as ``allreduce`` does with one.
    Inside ``tf.function`` each of the two groups is one ``py_function``.
    """
    if not tensors:
        return []
    op = resolve_op(op, average)
    results = [None] * len(tensors)
    sparse = [i for i, t in enumerate(tensors) if isinstance(t, tf.IndexedSlices)]
    dense = [i for i, t in enumerate(tensors) if not isinstance(t, tf.IndexedSlices)]
    gathered = []
    if sparse:
        _check_sparse(op, prescale_factor, postscale_factor, "grouped_allreduce")
        slices = [tensors[i] for i in sparse]
        gathered = grouped_allgather([s.values for s in slices] + [s.indices for s in slices],
                                     process_set=process_set)
        for k, (i, s) in enumerate(zip(sparse, slices)):
            values = gathered[k]
            if op == Average:
                values = values / _size(process_set, values.dtype)
            results[i] = tf.IndexedSlices(values, gathered[len(slices) + k], dense_shape=s.dense_shape)
    if dense:
        with tf.control_dependencies(gathered):  # in a graph, every rank runs the two groups in this order
            reduced = _grouped_dense([tf.convert_to_tensor(tensors[i]) for i in dense], op, prescale_factor,
                                     postscale_factor, compression, process_set)
        for i, r in zip(dense, reduced):
            results[i] = r
    return results


# ---- allgather, broadcast --------------------------------------------------------------------

def _rows(x):
    return tf.cast(tf.shape(x)[0], tf.int64) if x.shape.rank != 0 else tf.constant(1, tf.int64)


def _allgather_grads(dys, xs, outs, process_set):
    """Horovod's allgather gradient: this rank's rows of the average of the ranks' gradients."""
    real = [k for k, x in enumerate(xs) if _differentiable(x)]  # the same on every rank: no gradient for ints
    grads = [None] * len(xs)
    if not real:
        return grads
    averaged = grouped_allreduce([tf.zeros_like(outs[k]) if dys[k] is None else dys[k] for k in real], op=Average,
                                 process_set=process_set)
    rows = tf.stack([_rows(xs[k]) for k in real])
    with tf.control_dependencies(averaged):  # in a graph, every rank runs the two in this order
        counts = allgather(tf.reshape(rows, [1, -1]), process_set=process_set)  # [set size, len(real)]
    starts = tf.reduce_sum(counts[:process_set.rank()], axis=0)
    for j, (k, a) in enumerate(zip(real, averaged)):
        grads[k] = tf.reshape(a[starts[j]:starts[j] + rows[j]], tf.shape(xs[k]))
    return grads


def grouped_allgather(tensors, name=None, ignore_name_scope=False, process_set=global_process_set):
    """``allgather`` of each tensor in a list, as one operation; differentiable."""
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    if not tensors:
        return []

    def now(*ts):
        outs = synchronize(_core.grouped_allgather_async([to_torch(t) for t in ts], process_set=process_set))
        return [to_tf(o, t.dtype) for o, t in zip(outs, ts)]

    @tf.custom_gradient
    def gather(*xs):
        outs = _py_function(now, xs, [_first_dim_unknown(x.shape) for x in xs])
        return outs, lambda *dys: _allgather_grads(dys, xs, outs, process_set)

    return list(gather(*tensors))


def allgather(tensor, name=None, ignore_name_scope=False, process_set=global_process_set):
    """Every rank's ``tensor`` concatenated along the first dimension (which may differ)."""
    tensor = tf.convert_to_tensor(tensor)

    def now(v):
        return to_tf(synchronize(_core.allgather_async(to_torch(v), process_set=process_set)), v.dtype)

    @tf.custom_gradient
    def gather(x):
        out = run(now, x, _first_dim_unknown(x.shape))
        return out, lambda dy: _allgather_grads([dy], [x], [out], process_set)[0]

    return gather(tensor)


def broadcast(tensor, root_rank, name=None, ignore_name_scope=False, process_set=global_process_set):
    """Rank ``root_rank``'s value of ``tensor``; differentiable (the root gets the averaged gradient)."""
    tensor = tf.convert_to_tensor(tensor)

    def now(v):
        return to_tf(synchronize(_core.broadcast_async(to_torch(v), root_rank, process_set=process_set)),
                     v.dtype)

    @tf.custom_gradient
    def bcast(x):
        out = run(now, x, x.shape)

        def grad(dy):  # Horovod's convention: the average of the ranks' gradients, on the root
            averaged = allreduce(dy, op=Average, process_set=process_set)
            # Not tf.zeros_like: in a graph it is a constant that never runs the allreduce, and the root
            # would wait for this rank forever.
            return averaged if _core.rank() == root_rank else averaged * 0

        return out, grad

    return bcast(tensor)


def _tf_variable(v):
    if isinstance(v, tf.Variable):
        return v
    if isinstance(getattr(v, "value", None), tf.Variable):  # a Keras 3 variable wraps one
        return v.value
    raise TypeError(f"broadcast_ assigns tf.Variables in place, got {type(v).__name__}; use "
                    "hvd.broadcast(tensor, root_rank) for a tensor.")


def broadcast_(variables, root_rank, name=None, process_set=global_process_set):
    """Assign every rank's ``variables`` (tf.Variables) rank ``root_rank``'s values, in place.

    Returns the variables' new values, as Horovod does. The variables travel together: every
    broadcast starts before the first is waited for.
    """
    variables = [_tf_variable(v) for v in variables]
    if not variables:
        return []

    def now(*ts):
        handles = [_core.broadcast_async(to_torch(t), root_rank, process_set=process_set) for t in ts]
        return [to_tf(synchronize(h), t.dtype) for h, t in zip(handles, ts)]

    values = [v.read_value() for v in variables]
    outs = _py_function(now, values, [v.shape for v in variables])
    assigns = [v.assign(out) for v, out in zip(variables, outs)]
    with tf.control_dependencies(assigns):
        return [v.read_value() for v in variables]


def broadcast_variables(variables, root_rank: int = 0, process_set=global_process_set, inplace=False):
    """Assign every rank's variables rank ``root_rank``'s values.

    Every variable travels in one ``broadcast_`` (``inplace`` is accepted for Horovod
    compatibility: both ways assign in place). Eagerly it returns None; in a graph, the op
    that does it (Horovod's ``tf.group``).
    """
    values = broadcast_(variables, root_rank, process_set=process_set)
    return None if tf.executing_eagerly() else tf.group(*values)


def broadcast_global_variables(root_rank):
    """TF1 graphs: broadcast every global variable from ``root_rank`` (returns the op to run)."""
    if tf.executing_eagerly():
        raise RuntimeError("hvd.broadcast_global_variables() needs a TF1 graph, but TensorFlow is executing eagerly; "
                           "use hvd.broadcast_variables(model.variables, root_rank) instead.")
    return broadcast_variables(tf.compat.v1.global_variables(), root_rank)


# ---- alltoall, reducescatter -----------------------------------------------------------------

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
        out, recv = synchronize(_core.alltoall_async(to_torch(v), to_torch(s) if given else None,
                                                         process_set=process_set))
        return to_tf(out, v.dtype), to_tf(recv, tf.int32)

    @tf.custom_gradient
    def exchange(x):
        if tf.executing_eagerly():
            out, recv = now(x, wire_splits)
        else:
            out, recv = graph_op(now, [x, wire_splits], [x.dtype, tf.int32])
            out.set_shape(_first_dim_unknown(x.shape))
            recv.set_shape([process_set.size()])
        received.append(recv)
        return out, lambda dy: alltoall(dy, splits=recv, process_set=process_set)[0]

    output = exchange(tensor)
    return (output, received[0]) if given else output


def reducescatter(tensor, device_dense="", compression=Compression.none, op=Average, name=None,
                  process_set=global_process_set, ignore_name_scope=False, prescale_factor=1.0,
                  postscale_factor=1.0):
    """Reduce ``tensor`` across the ranks and keep this rank's rows of the result; differentiable.

    The first dimension is divided as evenly as possible; lower ranks take the extra rows.
    """
    op = resolve_op(op, None)
    tensor = tf.convert_to_tensor(tensor)
    wire, ctx = compression.compress(tensor)

    def now(v):
        return to_tf(synchronize(_core.reducescatter_async(
            to_torch(v), op=op, process_set=process_set, prescale_factor=prescale_factor,
            postscale_factor=postscale_factor)), v.dtype)

    @tf.custom_gradient
    def scatter(x):
        out = run(now, x, _first_dim_unknown(x.shape))

        def grad(dy):  # Horovod's convention: the gathered gradients, times size() for Sum
            scale = prescale_factor * postscale_factor * (process_set.size() if op == Sum else 1)
            return allgather(dy, process_set=process_set) * scale

        return out, grad

    return compression.decompress(scatter(wire), ctx)


def grouped_reducescatter(tensors, device_dense="", compression=Compression.none, op=Average, name=None,
                          process_set=global_process_set, ignore_name_scope=False, prescale_factor=1.0,
                          postscale_factor=1.0):
    """``reducescatter`` of each tensor in a list."""
    return [reducescatter(t, compression=compression, op=op, process_set=process_set,
                          prescale_factor=prescale_factor, postscale_factor=postscale_factor) for t in tensors]
