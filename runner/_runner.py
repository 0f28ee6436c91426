"""``HorovodRunner``: the user's entry point."""

from __future__ import annotations

import functools
import itertools
import numbers
import os
import secrets
import sys
import time
import warnings
from dataclasses import dataclass, field

from .._common.protocol import new_secret
from . import _payload
from ._agent import TaskSpec
from ._commits import CommitStore
from ._errors import HorovodRunError, StartTimeoutError
from ._launcher import LocalLauncher
from ._logs import VERBOSITIES, LogRouter, end_run_logs, run_log_dir
from ._mlflow import shared_run
from ._run import supervise
from ._script import as_payload
from ._service import DriverService

LARGE_PAYLOAD_BYTES = 10 * 1024 * 1024
ENV_START_TIMEOUT = "SPARKHVD_START_TIMEOUT"


@dataclass
class RunResult:
    """Everything one run produced.

    ``values[r]`` is rank ``r``'s return value; ``log_paths[r]`` the file holding rank ``r``'s
    stdout and stderr; ``placements[r]`` its rank, local_rank, cross_rank and sizes; ``hosts[r]``
    and ``gpus[r]`` where it ran.
    """

    values: list
    run_id: str
    log_dir: str
    log_paths: dict
    placements: list
    hosts: list
    gpus: list
    payload_bytes: int
    seconds: float
    restarts: list = field(default_factory=list)  # a RestartEvent per restart (HorovodRunner(max_restarts=))

    @property
    def value(self):
        """Rank 0's return value (what ``HorovodRunner.run`` returns)."""
        return self.values[0]


@dataclass
class RestartEvent:
    """One restart after an infrastructure failure (``RunResult.restarts``, printed on the driver).

    ``lost``: the failure's cause; ``attempt`` of ``attempts``: this restart's attempt (2 is the
    first restart) and the most there can be; ``commit``: the plain fields (epoch, batch) of the
    commit the ranks resumed from, None where they started from the beginning; ``seconds``: from the
    driver seeing the failure to rank 0 loading that commit (to the new ranks' start where the
    function does not use ``hvd.elastic.run``).
    """

    attempt: int
    attempts: int
    lost: str | None  # None: not a failure, the run grew (every rank left at a commit, Spark had slots for more)
    np_before: int
    np_after: int
    failed_at: float = field(repr=False, default=0.0)
    commit: dict | None = None
    seconds: float | None = None
    counted: bool = True  # False: not one of max_restarts (a grown stage that could not start, run again smaller)

    def line(self, run_id: str) -> str:
        if self.commit is None:
            resumed = "from the beginning (no state.commit() had reached the driver)"
        else:
            fields = " ".join(f"{k}={v}" for k, v in self.commit.items()) or "with no plain fields"
            resumed = f"from the last commit ({fields})"
        ranks = f" with np={self.np_after} (was {self.np_before})" if self.np_after != self.np_before else ""
        since = "the failure" if self.lost is not None else "every rank left"
        when = f" {self.seconds:.1f} s after {since}" if self.seconds is not None else ""
        return f"[sparkhvd] run {run_id}: {self.what()}; training resumed{when}{ranks}, {resumed}."

    def what(self) -> str:
        if self.lost is None:
            if self.np_after == self.np_before:
                return (f"relaunching with np={self.np_after} at a commit: the task slots Spark had free for more "
                        "ranks were taken meanwhile")
            return (f"growing from np={self.np_before} to np={self.np_after} at a commit, as Spark has task slots for "
                    "more ranks")
        if not self.counted:
            return f"going back from np={self.np_before} to np={self.np_after} after {self.lost}"
        return f"restart {self.attempt - 1} of {self.attempts - 1} after {self.lost}"


