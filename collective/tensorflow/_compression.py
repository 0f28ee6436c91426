"""Compression for tf.Tensors, and the reduction-op argument as Horovod reads it."""

from __future__ import annotations

import tensorflow as tf

from ..torch import Adasum, Average, ReduceOp, Sum


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


def resolve_op(op, average) -> ReduceOp:
    """Horovod's ``handle_average_backwards_compatibility``: ``op`` or the legacy ``average=``; Average by default."""
    if op is not None and average is not None:
        raise ValueError("allreduce got both op= and the legacy average=; pass only op=hvd.Average or op=hvd.Sum.")
    if op is None:
        return Average if average is None or average else Sum  # as Horovod: any falsy average= sums
    try:
        op = ReduceOp(op)
    except ValueError:
        raise ValueError(f"op={op!r} is not a reduction; use hvd.Average, hvd.Sum, hvd.Min, hvd.Max "
                         "or hvd.Product.") from None
    if op == Adasum:
        raise NotImplementedError("op=hvd.Adasum is not implemented by sparkhvd; use op=hvd.Average "
                                  "(the default), which gives the same result for equal learning rates.")
    return op
