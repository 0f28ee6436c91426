"""A graph op that fails with a ``tf.errors.OpError``'s own code, for errors raised inside a ``py_function``.

TensorFlow's py_function kernel (tensorflow/python/lib/core/py_func.cc, ``DoCallPyFunc``) maps the
Python exception its function raised to a status code by class alone: ValueError and TypeError
to INVALID_ARGUMENT, StopIteration to OUT_OF_RANGE, MemoryError to RESOURCE_EXHAUSTED,
NotImplementedError to UNIMPLEMENTED, and everything else, ``tf.errors`` classes included, to
UNKNOWN ("TODO(ebrevdo): Check if exception is an OpError and use the OpError.error_code
property"). So a collective that fails with FailedPreconditionError (ranks disagreeing, as
Horovod reports it) in a py_function reaches the ``session.run`` / ``tf.function`` caller as
UnknownError, and no stock CPU kernel fails with a code and message it is given.

This module registers one such op, ``SparkhvdOpError`` (input: int64 ``error``), through
TensorFlow's C kernel API (tensorflow/c/kernels.h, exported by libtensorflow_framework) with a
ctypes callback, so no compiler is needed: the py_function catches the OpError, parks its code
and message under a key and returns the key; this op, run right after it, fails with that code
and the message unchanged (key 0: success, nothing to do). ``raise_op()`` is None where the C
API cannot be reached; callers then let the error go through the py_function as before.
"""

from __future__ import annotations

import ctypes
import itertools
import os
import threading

import tensorflow as tf

_pending: dict = {}  # key -> (error code, message), from the py_function to the op after it
_keys = itertools.count(1)
_lock = threading.Lock()
_state: dict = {}  # "name": the registered op's name (None: unavailable); "callbacks": kept alive
# the kernel's callbacks: create, compute, delete
_CREATE = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p)
_COMPUTE = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p)
_DELETE = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


def park(exc: tf.errors.OpError) -> int:
    """Keep ``exc``'s code and message for the op that raises them; the key to hand it."""
    key = next(_keys)
    _pending[key] = (exc.error_code, exc.message)
    return key


def _compute(lib, ctx) -> None:
    status = lib.TF_NewStatus()
    tensor = ctypes.c_void_p()
    try:
        lib.TF_GetInput(ctx, 0, ctypes.byref(tensor), status)
        if lib.TF_GetCode(status) != 0:  # a scalar int64 input always arrives: keep its error
            lib.TF_OpKernelContext_Failure(ctx, status)
            return
        key = ctypes.cast(lib.TF_TensorData(tensor), ctypes.POINTER(ctypes.c_int64))[0]
        lib.TF_DeleteTensor(tensor)
        if key:
            code, message = _pending.pop(key, (tf.errors.UNKNOWN, "sparkhvd: a collective failed (error lost)"))
            lib.TF_SetStatus(status, code, message.encode("utf-8", "replace"))
            lib.TF_OpKernelContext_Failure(ctx, status)
    finally:
        lib.TF_DeleteStatus(status)


def _library():
    """libtensorflow_framework, with the signatures of the C API functions this module calls."""
    void = ctypes.c_void_p
    lib = ctypes.CDLL(os.path.join(os.path.dirname(tf.__file__), "libtensorflow_framework.so.2"))
    for fn, res, args in [
        ("TF_NewStatus", void, []), ("TF_DeleteStatus", None, [void]), ("TF_GetCode", ctypes.c_int, [void]),
        ("TF_Message", ctypes.c_char_p, [void]), ("TF_SetStatus", None, [void, ctypes.c_int, ctypes.c_char_p]),
        ("TF_NewOpDefinitionBuilder", void, [ctypes.c_char_p]),
        ("TF_OpDefinitionBuilderAddInput", None, [void, ctypes.c_char_p]),
        ("TF_OpDefinitionBuilderSetIsStateful", None, [void, ctypes.c_bool]),
        ("TF_RegisterOpDefinition", None, [void, void]),
        ("TF_NewKernelBuilder", void, [ctypes.c_char_p, ctypes.c_char_p, _CREATE, _COMPUTE, _DELETE]),
        ("TF_RegisterKernelBuilder", None, [ctypes.c_char_p, void, void]),
        ("TF_GetInput", None, [void, ctypes.c_int, ctypes.POINTER(void), void]),
        ("TF_TensorData", void, [void]), ("TF_DeleteTensor", None, [void]),
        ("TF_OpKernelContext_Failure", None, [void, void]),
    ]:
        getattr(lib, fn).restype, getattr(lib, fn).argtypes = res, args
    return lib


def _register():
    """Register the op and its CPU kernel; ``(its name, the callbacks to keep alive)``."""
    lib = _library()
    from tensorflow.python.framework import op_def_registry

    # Registering a name twice aborts the process: another copy of this module may hold the first.
    name = next(n for n in (f"SparkhvdOpError{i or ''}" for i in itertools.count()) if op_def_registry.get(n) is None)
    callbacks = (_CREATE(lambda construction: None), _COMPUTE(lambda kernel, ctx: _compute(lib, ctx)),
                 _DELETE(lambda kernel: None))
    status = lib.TF_NewStatus()
    try:
        builder = lib.TF_NewOpDefinitionBuilder(name.encode())
        lib.TF_OpDefinitionBuilderAddInput(builder, b"error: int64")
        lib.TF_OpDefinitionBuilderSetIsStateful(builder, True)  # never folded, merged or pruned away
        lib.TF_RegisterOpDefinition(builder, status)
        if lib.TF_GetCode(status) == 0:
            lib.TF_RegisterKernelBuilder(name.encode(), lib.TF_NewKernelBuilder(name.encode(), b"CPU", *callbacks),
                                         status)
        if lib.TF_GetCode(status) != 0:
            raise RuntimeError(lib.TF_Message(status).decode())
    finally:
        lib.TF_DeleteStatus(status)
    return name, callbacks


def raise_op():
    """The name of the registered op (once per process), or None where it cannot be registered."""
    with _lock:
        if "name" not in _state:
            try:
                _state["name"], _state["callbacks"] = _register()
            except Exception:  # noqa: BLE001 - no C API here: errors stay UnknownError in graphs
                _state["name"] = None
        return _state["name"]


def raise_if_failed(key: tf.Tensor) -> tf.Operation:
    """The graph op that fails with the error parked under ``key`` (an int64 scalar; 0: none)."""
    from tensorflow.python.framework import op_def_library

    with tf.device("/device:CPU:0"):  # its only kernel, also where the graph's ops are pinned to a GPU
        return op_def_library._apply_op_helper(raise_op(), error=key, name="raise_if_failed")[2]
