"""Run code in a rank once a module has been imported, without importing it: ``when_imported``.

What a rank changes in a library (torch's ``destroy_process_group``: runner/_rank/process_groups.py; pyspark's
current ``TaskContext``: runner/_rank/task_context.py) is done when the user's code imports it, so a rank that does
not use the library pays nothing for it.
"""

from __future__ import annotations

import importlib.abc
import sys


def when_imported(name: str, then) -> None:
    """Call ``then(module)`` with module ``name``: now if it is imported, else once it is (once)."""
    if name in sys.modules:
        then(sys.modules[name])
    elif not any(isinstance(finder, AfterImport) and finder.name == name for finder in sys.meta_path):
        sys.meta_path.insert(0, AfterImport(name, then))


class AfterImport(importlib.abc.MetaPathFinder):
    """Calls ``then(module)`` once module ``name`` has been executed, and leaves ``sys.meta_path``.

    It finds ``name``'s spec with the finders after it and runs ``then`` after that spec's loader has executed
    the module (the loader is the one Python would use: ``__loader__`` and ``__spec__`` are unchanged)."""

    def __init__(self, name: str, then):
        self.name, self.then = name, then

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.name:
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find is not None else None
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        execute = getattr(loader, "exec_module", None)
        if execute is None:
            return spec
        then = self.then

        def exec_module(module):
            try:
                execute(module)
            finally:
                loader.__dict__.pop("exec_module", None)
            then(module)

        try:
            loader.exec_module = exec_module  # this module's own loader object: no other module's import
        except AttributeError:  # a loader without a __dict__: the module loads unwrapped
            pass
        return spec
