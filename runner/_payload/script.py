"""Script mode: ``HorovodRunner(np).run("train.py", "--epochs", "3")`` runs a Python file on every rank.

The driver reads and compiles the script (so a missing file or a syntax error fails before anything
launches) and ships its source inside the pickled payload, since executors may not share the driver's
filesystem, together with the modules and packages of its folder (runner/_payload/script_folder.py). Each rank
runs it as ``python train.py --epochs 3`` would: as ``__main__``, with ``sys.argv = ["train.py", "--epochs",
"3"]``, ``__file__`` its path on the driver, and the shipped copy of its folder first on ``sys.path``.
"""

from __future__ import annotations

import linecache
import os
import sys
import types
from importlib.util import decode_source

from .script_folder import FolderLimits, ShippedFolder, collect, shipped


class ScriptExit(Exception):
    """The script ended with ``sys.exit(n)``, n not 0: a failure of the user's, never retried."""


def as_payload(main, args: tuple, kwargs: dict):
    """``(function, kwargs)`` for the ranks: ``main`` itself, or, for a script path, ``run_script``."""
    if not isinstance(main, (str, os.PathLike)):
        if args:
            raise TypeError(f"HorovodRunner.run got {len(args)} positional argument{'s' if len(args) > 1 else ''} "
                            f"after the function {getattr(main, '__name__', main)!r}; pass the function's arguments "
                            "by keyword (run(train, lr=0.1)), or pass a script path to give command-line arguments "
                            "(run('train.py', '--lr', '0.1')).")
        return main, kwargs
    path = os.fspath(main)
    if kwargs:
        raise TypeError(f"HorovodRunner.run got keyword arguments ({', '.join(sorted(kwargs))}) for the script "
                        f"{path!r}, which takes command-line arguments only; pass them as strings after the path, "
                        "e.g. run('train.py', '--lr', '0.1').")
    bad = [a for a in args if not isinstance(a, (str, os.PathLike, int, float)) or isinstance(a, bool)]
    if bad:
        raise TypeError(f"the command-line arguments of the script {path!r} must be strings (or numbers or paths, "
                        f"turned into strings), got {bad[0]!r} ({type(bad[0]).__name__}); pass e.g. "
                        f"run({path!r}, '--epochs', '3').")
    argv = [os.fspath(a) if isinstance(a, os.PathLike) else str(a) for a in args]
    source = read_script(path)
    limits = FolderLimits.from_env()
    # The folder python would put first on sys.path: the script's, symlinks resolved.
    folder = collect(os.path.dirname(os.path.realpath(path)), limits) if limits.ship else None
    return run_script, {"source": source, "path": path, "argv": argv, "file": os.path.abspath(path),
                        "folder": folder}


def read_script(path: str) -> str:
    """The script's source, read and compiled on the driver; ValueError, with the fix, when it cannot run."""
    if not os.path.exists(path):
        raise ValueError(f"the script {path!r} does not exist (looked in {os.getcwd()}); pass the path of a Python "
                         "file on the driver, absolute or relative to the current directory.")
    if not os.path.isfile(path):
        raise ValueError(f"the script {path!r} is not a file; pass the path of a Python file (e.g. "
                         f"{os.path.join(path, 'train.py')!r}), not a folder.")
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as exc:
        raise ValueError(f"the script {path!r} cannot be read on the driver ({exc.strerror}); make it readable "
                         "by this user, or copy it somewhere that is.") from exc
    try:
        source = decode_source(raw)
        compile(source, path, "exec")
    except (SyntaxError, UnicodeDecodeError) as exc:
        where = f" (line {exc.lineno}: {exc.msg})" if isinstance(exc, SyntaxError) else f" ({exc.reason})"
        raise ValueError(f"the script {path!r} is not valid Python source{where}; fix it, or check that the path "
                         "names your training script.") from exc
    return source


def run_script(source: str, path: str, argv: list, file: str, folder: ShippedFolder | None = None) -> None:
    """On a rank: run the shipped source as ``__main__``, as ``runpy.run_path(path, run_name="__main__")``
    would (that function reads the file, which the executor may not have), with the shipped copy of its folder
    first on ``sys.path`` (without one, the script's folder); ``sys.exit(0)`` is success."""
    if folder is None:
        sys.path.insert(0, os.path.dirname(file))
        return _run(source, path, argv, file)
    with shipped(folder):
        return _run(source, path, argv, file)


def _run(source: str, path: str, argv: list, file: str) -> None:
    code = compile(source, file, "exec")
    linecache.cache[file] = (len(source), None, source.splitlines(True), file)  # tracebacks show the lines
    module = types.ModuleType("__main__")
    module.__dict__.update(__file__=file, __cached__=None, __loader__=None, __package__=None, __spec__=None,
                           __builtins__=__builtins__)
    saved_main, saved_argv = sys.modules.get("__main__"), sys.argv
    sys.modules["__main__"] = module
    sys.argv = [path, *argv]
    try:
        exec(code, module.__dict__)
    except SystemExit as exc:
        if exc.code is None or exc.code == 0:
            return None
        status = exc.code if isinstance(exc.code, int) else 1
        said = "" if isinstance(exc.code, int) else f": {exc.code}"
        raise ScriptExit(f"the script {path} exited with status {status} (sys.exit({exc.code!r})){said}") from exc
    finally:
        sys.argv = saved_argv
        if saved_main is not None:
            sys.modules["__main__"] = saved_main
    return None

