"""The TensorFlow collective tests' ranks: one ``HorovodRunner(np=-2)`` run for every module that asks, not one each.

A fresh TensorFlow rank process spends about 8 CPU-seconds importing TensorFlow (ranks forked from the warm process
that preloads it, runner/_warm/server.py, do not, but the first run of a session starts that process). Six fixtures
in five modules each ran two such ranks for a table of cases; now the first of them to ask runs every module's rank function, one after another
in the same two ranks, and keeps what each returned (and what the ranks printed) in a file that every pytest-xdist
worker of the session reads. Each rank function calls ``hvd.init()`` itself, as it did alone, and records its
cases' errors (tests/_cases.py), so a broken part fails its own tests only.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import io
import os
import sys

import cloudpickle
import pytest
from filelock import FileLock

from sparkhvd import HorovodRunner

# name: (module, rank function); each takes no argument but those in _WITH_FOLDER, given a folder of its own
PARTS = {
    "collectives": ("test_tensorflow_collectives", "_ops"),
    "gradients": ("test_tensorflow_gradients", "_gradients"),
    "keras_fit": ("test_keras_training", "_fit"),
    "keras_callbacks": ("test_keras_training", "_callbacks"),
    "elastic": ("test_elastic", "_tensorflow_state"),
    "adasum": ("test_adasum_across_ranks", "_tf_adasum"),
}
_WITH_FOLDER = ("keras_callbacks",)


def _every_part(parts):
    """On a rank: each part's rank function in turn; ``{name: value}``."""
    return {name: fn() for name, fn in parts}


def tf_ranks(part: str, tmp_path_factory) -> tuple:
    """``(values, printed)`` of the part ``part``: each rank's value, and every line the run printed."""
    pytest.importorskip("tensorflow")
    # under pytest-xdist each worker has basetemp <session's>/popen-gwN: the parent is the session's, shared
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    result = shared / "tf-ranks.pickle"
    with FileLock(str(shared / "tf-ranks.lock")):
        if not result.exists():
            result.write_bytes(cloudpickle.dumps(_run(shared / "tf-ranks")))
    values, printed = cloudpickle.loads(result.read_bytes())
    return [rank[part] for rank in values], printed


def _run(folder) -> tuple:
    modules = {module: importlib.import_module(module) for module, _ in PARTS.values()}
    parts = []
    for name, (module, fn) in PARTS.items():
        fn = getattr(modules[module], fn)
        if name in _WITH_FOLDER:
            (folder / name).mkdir(parents=True, exist_ok=True)
            fn = functools.partial(fn, folder=str(folder / name))
        parts.append((name, fn))
    for module in modules.values():  # the ranks cannot import tests/: the parts go by value, as a main function's
        cloudpickle.register_pickle_by_value(module)
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            values = HorovodRunner(np=-2).run_all(_every_part, parts=parts).values
    finally:
        for module in modules.values():
            cloudpickle.unregister_pickle_by_value(module)
    sys.stdout.write(printed.getvalue())
    return values, printed.getvalue().splitlines()