@dataclass
class RunnerConfig:
    """HorovodRunner's settings, validated on creation."""

    np: int
    driver_log_verbosity: str = "all"
    start_timeout: float | None = None
    log_dir: str | None = None
    network_interface: str | None = None
    max_restarts: int = 0
    min_np: int | None = None
    max_np: int | None = None
    commit_dir: str | None = None
    _stall_tasks: frozenset = field(default=frozenset(), repr=False)  # fault tests only

    def __post_init__(self):
        if isinstance(self.np, bool) or not isinstance(self.np, numbers.Integral):
            raise ValueError(f"np must be a non-zero integer, got {self.np!r} ({type(self.np).__name__}); "
                             "use np=2 for 2 Spark tasks or np=-1 for one process on the driver.")
        self.np = int(self.np)
        if self.np == 0:
            raise ValueError("np=0 runs nothing; use np>0 for that many Spark tasks (one per GPU), "
                             "or np<0 for -np processes on the driver (np=-1 to debug).")
        if self.driver_log_verbosity not in VERBOSITIES:
            raise ValueError(f"driver_log_verbosity={self.driver_log_verbosity!r} is not one of "
                             f"{', '.join(map(repr, VERBOSITIES))}.")
        if self.start_timeout is None:
            raw = os.environ.get(ENV_START_TIMEOUT, "120")
            try:
                self.start_timeout = float(raw)
            except ValueError:
                raise ValueError(f"{ENV_START_TIMEOUT}={raw!r} is not a number of seconds; "
                                 "set it to e.g. 120, or pass start_timeout=.") from None
        if not self.start_timeout > 0:
            raise ValueError(f"start_timeout={self.start_timeout!r} must be a positive number of seconds.")
        if self.network_interface is not None and (
                not isinstance(self.network_interface, str) or not self.network_interface.strip()
                or any(c in self.network_interface for c in ", \t")):
            raise ValueError(f"network_interface={self.network_interface!r} must be the name of one network "
                             "interface, such as 'eth0', present on every host that runs a rank; leave it unset to "
                             "use the interface that routes to the driver.")
        if isinstance(self.max_restarts, bool) or not isinstance(self.max_restarts, numbers.Integral) \
                or self.max_restarts < 0:
            raise ValueError(f"max_restarts={self.max_restarts!r} must be a whole number >= 0: how many times an "
                             "infrastructure failure (a lost rank, executor or host) restarts the run from its last "
                             "commit.")
        if self.min_np is not None and (isinstance(self.min_np, bool) or not isinstance(self.min_np, numbers.Integral)
                                        or not 1 <= self.min_np <= abs(self.np)):
            raise ValueError(f"min_np={self.min_np!r} must be a whole number from 1 to {abs(self.np)} (np={self.np}): "
                             "the fewest ranks a restart may go on with when Spark cannot give all np slots back.")
        if self.max_np is not None:
            if self.np < 0:
                raise ValueError(f"max_np={self.max_np!r} grows a Spark run when its cluster has free task slots; np="
                                 f"{self.np} runs a fixed {-self.np} process{'es' if self.np < -1 else ''} on the driver: "
                                 "leave max_np unset, or use np>0.")
            if isinstance(self.max_np, bool) or not isinstance(self.max_np, numbers.Integral) \
                    or self.max_np < self.np:
                raise ValueError(f"max_np={self.max_np!r} must be a whole number >= np={self.np}: the most ranks the "
                                 "run grows to at a commit when Spark has free task slots.")
        if self.commit_dir is not None:
            from ._commits import check_commit_dir

            check_commit_dir(self.commit_dir)


