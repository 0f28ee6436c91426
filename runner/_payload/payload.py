"""What travels to the ranks: the training function and its arguments, pickled with cloudpickle,
plus the source lines of the code that goes by value.

A function defined in a notebook cell or a driver script goes by value; on an executor its file
(``/tmp/ipykernel_.../123.py``, the script) does not exist, so without its lines a rank's
traceback shows no code, and ``inspect.getsource`` (TensorFlow's AutoGraph) fails. The lines
travel with the payload and are put in the rank's ``linecache``. cloudpickle 3.1.3 and later
also rename such code's file to ``"<dynamic-code>"``; the real name is kept here.
"""

from __future__ import annotations

import collections
import functools
import io
import linecache
import pickle
import types

import cloudpickle

MAX_SOURCE_BYTES = 1 << 20  # source lines sent with one payload, at most


def dumps(obj) -> bytes:
    """``obj`` pickled by cloudpickle, with the source lines of its by-value code (read by ``loads``)."""
    files: set = set()

    class Pickler(cloudpickle.Pickler):
        dispatch_table = collections.ChainMap({types.CodeType: functools.partial(_code_reduce, files)},
                                              cloudpickle.Pickler.dispatch_table)

    with io.BytesIO() as buffer:
        Pickler(buffer).dump(obj)
        blob = buffer.getvalue()
    return pickle.dumps((blob, _sources(files)), protocol=pickle.HIGHEST_PROTOCOL)


def loads(payload: bytes):
    """What ``dumps`` pickled; its source lines go into this process's ``linecache`` first.

    Only for a payload from an authenticated frame: it is unpickled.
    """
    blob, sources = pickle.loads(payload)
    for name, lines in sources.items():
        linecache.cache[name] = (sum(map(len, lines)), None, lines, name)  # no mtime: never checked against a file
    return cloudpickle.loads(blob)


def _code_reduce(files: set, code: types.CodeType):
    constructor, args = cloudpickle.Pickler.dispatch_table[types.CodeType](code)
    if code.co_filename:
        files.add(code.co_filename)
        if "<dynamic-code>" in args:
            at = args.index("<dynamic-code>")
            args = (*args[:at], code.co_filename, *args[at + 1:])
    return constructor, args


def _sources(files: set) -> dict:
    """``file -> lines`` of the by-value code's files the driver has lines for, up to ``MAX_SOURCE_BYTES``."""
    found, total = {}, 0
    for name in sorted(files):
        if name.startswith("<") and name.endswith(">"):
            continue  # <string>, <stdin>: no lines to send
        lines = linecache.getlines(name)
        size = sum(map(len, lines))
        if lines and total + size <= MAX_SOURCE_BYTES:
            found[name], total = list(lines), total + size
    return found
