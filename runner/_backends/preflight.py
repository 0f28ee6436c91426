"""Pre-flight: before the barrier stage, ask the executors which Python they run and what it has.

A user who builds a SparkSession from a virtual environment without ``PYSPARK_PYTHON`` gets
executors that run another interpreter, one without sparkhvd; the barrier stage would then fail
with ``ModuleNotFoundError`` inside a Java stack trace. One small non-barrier job (a task per
slot, up to np) asks each executor's Python for its path, its version and the versions of the
packages the ranks need, and the driver turns any difference into one sentence with the fix.
The probe runs once per SparkContext and set of executors (``_checked``).
"""

from __future__ import annotations

import builtins
import re
import sys
import types
from dataclasses import dataclass, field

from .spark_info import executor_resources, spark_reason

#: What a rank imports on an executor; each must match the driver's version (cloudpickle, torch) or be ours.
PACKAGES = ("sparkhvd", "cloudpickle", "torch")

_checked: dict = {}  # applicationId -> the executor ids whose Python passed


@dataclass(frozen=True)
class Environment:
    """One Python's answer: host, interpreter, its version, and ``package -> version`` (None: not importable)."""

    host: str
    python: str
    version: str  # "3.11.7"
    packages: dict = field(default_factory=dict)
    errors: dict = field(default_factory=dict)  # package -> why it is not importable

    @property
    def minor(self) -> str:
        return ".".join(self.version.split(".")[:2])


def _probe(_partition):
    """Runs in the executor's Python. Sent by value (see ``_by_value``): unpickling it imports nothing of ours."""
    import socket
    import sys
    from importlib import metadata

    found, errors = {}, {}
    try:
        import sparkhvd

        found["sparkhvd"] = str(getattr(sparkhvd, "__version__", "unknown"))
    except Exception as exc:  # noqa: BLE001 - the answer, not a failure
        found["sparkhvd"], errors["sparkhvd"] = None, f"{type(exc).__name__}: {exc}"
    for name in ("cloudpickle", "torch"):
        try:
            found[name] = metadata.version(name)  # no import: torch takes seconds to import
        except Exception as exc:  # noqa: BLE001
            found[name], errors[name] = None, f"{type(exc).__name__}: {exc}"
    yield (socket.gethostname(), sys.executable, "%d.%d.%d" % tuple(sys.version_info[:3]), found, errors)


def _by_value(fn):
    """A copy of ``fn`` that cloudpickle sends by value: its module cannot look it up under its name, and its
    globals hold nothing but the builtins, so an executor without sparkhvd can unpickle it."""
    return types.FunctionType(fn.__code__, {"__builtins__": builtins}, fn.__name__, fn.__defaults__)


def driver_environment() -> Environment:
    """The driver's own answer, found the way the probe finds the executors'."""
    return Environment(*next(_probe(None)))


def probe(sc, tasks: int) -> list[Environment]:
    """Ask ``tasks`` tasks' Python (one per slot, so every executor answers where Spark spreads them) what it has."""
    previous = sc.getLocalProperty("spark.job.description")
    sc.setJobDescription("sparkhvd pre-flight: the executors' Python and packages")
    try:
        rows = sc.parallelize(range(tasks), tasks).mapPartitions(_by_value(_probe)).collect()
    finally:
        sc.setJobDescription(previous)
    return [Environment(*row) for row in rows]


def check_executors(sc, np: int, slots: int) -> None:
    """Raise RuntimeError, with one sentence naming the executor, both interpreters and the fix, where an
    executor's Python cannot run ranks: no sparkhvd, another Python minor version, or other cloudpickle, torch
    or sparkhvd versions than the driver's. Skipped where this SparkContext's executors already passed."""
    key, executors = sc.applicationId, _executor_ids(sc)
    if executors is not None and _checked.get(key) == executors:
        return
    try:
        found = probe(sc, max(1, min(np, slots)))
    except Exception as exc:  # Spark's word is turned into a sentence, or passed on as it is

        text = spark_reason(exc, max_lines=10_000)
        sentence = job_failure(text, _python_exec(sc))
        if sentence is None:
            raise RuntimeError(f"sparkhvd's pre-flight Spark job, which asks each executor's Python "
                               f"({_python_exec(sc)}) what it has installed, failed before any rank started: "
                               f"{spark_reason(exc)}; point PYSPARK_PYTHON at a working Python "
                               f"{sys.version_info[0]}.{sys.version_info[1]} with sparkhvd installed, such as the "
                               f"driver's {sys.executable}, or read the executor logs.") from exc
        raise RuntimeError(sentence) from None
    problem = compare(driver_environment(), found, _python_exec(sc))
    if problem is not None:
        raise RuntimeError(problem)
    if executors is not None:
        _checked[key] = executors


