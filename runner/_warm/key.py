"""Which warm process may fork a rank: the key that names it, and the working-directory check.

A warm process serves ranks whose fresh ``python -m`` would have imported the same modules it preloaded.
The key is a hash of what decides that, except the working directory, which Spark makes anew for each
application's executors: ``cwd_refusal`` checks it per rank instead. An edited sparkhvd or an upgraded torch
gives a new key, and so a new warm process.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys

from .._shared.package import PACKAGE_DIR

# TMPDIR (TEMP, TMP): a zygote and the ranks it forks belong to one temp folder; where a job has a folder of its
# own (a sandbox removed when the job ends, a test session), its ranks do not fork from another's zygote.
_KEY_ENV = ("PYTHONPATH", "PYTHONHOME", "LD_LIBRARY_PATH", "LD_PRELOAD", "VIRTUAL_ENV", "TMPDIR", "TEMP", "TMP")
# Read once when a library loads (libgomp, OpenBLAS, MKL, torch and the torch._dynamo it preloads: TORCH_LOGS,
# TORCHDYNAMO_*, TORCHINDUCTOR_*, PYTORCH_*) or when Python starts: a rank forked from the zygote has the
# zygote's, so they are part of the key. OMP_NUM_THREADS is not: the fork applies it.
# TensorFlow's and Keras's (TF_CPP_MIN_LOG_LEVEL, KERAS_BACKEND) for the zygotes that preload them; not TF_CONFIG,
# which a MultiWorkerMirroredStrategy reads when it is made.
_KEY_ENV_PREFIXES = ("PYTHON", "OMP_", "GOMP_", "KMP_", "MKL_", "OPENBLAS_", "GOTO_", "TORCH", "PYTORCH_", "TF_",
                     "KERAS_")
_KEY_ENV_SKIP = ("PYTHONUNBUFFERED", "OMP_NUM_THREADS", "TF_CONFIG")
# CPython's own variables are PYTHON<NAME> (PYTHONPATH, PYTHONHASHSEED, ...) and these PYTHON_<NAME>s. Other
# PYTHON_ names are other programs': Spark gives its Python workers PYTHON_WORKER_FACTORY_SECRET (and, by
# its settings, PYTHON_WORKER_FACTORY_PORT, PYTHON_FAULTHANDLER_DIR, ...), new for every application, so
# keying on them would start a zygote per application and serve none twice. A rank gets them all the
# same: its whole environment is the agent's (runner/_warm/child.py).
_CPYTHON_UNDERSCORED = ("PYTHON_CPU_COUNT", "PYTHON_FROZEN_MODULES", "PYTHON_GIL", "PYTHON_JIT",
                        "PYTHON_PERF_JIT_SUPPORT", "PYTHON_PRESITE", "PYTHON_TLBC", "PYTHON_CONTEXT_AWARE_WARNINGS",
                        "PYTHON_THREAD_INHERIT_CONTEXT", "PYTHON_DISABLE_REMOTE_DEBUG")
_SKIP_DIRS = ("tests", "bench", "notebooks")


def zygote_key(package_dir: str | None = None, torch_files: list | None = None, env: dict | None = None,
               preload: tuple = ()) -> str:
    """A short hash of what decides the zygote's preloaded modules: the interpreter, the environment
    Python and the native libraries read when they start (``_keyed``; not what Spark sets per
    application, so one zygote serves every application on an executor), the user, and (name,
    mtime, size) of every ``.py`` file of sparkhvd and of torch's ``__init__.py`` / ``version.py``
    (stat only: torch is not imported). Not the working directory, which Spark makes anew for each
    application's executors: the zygote refuses a rank whose directory would change what it imports
    (``cwd_refusal``), and the agent then starts a fresh process.

    Not this process's ``sys.path``: a rank's, forked or fresh, comes from its own interpreter's
    start-up with this environment and directory, whatever the agent (a notebook) appended to its own.

    ``preload``: what the zygote imports besides torch (``("tensorflow",)``), a zygote of its own.
    """
    env = os.environ if env is None else env
    if package_dir is None:
        package_dir = PACKAGE_DIR
    if torch_files is None:
        torch_files = _torch_files()
    h = hashlib.sha256()
    for part in (sys.executable, sys.version, str(os.getuid()), *preload):
        h.update(part.encode("utf-8", "surrogateescape") + b"\0")
    for name in sorted(env):
        if _keyed(name):
            h.update(f"{name}={env[name]}\0".encode("utf-8", "surrogateescape"))
    for path in sorted(_package_files(package_dir)) + list(torch_files):
        try:
            st = os.stat(path)
            h.update(f"{path}:{st.st_mtime_ns}:{st.st_size}\0".encode("utf-8", "surrogateescape"))
        except OSError:
            h.update(f"{path}:missing\0".encode("utf-8", "surrogateescape"))
    return h.hexdigest()[:16]


def _keyed(name: str) -> bool:
    """Whether the environment variable ``name`` is part of the key: read by Python or a native library
    when it starts, never what a program sets per run (Spark's PYTHON_WORKER_FACTORY_SECRET)."""
    if name in _KEY_ENV:
        return True
    if name in _KEY_ENV_SKIP or not name.startswith(_KEY_ENV_PREFIXES):
        return False
    return not name.startswith("PYTHON_") or name in _CPYTHON_UNDERSCORED


def _package_files(root: str) -> list:
    """Every .py file of the package at ``root``, descending only into sub-packages."""
    found = []
    stack = [root]
    while stack:
        folder = stack.pop()
        try:
            entries = list(os.scandir(folder))
        except OSError:
            continue
        for entry in entries:
            if entry.name.endswith(".py") and entry.is_file():
                found.append(entry.path)
            elif (entry.is_dir() and not entry.name.startswith(".") and entry.name not in _SKIP_DIRS
                  and os.path.exists(os.path.join(entry.path, "__init__.py"))):
                stack.append(entry.path)
    return found


def _torch_files() -> list:
    try:
        spec = importlib.util.find_spec("torch")  # finds, does not import
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.origin:
        return ["torch:absent"]
    folder = os.path.dirname(spec.origin)
    return [os.path.join(folder, "__init__.py"), os.path.join(folder, "version.py")]


def cwd_refusal(cwd: str, start_dir: str | None, modules: dict) -> str | None:
    """Why a rank whose working directory is ``cwd`` cannot fork from a zygote started in ``start_dir`` with
    ``modules`` loaded, or None. A fresh ``python -m`` puts its working directory first on ``sys.path``, so the
    fork is the same process only where no preloaded module came from the zygote's own directory and none is
    shadowed by a module in the rank's (Spark gives each application's executors a working directory of its own,
    so the key leaves the directory out and this check stands in for it)."""
    if start_dir is None or os.path.realpath(cwd) == os.path.realpath(start_dir):
        return None
    for name, module in list(modules.items()):
        top, file = name.partition(".")[0], getattr(module, "__file__", None) or ""
        found_there = file.startswith(os.path.join(start_dir, top, "")) or (
            os.path.dirname(file) == start_dir and os.path.basename(file).startswith(f"{top}."))
        if found_there:  # through sys.path[0], which a rank elsewhere does not have
            return f"its module {name} was imported from its working directory {start_dir}, which the rank's is not"
    try:
        entries = set(os.listdir(cwd))
    except OSError as exc:
        return f"the rank's working directory {cwd} cannot be listed ({exc.strerror})"
    for top in sorted({name.partition(".")[0] for name in modules} - {"__main__"}):  # python -m never imports it
        if f"{top}.py" in entries or (top in entries and os.path.isfile(os.path.join(cwd, top, "__init__.py"))):
            return (f"the rank's working directory {cwd} holds a module {top}, which a fresh process would import "
                    "instead of the preloaded one")
    return None