class HorovodRunner:
    """Runs a training function on ``np`` ranks, Horovod style.

    ``np > 0``: one Spark barrier-mode task per rank on the active SparkSession (where none
    is active, an embedded ``local[np]`` session); each task asks for one GPU where the cluster
    defines a ``gpu`` resource, and is pinned to it through ``CUDA_VISIBLE_DEVICES``.
    ``np < 0``: ``-np`` processes on the driver (``np=-1``: one, for debugging).

    Every rank's stdout and stderr are printed on the driver as ``[rank] line`` while it runs
    (``driver_log_verbosity="log_callback_only"``: only what ranks send with
    ``sparkhvd.log_to_driver``) and kept in ``<log_dir>/rank-<rank>.log``. A rank that raises
    fails the run with ``HorovodRunError`` naming the rank, its exception and traceback;
    the other ranks are stopped. Ranks that do not register within ``start_timeout`` seconds
    (default 120, or ``$SPARKHVD_START_TIMEOUT``) fail the run too. ``network_interface``
    (Horovod's ``--network-interface``) names the interface ranks talk to each other on; by
    default, the one that routes to the driver.

    ``max_restarts``: how many times an infrastructure failure (a rank process killed, an executor
    or host lost, a peer gone silent, a stall) relaunches every rank, which then resume from the
    last ``state.commit()`` of ``hvd.elastic.run`` (docs/elastic.md); a user's exception is never
    retried. Commits go to the driver, or to ``commit_dir`` (a path or pyarrow filesystem URL every
    host reaches) for large models. ``min_np``: where Spark cannot give all ``np`` slots back within
    ``start_timeout``, a restart goes on with as many as there are, down to ``min_np``. ``max_np``:
    while Spark has free task slots, the run grows, up to ``max_np`` ranks (and a run a restart
    shrank, back to ``np``), at a commit: every rank leaves there and all are relaunched.
    """

    def __init__(self, np: int, *, driver_log_verbosity: str = "all", start_timeout: float | None = None,
                 log_dir: str | None = None, network_interface: str | None = None, max_restarts: int = 0,
                 min_np: int | None = None, max_np: int | None = None, commit_dir: str | None = None):
        self.config = RunnerConfig(np=np, driver_log_verbosity=driver_log_verbosity,
                                   start_timeout=start_timeout, log_dir=log_dir,
                                   network_interface=network_interface, max_restarts=max_restarts,
                                   min_np=min_np, max_np=max_np, commit_dir=commit_dir)
        self.last_result: RunResult | None = None

    @property
    def np(self) -> int:
        return self.config.np

    def run(self, main, *args, **kwargs):
        """Run ``main(**kwargs)`` on every rank; return rank 0's value.

        Only rank 0's value travels to the driver: the other entries of
        ``self.last_result.values`` are None. ``run_all`` returns every rank's value.

        ``main`` may also be the path of a Python script followed by its command-line arguments:
        ``run("train.py", "--epochs", "3")`` runs it on every rank as ``python train.py --epochs 3``
        would (as ``__main__``, its folder first on ``sys.path``; the source is read on the driver and
        shipped) and returns None. ``sys.exit(0)`` is success; another exit status fails the run.
        Where the driver has an active MLflow run, the ranks log into it (docs/cli.md).
        """
        with shared_run() as env:
            return self._run(main, kwargs, every_value=False, args=args, env=env).value

    def run_all(self, main, *args, **kwargs) -> RunResult:
        """Run ``main(**kwargs)``, or a script as ``run`` does, on every rank; return a RunResult with every
        rank's value (None for each rank of a script)."""
        with shared_run() as env:
            return self._run(main, kwargs, every_value=True, args=args, env=env)

    def _run(self, main, kwargs: dict, *, every_value: bool, args: tuple = (), env: dict | None = None) -> RunResult:
        main, kwargs = as_payload(main, args, kwargs)  # a script path becomes _script.run_script and its source
        if not callable(main):
            raise TypeError(f"HorovodRunner.run needs a function to run, got {type(main).__name__}; pass a function, "
                            "or the path of a Python script (run('train.py', '--epochs', '3')).")
        cfg = self.config
        np = abs(cfg.np)
        started = time.monotonic()
        payload = _pickle(main, kwargs)
        sc = None
        if cfg.np > 0:
            from ._spark import preflight, spark_context

            sc = spark_context(np)
            preflight(sc, np, verbose=cfg.driver_log_verbosity == "all")  # slots, GPUs, the executors' Python
            bind_host = _driver_bind_host(sc)
        else:
            bind_host = "127.0.0.1"
        run_id = secrets.token_hex(4)
        log_dir = run_log_dir(run_id, cfg.log_dir)  # cfg.log_dir, or a new folder under the log root (_logs.py)
        logs = LogRouter(log_dir, cfg.driver_log_verbosity)
        commits = CommitStore(commit_dir=cfg.commit_dir, run_id=run_id)
        secret = new_secret()
        attempts = cfg.max_restarts + 1
        errors: list[HorovodRunError] = []
        restarts: list[RestartEvent] = []
        n = np
        target = cfg.max_np or np  # what a run shrunk by a restart, or started below max_np, grows back to
        grew_from = None  # the np before this launch grew the run
        try:
            for launch in itertools.count():
                launcher = _launcher(sc, n)
                if not launch and cfg.driver_log_verbosity == "all":
                    print(f"[sparkhvd] run {run_id}: np={cfg.np} on {launcher.description}; function pickled to "
                          f"{_size(len(payload))}; logs in {log_dir}", flush=True)
                event = restarts[-1] if restarts else None
                service = DriverService(np=n, secret=secret, payload=payload, bind_host=bind_host, on_log=logs,
                                        run_id=run_id, commits=commits, attempt=launch,
                                        on_restore=None if event is None else functools.partial(
                                            _resumed, event, run_id))
                cut_off = ()
                try:
                    launcher.start(TaskSpec(address=service.address, secret=secret, run_id=run_id,
                                            stall_tasks=cfg._stall_tasks, network_interface=cfg.network_interface,
                                            every_value=every_value, attempt=launch, commit_dir=cfg.commit_dir,
                                            env=tuple({**_forwarded_settings(), **(env or {})}.items())))
                    grown = supervise(service, launcher, logs, np=n, start_timeout=cfg.start_timeout, run_id=run_id,
                                      can_grow=None if sc is None or n >= target else functools.partial(
                                          _has_free_slots, sc))
                    _resumed(event, run_id, None, at=service.placed_at)  # where no rank asked for a commit
                    if not grown:
                        self.last_result = _result(service, logs, n, run_id, payload, started, every_value,
                                                   restarts)
                        return self.last_result
                    lost, failed_at, counted = None, time.monotonic(), True
                except HorovodRunError as error:
                    if isinstance(error, StartTimeoutError) and grew_from is not None:
                        # The slots Spark had free went to another job before the larger stage started: go on with
                        # the ranks the run had, from the commit they left at, and grow no more.
                        lost, failed_at, counted = (f"the np={n} stage did not start within start_timeout: Spark's free "
                                                    "task slots were taken", time.monotonic(), False)
                        target = n_before = grew_from
                    else:
                        if isinstance(error, StartTimeoutError) and launch:
                            error.retryable, error.cause = True, "the relaunched ranks did not start in time"
                        errors.append(error)
                        if not error.retryable or len(errors) == attempts:
                            raise _final(errors, attempts) from error.__cause__
                        lost, failed_at, counted = error.cause, getattr(error, "failed_at", time.monotonic()), True
                        cut_off = _hosts_of(service, getattr(error, "silent_ranks", ()))
                finally:
                    service.close()
                if sc is not None and cut_off:
                    _replace_executors(sc, cut_off, run_id)
                grew_from = None
                try:
                    if lost is None:  # every rank left at a commit: Spark had free slots for more
                        grew_from, n = n, min(target, max(n, _free_slots(sc)))
                    elif not counted:
                        n = n_before
                    else:
                        n = np if sc is None else _slots_for_restart(sc, np, cfg.min_np, cfg.start_timeout,
                                                                         verbose=cfg.driver_log_verbosity == "all")
                except RuntimeError as exc:
                    errors.append(HorovodRunError(f"HorovodRunner run {run_id} failed: {exc}.", log_dir=log_dir,
                                                  run_id=run_id))
                    raise _final(errors, attempts) from None
                event = RestartEvent(attempt=len(errors) + 1, attempts=attempts, lost=lost, np_before=service.np,
                                     np_after=n, failed_at=failed_at, counted=counted)
                restarts.append(event)
                logs.note(f"----- sparkhvd: {event.what()} -----")
        finally:
            commits.close()
            logs.close()
            end_run_logs(log_dir, given=cfg.log_dir is not None,  # last_result is set only when this run succeeded
                         succeeded=self.last_result is not None and self.last_result.run_id == run_id)


