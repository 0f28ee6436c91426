"""Horovod's TensorFlow helpers: objects across the ranks, and the topology as graph ops."""

from __future__ import annotations

import tensorflow as tf

from .. import _core
from .._core import ProcessSet, global_process_set


def broadcast_object(obj, root_rank=0, session=None, name=None, process_set=global_process_set):
    """Rank ``root_rank``'s ``obj`` on every rank (cloudpickle); ``session`` is TF1's and is not needed."""
    return _core.broadcast_object(obj, root_rank, name=name, process_set=process_set)


def broadcast_object_fn(root_rank=0, session=None, name=None, process_set=global_process_set):
    """A function ``bcast(obj)`` that returns rank ``root_rank``'s ``obj`` on every rank.

    Horovod builds it from TF1 placeholders and a session; in TensorFlow 2 it is
    ``broadcast_object`` with the arguments bound.
    """
    def bcast(obj):
        return _core.broadcast_object(obj, root_rank, name=name, process_set=process_set)

    return bcast


def allgather_object(obj, session=None, name=None, process_set=global_process_set):
    """Every rank's ``obj``, as a list in rank order (cloudpickle); ``session`` is TF1's and is not needed."""
    return _core.allgather_object(obj, name=name, process_set=process_set)


def _runtime_int(read, name):
    """An int32 scalar that ``read()`` gives when the op runs (in a graph: each run), not when it is built."""
    if tf.executing_eagerly():
        return tf.constant(read(), dtype=tf.int32)
    out = tf.py_function(lambda: tf.constant(read(), dtype=tf.int32), [], Tout=tf.int32, name=name)
    out.set_shape([])
    return out


def _process_set(process_set_id, what):
    if isinstance(process_set_id, ProcessSet):
        return process_set_id
    if process_set_id == 0:
        return global_process_set
    raise ValueError(f"{what}(process_set_id={process_set_id!r}): sparkhvd finds a process set by its object, not "
                     f"its id; pass the ProcessSet itself ({what}(process_set_id=my_set)), or 0 for every rank.")


def rank_op(name=None):
    """This process's rank, as an op read when it runs."""
    return _runtime_int(_core.rank, name)


def local_rank_op(name=None):
    """This process's rank on its host, as an op read when it runs."""
    return _runtime_int(_core.local_rank, name)


def size_op(process_set_id=0, name=None):
    """The number of processes (in a process set: pass the ProcessSet), as an op read when it runs."""
    process_set = _process_set(process_set_id, "size_op")
    return _runtime_int(lambda: _core.size() if process_set is global_process_set else process_set.size(), name)


def local_size_op(name=None):
    """The number of processes on this host, as an op read when it runs."""
    return _runtime_int(_core.local_size, name)


def process_set_included_op(process_set_id=0, name=None):
    """1 if this process is in the process set (pass the ProcessSet), else 0; -3 (Horovod's
    HOROVOD_PROCESS_SET_ERROR_UNKNOWN_SET) for a set that is not registered. Read when it runs."""
    process_set = _process_set(process_set_id, "process_set_included_op")

    def read():
        _core.rank()  # raises, with the fix, before init()
        included = process_set.included()
        return -3 if included is None or process_set.process_set_id is None else int(included)

    return _runtime_int(read, name)


def join():
    """This rank has run out of data (``hvd.join`` of the torch API): an int32 scalar, the rank that joined last.

    Eagerly it blocks until every rank has joined; in a graph it is an op that does so when it runs.
    """
    return _runtime_int(_core.join, "join")