def _fix(driver: Environment) -> str:
    return (f"set PYSPARK_PYTHON={driver.python} (the driver's interpreter, where that path exists on every "
            f"executor host) in the environment before the SparkSession starts, or spark.pyspark.python="
            f"{driver.python} with spark-submit")


def compare(driver: Environment, executors: list[Environment], configured: str | None = None) -> str | None:
    """The first difference that breaks a run, as one sentence with both sides and the fix; None where there is
    none. ``configured``: the interpreter Spark was told to start (PYSPARK_PYTHON), for the message."""
    for where in executors:
        on = f"on executor host {where.host}"
        told = "" if not configured else " (PYSPARK_PYTHON)" if configured == where.python else \
            f" (PYSPARK_PYTHON={configured})"
        if where.packages.get("sparkhvd") is None:
            why = where.errors.get("sparkhvd", "not installed")
            return (f"the executors' Python {on}, {where.python}{told}, cannot import sparkhvd ({why}), but the driver "
                    f"runs {driver.python}; {_fix(driver)}, or install sparkhvd in that environment "
                    f"({where.python} -m pip install sparkhvd=={driver.packages.get('sparkhvd')}).")
        if where.minor != driver.minor:
            return (f"the executors {on} run Python {where.version} ({where.python}) but the driver runs Python "
                    f"{driver.version} ({driver.python}); cloudpickle cannot move functions between Python "
                    f"{where.minor} and {driver.minor}: {_fix(driver)}, or use Python {driver.minor} there.")
    for name in PACKAGES[1:] + PACKAGES[:1]:
        mine = driver.packages.get(name)
        if mine is None:  # not on the driver either: the ranks' own import says so
            continue
        for where in executors:
            theirs = where.packages.get(name)
            if theirs is not None and _public(theirs) == _public(mine):
                continue
            has = f"has {name} {theirs}" if theirs is not None else f"has no {name} ({where.errors.get(name)})"
            return (f"the executors' Python on executor host {where.host}, {where.python}, {has} but the driver's, "
                    f"{driver.python}, has {name} {mine}; ranks must load what the driver pickled with the same "
                    f"versions: run `{where.python} -m pip install {name}=={mine}` on that host, or {_fix(driver)}.")
    return None


def _public(version: str) -> str:
    """A version without its local label: torch 2.13.0+cpu on a CPU driver runs with 2.13.0+cu128 on GPU executors."""
    return version.split("+", 1)[0]


_MISSING_PYTHON = re.compile(r'Cannot run program "([^"]+)"[^:]*: error=\d+, ([^\n]+)')
_VERSION_MISMATCH = re.compile(r"Python in worker has different version:? (\d+\.\d+)[\d.]* than that in driver:? "
                               r"(\d+\.\d+)")
_WHERE = re.compile(r"\(TID \d+\) \(([^ )]+) executor ([^ )]+)\)")


def job_failure(text: str, configured: str | None) -> str | None:
    """Spark's account of a failed pre-flight job as one sentence with the fix; None where it is none of ours."""
    where = _WHERE.search(text)
    on = f" on host {where.group(1)} (executor {where.group(2)})" if where else ""
    driver = sys.executable
    if (missing := _MISSING_PYTHON.search(text)) is not None:
        return (f"Spark could not start the executors' Python{on}: {missing.group(1)} (PYSPARK_PYTHON) does not run "
                f"there ({missing.group(2).strip()}); set PYSPARK_PYTHON (spark.pyspark.python with spark-submit) to "
                f"an interpreter with sparkhvd installed on every executor host, such as the driver's {driver}, before "
                "the SparkSession starts.")
    if (mismatch := _VERSION_MISMATCH.search(text)) is not None:
        worker, mine = mismatch.groups()
        return (f"the executors' Python{on}, {configured or 'python3'} (PYSPARK_PYTHON), is Python {worker} but the "
                f"driver runs Python {mine} ({driver}); Spark and cloudpickle need the same Python minor version on "
                f"both: set PYSPARK_PYTHON to the driver's interpreter ({driver}) or another Python {mine} with "
                "sparkhvd installed, before the SparkSession starts.")
    return None


def _python_exec(sc) -> str | None:
    return getattr(sc, "pythonExec", None)


def _executor_ids(sc) -> frozenset | None:
    """The ids of the executors Spark has now; None where this Spark does not say (no caching then)."""

    try:
        return frozenset(executor_id for executor_id, _, _, _ in executor_resources(sc))
    except Exception:  # noqa: BLE001 - a Spark without this private API
        return None