def _has_free_slots(sc) -> bool:
    return _free_slots(sc) > 0


def _free_slots(sc) -> int:
    """Task slots no running task of this application holds (Spark's slot count includes busy ones)."""
    tracker = sc.statusTracker()
    running = 0
    for stage in tracker.getActiveStageIds():
        info = tracker.getStageInfo(stage)
        running += info.numActiveTasks if info is not None else 0
    return _task_slots(sc) - running


def _task_slots(sc) -> int:
    from ._spark import task_slots

    return task_slots(sc)


def _launcher(sc, n: int):
    if sc is None:
        return LocalLauncher(n)
    from ._spark import SparkLauncher

    return SparkLauncher(sc, n)


def _hosts_of(service: DriverService, ranks) -> set:
    """The addresses and hostnames the ranks ran on."""
    ranks = set(ranks)
    if not ranks or service.placements is None:
        return set()
    regs = [service.registrations[t] for t, p in enumerate(service.placements) if p.rank in ranks]
    return {reg.peer for reg in regs} | {reg.host for reg in regs}


def _replace_executors(sc, hosts: set, run_id: str) -> None:
    from ._spark import replace_executors

    try:
        ids = replace_executors(sc, hosts)
    except Exception as exc:  # noqa: BLE001 - a Spark without this API: Spark notices the lost host itself, later
        warnings.warn(f"sparkhvd run {run_id}: could not ask Spark to replace the executors on {sorted(hosts)}, whose "
                      f"ranks went silent ({type(exc).__name__}: {exc}); the restart waits until Spark gives up on "
                      "them (spark.network.timeout).", RuntimeWarning, stacklevel=3)
        return
    if ids:
        print(f"[sparkhvd] run {run_id}: asked Spark to replace executor{'s' if len(ids) > 1 else ''} "
              f"{', '.join(ids)} on {', '.join(sorted(hosts))}, whose ranks went silent.", flush=True)


def _slots_for_restart(sc, np: int, min_np: int | None, timeout: float, *, verbose: bool) -> int:
    from ._spark import slots_for_restart

    return slots_for_restart(sc, np, min_np, timeout, verbose=verbose)


