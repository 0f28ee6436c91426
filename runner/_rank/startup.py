"""The process state every rank starts with, fresh or forked: one function, ``prepare``, that both paths run.

A fresh rank (``python -m sparkhvd.runner._rank.worker``, runner/_agent/process.py) runs it first thing in
``__main__``; a rank forked from the warm process runs it in ``become_rank`` (runner/_warm/child.py), after
the fork has taken on the rank's pipes, directory and environment. In a fresh process most of it finds
nothing to do (torch and NumPy are not imported yet and read the environment when they load); in a forked
one it undoes what the zygote's own start left behind.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

from ..._common import settings
from . import process_groups

_BLAS_SET_THREADS = ("openblas_set_num_threads", "openblas_set_num_threads64_",
                     "scipy_openblas_set_num_threads", "scipy_openblas_set_num_threads64_")


def prepare(env=None) -> None:
    """Set this process's state as a fresh ``python`` with the environment ``env`` (None: this process's) has it:
    the default signal handlers, the CPU thread counts that ``env`` asks for (runner/_agent/env.py computes them), a
    NumPy generator seeded from the OS, the temp folder found again from the environment, and torch's
    ``destroy_process_group`` wrapped to keep the groups it destroys (now, or when torch.distributed loads:
    runner/_rank/process_groups.py)."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    apply_threads(env)
    if "numpy" in sys.modules:  # a fresh process seeds numpy's global generator from the OS
        sys.modules["numpy"].random.seed()
    if "tempfile" in sys.modules:  # found again from the rank's own TMPDIR, as in a fresh process
        sys.modules["tempfile"].tempdir = None
    process_groups.keep_destroyed_groups()


def apply_threads(env=None) -> None:
    """What the rank's environment would have set when torch's OpenMP and numpy's OpenBLAS loaded."""
    omp = settings.OMP_NUM_THREADS.get(env) or ""
    torch = sys.modules.get("torch")
    if torch is not None and omp.isdigit() and int(omp) > 0:
        torch.set_num_threads(int(omp))
    wanted = settings.OPENBLAS_NUM_THREADS.get(env) or settings.GOTO_NUM_THREADS.get(env) or omp
    if not (wanted.isdigit() and int(wanted) > 0):
        wanted = str(len(os.sched_getaffinity(0)))
    if int(wanted) == 1:
        return
    try:
        with open("/proc/self/maps") as maps:
            libs = {line.split()[-1] for line in maps if "openblas" in line and ".so" in line}
    except OSError:
        return
    for lib in libs:
        try:
            handle = ctypes.CDLL(lib)
        except OSError:
            continue
        for name in _BLAS_SET_THREADS:
            fn = getattr(handle, name, None)
            if fn is not None:
                fn(ctypes.c_int(int(wanted)))
                break
