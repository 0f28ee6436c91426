"""``DistributedOptimizer`` for Keras 3: gradients averaged across the ranks before each update."""

from __future__ import annotations

import warnings

import tensorflow as tf

from .._core._reduction import resolve_op
from .._engine import communicator as _engine
from ..tensorflow import Adasum, Average, Compression, Sum, grouped_allreduce


def _in_xla_context() -> bool:
    try:
        from tensorflow.python.framework import ops
        from tensorflow.python.ops import control_flow_util
    except ImportError:  # pragma: no cover - TF internals moved
        return False
    return bool(control_flow_util.GraphOrParentsInXlaContext(ops.get_default_graph()))


def _averaging() -> bool:
    return _engine.is_initialized() and _engine.topology().size > 1


def turn_off_xla(model) -> None:
    """Compile ``model``'s train step without XLA, where the gradient averaging cannot run (size > 1)."""
    if not (_averaging() and isinstance(getattr(model, "optimizer", None), _DistributedKerasMixin)
            and model.jit_compile):
        return
    warnings.warn(
        "sparkhvd: this model was compiled with jit_compile=True (XLA; Keras's \"auto\" choice on GPUs), but "
        "DistributedOptimizer averages gradients in a Python-side collective that XLA cannot compile, so the "
        "train step runs without XLA instead. Pass jit_compile=False to model.compile() to silence this warning.",
        stacklevel=3)
    model.jit_compile = False
    model.train_function = None  # made again, without XLA, by the next fit()


class _DistributedKerasMixin:
    """Placed before the user's optimizer class: ``apply`` first averages the gradients."""

    def apply(self, grads, trainable_variables=None):
        if _averaging() and len(grads):
            if _in_xla_context():
                raise RuntimeError(
                    "model.fit compiled its train step with XLA (jit_compile=True, Keras's \"auto\" choice on GPUs), "
                    "where sparkhvd's gradient averaging cannot run; pass jit_compile=False to model.compile(), or "
                    "add hvd.BroadcastGlobalVariablesCallback(0) to fit()'s callbacks, which switches XLA off.")
            dense = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g for g in grads]
            present = [g for g in dense if g is not None]
            reduced = iter(grouped_allreduce(present, op=self._hvd_op, compression=self._hvd_compression))
            grads = [next(reduced) if g is not None else None for g in dense]
        return super().apply(grads, trainable_variables)


def DistributedOptimizer(optimizer, name=None, compression=Compression.none, backward_passes_per_step=1,
                         average_aggregated_gradients=False, op=Average, **_unused):
    """Wrap a Keras 3 optimizer so that every update uses gradients averaged across the ranks.

    ``op=Adasum`` combines each gradient by Adasum instead of averaging it, as Horovod's
    ``DistributedGradientTape`` does (Horovod's Keras optimizer refuses Adasum; its delta optimizer
    is TF1's only). Returns ``optimizer`` itself, its class
    turned into a subclass of its own class. For gradient
    accumulation use the optimizer's own ``gradient_accumulation_steps`` (each micro-batch's
    gradients are averaged across ranks, then accumulated).
    """
    import keras

    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise ValueError(f"DistributedOptimizer wraps a Keras optimizer, got {type(optimizer).__name__}.")
    if isinstance(optimizer, _DistributedKerasMixin):
        raise ValueError("this optimizer is already a DistributedOptimizer; wrap the original optimizer once.")
    op = resolve_op(op, None)
    if op not in (Average, Sum, Adasum):
        raise ValueError(f"DistributedOptimizer reduces gradients with op=hvd.Average, hvd.Sum or hvd.Adasum, got "
                         f"{op.name}.")
    if backward_passes_per_step != 1:
        raise NotImplementedError(
            f"backward_passes_per_step={backward_passes_per_step} is not implemented for Keras; create the optimizer "
            f"with gradient_accumulation_steps={backward_passes_per_step} instead (Keras 3 accumulates itself).")
    base = type(optimizer)
    # Saved models name the base class (Keras records __module__), so they load as the plain optimizer,
    # which load_model() wraps again.
    optimizer.__class__ = type(base.__name__, (_DistributedKerasMixin, base),
                               {"__module__": base.__module__, "__qualname__": base.__qualname__})
    optimizer._hvd_op = op
    optimizer._hvd_compression = compression
    return optimizer


def load_model(filepath, custom_optimizers=None, custom_objects=None, compression=Compression.none, op=Average):
    """``keras.models.load_model``, with the model's optimizer wrapped in DistributedOptimizer again.

    Keras saves a DistributedOptimizer as its base class (SGD, Adam, ...), so a loaded model's
    optimizer would otherwise stop averaging gradients.
    """
    import keras

    objects = dict(custom_objects or {})
    for cls in custom_optimizers or ():
        objects[cls.__name__] = cls
    model = keras.models.load_model(filepath, custom_objects=objects or None)
    if getattr(model, "optimizer", None) is not None and not isinstance(model.optimizer, _DistributedKerasMixin):
        DistributedOptimizer(model.optimizer, compression=compression, op=op)
    turn_off_xla(model)
    return model
