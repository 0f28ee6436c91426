"""Horovod's reduction operations and how its API reads the ``op=`` / legacy ``average=`` arguments.

Backend-neutral: the torch, TensorFlow and Keras APIs all take their ``ReduceOp`` from here.
"""

from __future__ import annotations

import enum


class ReduceOp(enum.IntEnum):
    """Horovod's reduction operations."""

    Average = 0
    Sum = 1
    Adasum = 2
    Min = 3
    Max = 4
    Product = 5


Average, Sum, Adasum = ReduceOp.Average, ReduceOp.Sum, ReduceOp.Adasum
Min, Max, Product = ReduceOp.Min, ReduceOp.Max, ReduceOp.Product


def resolve_op(op, average) -> ReduceOp:
    """Horovod's ``handle_average_backwards_compatibility``: ``op`` or the legacy ``average=``; Average by default."""
    if op is not None and average is not None:
        raise ValueError("allreduce got both op= and the legacy average=; pass only op=hvd.Average or op=hvd.Sum.")
    if op is None:
        return Average if average is None or average else Sum  # as Horovod: any falsy average= sums
    try:
        op = ReduceOp(op)
    except ValueError:
        raise ValueError(f"op={op!r} is not a reduction; use hvd.Average, hvd.Sum, hvd.Adasum, hvd.Min, hvd.Max "
                         "or hvd.Product.") from None
    return op