def _resumed(event: RestartEvent | None, run_id: str, commit: dict | None, *, at: float | None = None) -> None:
    """The restart's ranks resumed (rank 0 asked for its commit, or ``at``: they started): say so, once."""
    if event is None or event.seconds is not None:
        return
    event.seconds = (time.monotonic() if at is None else at) - event.failed_at
    event.commit = None if commit is None else dict(commit.get("fields") or {})
    print(event.line(run_id), flush=True)


def _result(service: DriverService, logs: LogRouter, np: int, run_id: str, payload: bytes, started: float,
            every_value: bool, restarts: list) -> RunResult:
    import cloudpickle

    values = [cloudpickle.loads(service.results[r]) if every_value or r == 0 else None  # authenticated
              for r in range(np)]
    regs = [service.registrations[t] for t in range(np)]
    order = sorted(range(np), key=lambda t: service.placements[t].rank)
    return RunResult(values=values, run_id=run_id, log_dir=logs.log_dir, log_paths=logs.paths(),
                     placements=[service.placements[t] for t in order], hosts=[regs[t].host for t in order],
                     gpus=[regs[t].gpus for t in order], payload_bytes=len(payload),
                     seconds=time.monotonic() - started, restarts=list(restarts))


def _final(errors: list[HorovodRunError], attempts: int) -> HorovodRunError:
    """The error that ends a run: the last attempt's, naming every earlier failure in order where it restarted."""
    last = errors[-1]
    if len(errors) == 1:
        return last
    ran_out = last.retryable and len(errors) == attempts
    why = (f"every one of its {attempts} attempts (max_restarts={attempts - 1}) ended in a failure" if ran_out
           else f"after {len(errors) - 1} restart{'s' if len(errors) > 2 else ''}, a failure that no restart can fix")
    head, _, rest = str(last).partition("\n")
    lines = [f"HorovodRunner run {last.run_id} failed: {why}; in order:"]
    lines += [f"  {i}. {e.cause}" for i, e in enumerate(errors, 1)]
    lines.append(f"\nThe last failure in full: {head.split(' failed: ', 1)[-1]}" + (f"\n{rest}" if rest else ""))
    error = type(last)("\n".join(lines), failures=last.failures, log_dir=last.log_dir, run_id=last.run_id,
                       retryable=last.retryable, cause=last.cause)
    error.attempts = list(errors)
    return error


def _pickle(main, kwargs) -> bytes:
    import cloudpickle

    module = sys.modules.get(getattr(main, "__module__", None) or "")
    by_value = module is not None and _is_user_module(module)
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
        warnings.warn(f"the training function and its arguments pickle to {_size(len(payload))}, which every "
                      f"rank downloads; the largest captured objects: {_captured_sizes(main, kwargs)}. "
                      "Load large data inside the function (from files or a data set) instead.",
                      UserWarning, stacklevel=4)
    return payload


def _is_user_module(module) -> bool:
    """A module of the user's own (not installed, not the standard library, not ours)."""
    import sysconfig

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
    import inspect

    import cloudpickle

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
        except Exception:  # noqa: BLE001
            continue
    sizes.sort(reverse=True)
    return ", ".join(f"{name} ({_size(n)})" for n, name in sizes[:3]) or "none found by name"


def _forwarded_settings() -> dict:
    """The driver's settings that the ranks must share wherever they run (executors do not inherit the driver's
    environment): ``SPARKHVD_HOROVOD_ALIASES`` (runner/_aliases.py)."""
    from ._aliases import ENV_ALIASES

    return {ENV_ALIASES: os.environ[ENV_ALIASES]} if ENV_ALIASES in os.environ else {}


def _size(n: int) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n} B"


def _driver_bind_host(sc) -> str:
    """Loopback for local masters; otherwise the address executors use to reach the driver."""
    if sc.master.startswith("local"):
        return "127.0.0.1"
    import socket

    return sc.getConf().get("spark.driver.host") or socket.gethostbyname(socket.gethostname())


def log_to_driver(message) -> None:
    """From inside a training function: print ``message`` on the driver as ``[rank] message``.

    Shown even with ``driver_log_verbosity="log_callback_only"``. Outside a run it prints
    locally.
    """
    from .._common import context as _context
    from .._common.protocol import Kind

    ctx = _context.current()
    if ctx is None:
        print(message, file=sys.stdout, flush=True)
        return
    ctx.client.notify(Kind.LOG, {"rank": ctx.placement.rank, "stream": "driver", "lines": str(message).splitlines()})
