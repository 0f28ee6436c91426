"""The error a failed attempt raises: one HorovodRunError whose headline is the root cause.

The cause comes first (a rank's own exception, a rank process that died, a lost executor, a
failed launch, ranks that went silent), and what it did to the other ranks (collateral errors,
runner/_shared/collateral.py) after it, grouped as Ray Train's poll.py groups them.
"""

from __future__ import annotations

import cloudpickle

from .._service.service import Failure
from .._shared import collateral as _collateral
from .._shared.errors import HorovodRunError


def is_collateral(failure: Failure) -> bool:
    """Whether a rank's reported error is what another rank's failure caused (runner/_shared/collateral.py, the rule
    its worker applied too)."""
    return _collateral.is_collateral(failure.type, failure.message)


def explained(failures: list[Failure], dead: dict, launch_failure, lost) -> bool:
    """Whether what is known names a root cause, not only the survivors' collateral errors."""
    return bool(dead or launch_failure or lost or any(not is_collateral(f) for f in failures))


def failure_error(service, logs, failures: list[Failure], dead: dict, launch_failure, lost, run_id, launcher,
                  retry_on: tuple = ()):
    """One HorovodRunError whose headline is the root cause; collateral errors come after it.

    ``service``: anything with ``status()`` (the driver service), read once, now; ``logs``: the run's LogRouter;
    ``retry_on``: ``module.qualname`` of the exception classes the run retries (``HorovodRunner(retry_on=)``): where
    every rank's own exception is one of them, the error's ``retry_on`` names the class, and the run may retry it.
    """
    status = service.status()
    failures = sorted(failures, key=lambda f: f.arrived)
    causes = [f for f in failures if not is_collateral(f)]
    collateral = [f for f in failures if is_collateral(f)]
    lines = _root_causes(status, logs, causes, dead, lost, launch_failure, launcher)
    # Only gloo's mesh that did not connect while the ranks built their process group: no rank died, no executor was
    # lost; what a relaunch outlives (RunPolicy's own budget for it, apart from max_restarts). The ranks that said
    # nothing were waiting in that mesh, not lost.
    mesh_setup = (not lines and bool(collateral) and not launcher.fatal and not status.vanished()
                  and all(_collateral.in_mesh_setup(f.type, f.message) for f in collateral))
    silent = [] if lines or mesh_setup else sorted(set(status.silent_ranks(also_done={f.rank for f in failures} | set(dead)))
                                     | set(status.vanished()))
    if silent:
        where = _where(status)(silent[0]) if len(silent) == 1 else ""
        lines.append(f"rank{'s' if len(silent) > 1 else ''} {_ranks(silent)}{where} stopped without a word: no error, "
                     "no exit code and no result reached the driver, so their process, executor or host was lost "
                     "(look in the Spark executor logs of that host)")
    if collateral:
        lead = "then, as a consequence, " if lines else ""
        lines.append(lead + _grouped(collateral, one_line=True))
    lines[0] = f"HorovodRunner run {run_id} failed: {lines[0]}"
    first = (causes or collateral or [None])[0]
    if first is not None:
        lines.append(f"\nTraceback of rank {first.rank} (the first to fail{'' if causes else ', after the cause'}):"
                     f"\n{first.traceback.rstrip()}")
    lines.append(f"\nEach rank's full output is in {logs.log_dir}/rank-<rank>.log.")
    headline = lines[0].split(" failed: ", 1)[1].split("; its last output lines", 1)[0].split("\n", 1)[0]
    # Infrastructure, which a restart can outlive: a process killed, an executor, host or peer lost. Not a user's
    # exception, nor a SparkContext that is gone.
    retryable = not causes and not launcher.fatal
    error = HorovodRunError("\n".join(lines), failures=[(f.rank, f.type, f.message, f.traceback)
                                                        for f in causes + collateral],
                            log_dir=logs.log_dir, run_id=run_id, retryable=retryable, cause=headline)
    if silent:
        error.silent_ranks = silent
    error.mesh_setup = mesh_setup
    error.retry_on = retried(causes, retry_on) if not launcher.fatal else None
    cause = _rebuilt(first.pickled) if first is not None and first.pickled else None
    if cause is not None:
        error.__cause__ = cause
    return error


def retried(causes: list[Failure], retry_on: tuple) -> str | None:
    """The ``retry_on`` class (``module.qualname``) the first root cause is an instance of, where every root cause is
    an instance of one of them; None otherwise (no cause, or one the run does not retry)."""
    if not causes or not retry_on:
        return None
    matches = [next((name for name in f.classes if name in retry_on), None) for f in causes]
    return matches[0] if all(matches) else None


def _root_causes(status, logs, causes: list[Failure], dead: dict, lost, launch_failure, launcher) -> list[str]:
    """One line for each root cause known: the ranks' own errors, the processes that died, Spark's lost executors,
    the failed launch."""
    where = _where(status)
    lines = [_grouped(causes)] if causes else []
    for rank, code in sorted(dead.items()):
        how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
        text = f"rank {rank}'s process{where(rank)} {how} before returning a result"
        tail = logs.tail(rank)
        text += "; its last output lines:\n    " + "\n    ".join(tail[-10:]) if tail else "; it printed nothing"
        lines.append(text)
    if lost:
        lines.append(lost)
    if launch_failure:
        lines.append(f"{launcher.description}: {launch_failure}")
    return lines


def _rebuilt(pickled: bytes):
    """The first failing rank's exception, unpickled (an authenticated frame), or None where its class does not
    exist on the driver."""
    try:
        return cloudpickle.loads(pickled)
    except Exception:  # noqa: BLE001 - the class may not exist on the driver
        return None


def _grouped(failures: list[Failure], one_line: bool = False) -> str:
    """``ranks 0,3: KeyError: 'label'; rank 1: ...``; ``one_line``: each error as its first line (collateral errors,
    whose whole text, a TensorFlow wrapper's many lines say, is in ``HorovodRunError.failures`` and the logs)."""
    groups: dict[str, list[int]] = {}
    for f in failures:
        text = _collateral.headline(f.type, f.message) if one_line else f"{f.type}: {f.message}"
        groups.setdefault(text, []).append(f.rank)
    return "; ".join(f"rank{'s' if len(r) > 1 else ''} {_ranks(sorted(r))}: {text}" for text, r in groups.items())


def _where(status):
    """``rank -> " on host H (address)"`` when the run spans several hosts, else ``""``."""
    by_rank = status.by_rank()
    if len({reg.host_id for reg in by_rank.values()}) < 2:
        return lambda rank: ""
    return lambda rank: f" on host {by_rank[rank].host} ({by_rank[rank].peer})" if rank in by_rank else ""


def _ranks(ranks) -> str:
    return ",".join(str(r) for r in ranks)
