"""Horovod's ``horovod.tensorflow.util``: the helpers Horovod's own code and tests import.

A public module name, not ``_util``, because Horovod code reaches it by that path
(``from horovod.tensorflow.util import _executing_eagerly``, ``hvd.util._executing_eagerly()``).
"""

from __future__ import annotations

import tensorflow as tf


def _executing_eagerly() -> bool:
    """Whether TensorFlow runs ops eagerly here (False while a tf.function or a graph is being built)."""
    return tf.executing_eagerly()


def _make_subgraph(f):
    """``f`` as a tf.function."""
    return tf.function(f)


def _cache(f):
    """Memoize ``f`` on its arguments and on whether TensorFlow executes eagerly."""
    cache = {}

    def wrapper(*args):
        key = (args, _executing_eagerly())
        if key not in cache:
            cache[key] = f(*args)
        return cache[key]

    return wrapper


def vars_to_refs(vars):
    """Variables (nested lists) as hashable references (tuples)."""
    if isinstance(vars, list):
        return tuple(vars_to_refs(v) for v in vars)
    return vars.ref()


def refs_to_vars(refs):
    """The inverse of ``vars_to_refs``."""
    if isinstance(refs, tuple):
        return [refs_to_vars(r) for r in refs]
    return refs.deref()
