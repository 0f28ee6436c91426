"""Horovod's ``horovod.spark.run``, run by sparkhvd: ``sparkhvd.runner.horovod_spark_run``, and ``horovod.spark.run``
through the aliases (runner/_rank/aliases.py).

The same signature and result as Horovod's (horovod/spark/runner.py): ``fn(*args, **kwargs)`` on
``num_proc`` Spark tasks, every rank's value returned as a list in rank order. It is a thin layer
over ``HorovodRunner``: the same launch, logs and errors (``HorovodRunError``).
"""

from __future__ import annotations

import contextlib
import inspect
import numbers
import os
import sys

from ..._common import settings
from .._horovod_runner import HorovodRunner
from .._payload.mlflow import shared_run

__all__ = ["run"]


def run(fn, args=(), kwargs=None, num_proc=None, start_timeout=None, use_mpi=None, use_gloo=None,
        extra_mpi_args=None, env=None, stdout=None, stderr=None, verbose=1, nics=None,
        prefix_output_with_timestamp=False, executable=None):
    """Run ``fn(*args, **kwargs)`` on ``num_proc`` Spark tasks (default: the active SparkContext's
    ``defaultParallelism``); return every rank's value, a list in rank order.

    ``start_timeout``: seconds for the tasks to start (default ``$HOROVOD_SPARK_START_TIMEOUT``, else 600).
    ``env``: variables added to every rank's environment. ``stdout``: where the ranks' lines, shown on the
    driver as ``[rank] line``, go (default ``sys.stdout``); a rank's stderr lines go there too.
    ``nics``: the one network interface the ranks talk on. ``verbose`` and
    ``prefix_output_with_timestamp`` are accepted and change nothing, and so is ``use_gloo`` (Horovod
    reads ``use_gloo=False`` as unset too). MPI (``use_mpi=True``, ``extra_mpi_args``), another
    ``executable`` and a separate ``stderr`` stream cannot apply: they raise ``ValueError`` naming
    them and the fix.
    """
    _refuse(use_mpi=use_mpi, use_gloo=use_gloo, extra_mpi_args=extra_mpi_args, executable=executable,
            stdout=stdout, stderr=stderr)
    main, keywords = _as_keywords(fn, tuple(args), dict(kwargs or {}))
    extra_env = _check_env(env)
    runner = HorovodRunner(_num_proc(num_proc), start_timeout=_start_timeout(start_timeout),
                           network_interface=_one_nic(nics))
    shown = contextlib.nullcontext() if stdout is None or stdout is sys.stdout else contextlib.redirect_stdout(stdout)
    with shown, shared_run() as tracking:
        return runner._run(main, keywords, every_value=True, env={**tracking, **extra_env}).values


def _refuse(*, use_mpi, use_gloo, extra_mpi_args, executable, stdout, stderr) -> None:
    why = []
    if use_mpi:
        why.append(f"use_mpi={use_mpi!r}: sparkhvd never uses MPI (its ranks talk over gloo, and NCCL on GPUs); "
                   "drop use_mpi.")
    if extra_mpi_args:
        why.append(f"extra_mpi_args={extra_mpi_args!r}: sparkhvd never runs mpirun; drop extra_mpi_args (Horovod's "
                   "settings, such as HOROVOD_FUSION_THRESHOLD, go in env=).")
    if executable is not None and os.path.realpath(executable) != os.path.realpath(sys.executable):
        why.append(f"executable={executable!r}: sparkhvd starts each rank with the Python the Spark executors run; "
                   "set spark.pyspark.python (or PYSPARK_PYTHON) to it instead, and drop executable.")
    if stderr is not None and stderr is not sys.stderr and stderr is not stdout:
        why.append(f"stderr={stderr!r}: sparkhvd shows each rank's stdout and stderr together on the driver, as "
                   "[rank] lines, on sys.stdout or stdout=; drop stderr (each rank's log file keeps its stderr).")
    if why:
        raise ValueError("horovod.spark.run on sparkhvd cannot apply " + " ".join(why))


def _as_keywords(fn, args: tuple, kwargs: dict):
    """``(function, keyword arguments)`` for HorovodRunner, which passes keywords only: ``fn`` itself where
    ``args`` bind to named parameters, else a function calling ``fn(*args, **kwargs)``."""
    if not callable(fn):
        raise TypeError(f"horovod.spark.run needs a function to run, got {type(fn).__name__}; pass fn, and its "
                        "arguments as args= and kwargs=.")
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin or extension function: no signature to bind to
        return _applied(fn, args, kwargs), {}
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError as exc:
        raise TypeError(f"horovod.spark.run cannot call {getattr(fn, '__name__', fn)}{signature} with args={args!r} "
                        f"and kwargs={kwargs!r}: {exc}; pass the arguments fn takes.") from None
    keywords = {}
    for name, value in bound.arguments.items():
        kind = signature.parameters[name].kind
        if kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.VAR_POSITIONAL):
            return _applied(fn, args, kwargs), {}
        if kind is inspect.Parameter.VAR_KEYWORD:
            keywords.update(value)
        else:
            keywords[name] = value
    return fn, keywords


def _applied(fn, args: tuple, kwargs: dict):
    """A function calling ``fn(*args, **kwargs)`` (fn takes positional-only or ``*args`` parameters).

    It claims fn's module, so HorovodRunner ships that module by value where it ships fn's (a script
    beside the driver), and cloudpickle, finding no such name there, pickles it by value too.
    """
    def applied():
        return fn(*args, **kwargs)

    applied.__module__ = getattr(fn, "__module__", None) or __name__
    applied.__qualname__ = applied.__name__ = getattr(fn, "__name__", "fn")
    return applied


def _check_env(env) -> dict:
    if env is None:
        return {}
    if not hasattr(env, "items") or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        raise TypeError(f"env={env!r} must map environment variable names to string values, e.g. "
                        "env={'NCCL_DEBUG': 'INFO'}: they are added to every rank's environment.")
    return dict(env)


def _one_nic(nics) -> str | None:
    if not nics:
        return None
    names = sorted({nics} if isinstance(nics, str) else set(nics))
    if len(names) > 1:
        raise ValueError(f"nics={nics!r}: sparkhvd's ranks talk over one network interface; pass the one every host "
                         f"has and reaches the others on, e.g. nics=[{names[0]!r}].")
    return names[0]


def _start_timeout(start_timeout):
    return settings.HOROVOD_SPARK_START_TIMEOUT.get() if start_timeout is None else start_timeout


def _num_proc(num_proc) -> int:
    if num_proc is None:
        from pyspark import SparkContext

        sc = SparkContext._active_spark_context
        if sc is None:
            raise ValueError("horovod.spark.run(num_proc=None) runs spark.default.parallelism ranks of the active "
                             "SparkContext, and there is none; start a SparkSession first, or pass num_proc=N.")
        return int(sc.defaultParallelism)
    if isinstance(num_proc, bool) or not isinstance(num_proc, numbers.Integral) or num_proc < 1:
        raise ValueError(f"num_proc={num_proc!r} must be a whole number >= 1: how many Spark tasks (ranks) run fn; "
                         "sparkhvd.HorovodRunner(np=-N).run_all(fn) runs N processes on the driver instead.")
    return int(num_proc)
