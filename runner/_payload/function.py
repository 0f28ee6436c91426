"""The training function and its arguments, pickled for the ranks on the driver; a warning where they are large."""

from __future__ import annotations

import functools
import inspect
import os
import sys
import sysconfig
import warnings

import cloudpickle

from . import payload as _payload

LARGE_PAYLOAD_BYTES = 10 * 1024 * 1024


def pickle_function(main, kwargs) -> bytes:
    """``(main, kwargs)`` pickled for the ranks; ``main``'s module goes by value where it is the user's own file."""

    target = main
    while isinstance(target, functools.partial):  # run(partial(train, 0.1)): train's module
        target = target.func
    module = sys.modules.get(getattr(target, "__module__", None) or "")
    by_value = (module is not None and _is_user_module(module)  # and not registered already (by the user: kept)
                and module.__name__ not in cloudpickle.list_registry_pickle_by_value())
    if by_value:  # a script beside the driver: the executors may not be able to import it
        cloudpickle.register_pickle_by_value(module)
    try:
        payload = _payload.dumps((main, kwargs))
    except Exception as exc:
        raise TypeError(f"HorovodRunner could not pickle {getattr(main, '__name__', main)!r} and its "
                        f"arguments for the ranks: {exc}. Create unpicklable objects (sessions, locks, "
                        "open files) inside the function instead of capturing them.") from exc
    finally:
        if by_value:
            cloudpickle.unregister_pickle_by_value(module)
    if len(payload) > LARGE_PAYLOAD_BYTES:
        warnings.warn(f"the training function and its arguments pickle to {size(len(payload))}, which every "
                      f"rank downloads; the largest captured objects: {_captured_sizes(main, kwargs)}. "
                      "Load large data inside the function (from files or a data set) instead.",
                      UserWarning, stacklevel=4)
    return payload


def _is_user_module(module) -> bool:
    """A module of the user's own (not installed, not the standard library, not ours)."""
    name = module.__name__
    path = getattr(module, "__file__", None)
    if name == "__main__" or name.split(".")[0] == "sparkhvd" or not path:
        return False
    path = os.path.realpath(path)
    installed = {os.path.realpath(p) for p in sysconfig.get_paths().values()}
    installed |= {os.path.realpath(p) for p in sys.path if "site-packages" in p or "dist-packages" in p}
    return not any(path.startswith(root + os.sep) for root in installed)


def _captured_sizes(main, kwargs) -> str:
    """Name the biggest things the function captured, for the large-closure warning."""

    named = {}
    try:
        captured = inspect.getclosurevars(main)
        named.update({f"global {k}": v for k, v in captured.globals.items()})
        named.update({f"closure variable {k}": v for k, v in captured.nonlocals.items()})
    except TypeError:
        pass
    named.update({f"argument {k}": v for k, v in kwargs.items()})
    sizes = []
    for name, value in named.items():
        if inspect.ismodule(value):
            continue
        try:
            sizes.append((len(cloudpickle.dumps(value)), name))
        except Exception:  # noqa: BLE001 - what cannot be pickled alone is left out of the list
            continue
    sizes.sort(reverse=True)
    return ", ".join(f"{name} ({size(n)})" for n, name in sizes[:3]) or "none found by name"


def size(n: int) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n} B"
