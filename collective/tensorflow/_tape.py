"""DistributedGradientTape and PartialDistributedGradientTape: gradients averaged across the ranks."""

from __future__ import annotations

import tensorflow as tf

from .._core import Adasum, Average, Sum, global_process_set
from .._core._reduction import resolve_op
from ._compression import Compression
from ._ops import grouped_allreduce


def _key(source):
    """A hashable key for a tf.Variable, a Keras 3 variable (which wraps one) or a watched tensor."""
    if not isinstance(source, tf.Variable) and isinstance(getattr(source, "value", None), tf.Variable):
        source = source.value
    return source.ref() if hasattr(source, "ref") else id(source)


class DistributedGradientTape:
    """Wraps a ``tf.GradientTape``: ``gradient()`` returns gradients averaged across the ranks.

    ``op``: Average (default), Sum, or Adasum (each gradient combined by Adasum, as Horovod's
    tape does; a power-of-2 number of ranks); ``compression``: Compression.none or fp16;
    ``sparse_as_dense``: IndexedSlices become dense tensors first (otherwise they are
    allgathered, as Horovod does); ``gradient_predivide_factor`` splits the averaging before and
    after the sum, as in Horovod; ``process_set``: reduce over these ranks only (a rank outside
    the set keeps its own gradients). Every gradient goes in one fused reduction, so ``groups``
    and ``num_groups`` are accepted for compatibility and change nothing.
    ``register_local_source(variable)`` keeps that variable's gradient on this rank, divided by
    the set's size when ``scale_local_gradients`` (Horovod's rule).
    """

    def __init__(self, gradtape, device_dense="", device_sparse="", compression=Compression.none,
                 sparse_as_dense=False, op=Average, gradient_predivide_factor=1.0, num_groups=0, groups=None,
                 process_set=global_process_set, scale_local_gradients=True):
        op = resolve_op(op, None)
        if op not in (Average, Sum, Adasum):
            raise ValueError(f"DistributedGradientTape reduces with op=hvd.Average, hvd.Sum or hvd.Adasum, got "
                             f"{op.name}.")
        if gradient_predivide_factor != 1.0 and op != Average:
            raise ValueError(f"gradient_predivide_factor={gradient_predivide_factor} splits an average, but op is "
                             f"{op.name}; use op=hvd.Average, or leave gradient_predivide_factor at 1.0.")
        groups = groups if groups is not None else (num_groups or None)
        if groups is not None and not (isinstance(groups, list) or (isinstance(groups, int) and groups > 0)):
            raise ValueError(f"groups={groups!r}: pass a positive number of groups or a list of lists of "
                             "tf.Variables.")
        self._tape = gradtape
        self._compression = compression
        self._sparse_as_dense = sparse_as_dense
        self._op = op
        self._predivide = float(gradient_predivide_factor)
        self.process_set = process_set
        self.scale_local_gradients = scale_local_gradients
        self._local_sources = set()

    def __getattr__(self, name):
        return getattr(self._tape, name)

    def __enter__(self):
        self._tape.__enter__()
        return self

    def __exit__(self, *exc):
        return self._tape.__exit__(*exc)

    def register_local_source(self, source):
        """Keep ``source``'s gradient on this rank (not reduced across the ranks)."""
        self._local_sources.add(_key(source))

    def _reduce(self, grads):
        """Reduce the gradients that are not None in one fused operation (IndexedSlices: allgathered)."""
        if self._sparse_as_dense:
            grads = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g for g in grads]
        present = [g for g in grads if g is not None]
        if not present or not self.process_set.included() or self.process_set.size() == 1:
            return grads
        pre, post = 1.0, 1.0
        if self._op == Average and self._predivide != 1.0:
            pre, post = 1.0 / self._predivide, self._predivide

        def scale(g, factor):  # sparse ones are gathered, not summed: the split changes nothing for them
            return g if factor == 1.0 or isinstance(g, tf.IndexedSlices) else g * factor

        reduced = grouped_allreduce([scale(g, pre) for g in present], op=self._op, compression=self._compression,
                                    process_set=self.process_set)
        it = iter(scale(r, post) for r in reduced)
        return [next(it) if g is not None else None for g in grads]

    def _scale_local(self, g):
        if g is None or not self.scale_local_gradients:
            return g
        size = float(self.process_set.size())
        if isinstance(g, tf.IndexedSlices):
            return tf.IndexedSlices(g.values / size, g.indices, g.dense_shape)
        return g / size

    def gradient(self, target, sources, output_gradients=None, use_generic_names=False, **kwargs):
        grads = self._tape.gradient(target, sources, output_gradients, **kwargs)
        flat_sources, flat = tf.nest.flatten(sources), tf.nest.flatten(grads)
        local = [_key(s) in self._local_sources for s in flat_sources]
        reduced = iter(self._reduce([g for g, is_local in zip(flat, local) if not is_local]))
        out = [self._scale_local(g) if is_local else next(reduced) for g, is_local in zip(flat, local)]
        return tf.nest.pack_sequence_as(grads, out)

    def get_local_and_global_gradients(self, target, sources, output_gradients=None, use_generic_names=False):
        """``gradient()``, split into ``(local, global)`` lists of ``(source, gradient)`` pairs."""
        grads = self.gradient(target, sources, output_gradients, use_generic_names)
        local, everywhere = [], []
        for s, g in zip(tf.nest.flatten(sources), tf.nest.flatten(grads)):
            (local if _key(s) in self._local_sources else everywhere).append((s, g))
        return local, everywhere


def PartialDistributedGradientTape(gradtape, device_dense="", device_sparse="", compression=Compression.none,
                                   sparse_as_dense=False, op=Average, gradient_predivide_factor=1.0, num_groups=0,
                                   groups=None, process_set=global_process_set, local_layers=None,
                                   scale_local_gradients=True):
    """A DistributedGradientTape that keeps the gradients of ``local_layers``' weights on this rank."""
    import keras

    if local_layers is None:
        local_layers = []
    elif isinstance(local_layers, keras.layers.Layer):
        local_layers = [local_layers]
    else:
        local_layers = list(local_layers)
        others = sorted({type(layer).__name__ for layer in local_layers if not isinstance(layer, keras.layers.Layer)})
        if others:
            raise ValueError(f"local_layers must be Keras layers, got {', '.join(others)}; pass the model's layers "
                             "(for example model.layers[:2]).")
    tape = DistributedGradientTape(gradtape, device_dense, device_sparse, compression, sparse_as_dense, op,
                                   gradient_predivide_factor, num_groups, groups, process_set, scale_local_gradients)
    for layer in local_layers:
        for var in layer.trainable_weights:
            tape.register_local_source(var)
    return tape
