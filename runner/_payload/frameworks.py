"""Which frameworks a run's ranks will import, told from the training function before it is sent.

The warm process (``runner/_warm/server.py``) preloads torch for every rank; a rank that imports TensorFlow
pays about 8 CPU-seconds for it, every rank and every restart. When the function (or the script) names
TensorFlow or Keras, its ranks are forked from a warm process that has imported them too. Told from the code,
never by running it: the names a function's code uses (``import tensorflow``, ``keras.Sequential``, a module
bound to ``tf`` in its globals), those of the functions it calls through its globals and closure, a few levels
deep, and a script's imports. A wrong guess only costs time: a rank imports what it needs either way.
"""

from __future__ import annotations

import ast
import functools
import sys
import types

TENSORFLOW = "tensorflow"
_NAMES = frozenset({"tensorflow", "keras", "tf_keras"})  # a dotted name with one of these parts
_DEPTH = 3  # functions reached through globals or closures: how deep


def warm_imports(main, kwargs: dict) -> tuple:
    """``("tensorflow",)`` when the ranks of ``main(**kwargs)`` will import TensorFlow or Keras, else ``()``."""
    from .script import run_script

    if main is run_script:
        return (TENSORFLOW,) if _script_imports(kwargs.get("source", "")) else ()
    return (TENSORFLOW,) if _uses(main, kwargs) else ()


@functools.lru_cache(maxsize=256)
def _users(module_name: str) -> bool:
    """Whether functions of the module ``module_name`` are the user's own code (a notebook's, a script's)."""
    from .function import _is_user_module

    module = sys.modules.get(module_name)
    return module_name == "__main__" or (module is not None and _is_user_module(module))


def _named(name: str) -> bool:
    return not _NAMES.isdisjoint(name.split("."))


def _script_imports(source: str) -> bool:
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return False
    for node in ast.walk(tree):
        if isinstance(node, ast.Import) and any(_named(alias.name) for alias in node.names):
            return True
        if isinstance(node, ast.ImportFrom) and (_named(node.module or "")
                                                 or any(_named(alias.name) for alias in node.names)):
            return True
    return False


def _codes(code: types.CodeType):
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _codes(const)


def _uses(main, kwargs: dict) -> bool:
    seen: set = set()
    stack = [(main, 0)] + [(value, 1) for value in kwargs.values()]
    while stack:
        obj, depth = stack.pop()
        if id(obj) in seen or depth > _DEPTH:
            continue
        seen.add(id(obj))
        if isinstance(obj, types.ModuleType):
            if _named(obj.__name__):
                return True
            continue
        if isinstance(obj, functools.partial):
            stack += [(obj.func, depth)] + [(a, depth + 1) for a in (*obj.args, *obj.keywords.values())]
            continue
        if isinstance(obj, type):  # a class the function uses: a Keras model's subclass
            if any(_named(getattr(base, "__module__", "") or "") for base in obj.__mro__):
                return True
            continue
        fn = getattr(obj, "__func__", obj)  # a bound method's function
        code = getattr(fn, "__code__", None)
        if not isinstance(code, types.CodeType):
            if _named(getattr(type(obj), "__module__", "") or ""):  # a Keras model or layer passed in
                return True
            continue
        module = getattr(fn, "__module__", "") or ""
        if _named(module):
            return True
        if depth and not _users(module):  # a library's function: its code is not the training function's
            continue
        found = getattr(fn, "__globals__", None) or {}
        for name in {name for c in _codes(code) for name in c.co_names}:
            if _named(name):
                return True
            value = found.get(name)
            if isinstance(value, types.ModuleType) or callable(value):
                stack.append((value, depth + 1))
        for cell in getattr(fn, "__closure__", None) or ():
            try:
                stack.append((cell.cell_contents, depth + 1))
            except ValueError:  # an empty cell
                pass
    return False
