"""``HorovodRunner``: the user's entry point."""

from __future__ import annotations

import numbers
import os
import secrets
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field

from ._agent import TaskSpec
from ._launcher import LocalLauncher
from ._logs import VERBOSITIES, LogRouter
from ._protocol import new_secret
from ._run import supervise
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

    @property
    def value(self):
        """Rank 0's return value (what ``HorovodRunner.run`` returns)."""
        return self.values[0]


@dataclass
class RunnerConfig:
    """HorovodRunner's settings, validated on creation."""

    np: int
    driver_log_verbosity: str = "all"
    start_timeout: float | None = None
    log_dir: str | None = None
    network_interface: str | None = None
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
    """

    def __init__(self, np: int, *, driver_log_verbosity: str = "all", start_timeout: float | None = None,
                 log_dir: str | None = None, network_interface: str | None = None):
        self.config = RunnerConfig(np=np, driver_log_verbosity=driver_log_verbosity,
                                   start_timeout=start_timeout, log_dir=log_dir,
                                   network_interface=network_interface)
        self.last_result: RunResult | None = None

    @property
    def np(self) -> int:
        return self.config.np

    def run(self, main, **kwargs):
        """Run ``main(**kwargs)`` on every rank; return rank 0's value.

        Only rank 0's value travels to the driver: the other entries of
        ``self.last_result.values`` are None. ``run_all`` returns every rank's value.
        """
        return self._run(main, kwargs, every_value=False).value

    def run_all(self, main, **kwargs) -> RunResult:
        """Run ``main(**kwargs)`` on every rank; return a RunResult with every rank's value."""
        return self._run(main, kwargs, every_value=True)

    def _run(self, main, kwargs: dict, *, every_value: bool) -> RunResult:
        if not callable(main):
            raise TypeError(f"HorovodRunner.run needs a function to run, got {type(main).__name__}.")
        cfg = self.config
        np = abs(cfg.np)
        started = time.monotonic()
        payload = _pickle(main, kwargs)
        if cfg.np > 0:
            from ._spark import SparkLauncher, check_slots, spark_context

            sc = spark_context(np)
            check_slots(sc, np)
            launcher = SparkLauncher(sc, np)
            bind_host = _driver_bind_host(sc)
        else:
            launcher = LocalLauncher(np)
            bind_host = "127.0.0.1"
        run_id = secrets.token_hex(4)
        log_dir = cfg.log_dir or tempfile.mkdtemp(prefix=f"sparkhvd-{run_id}-")
        os.makedirs(log_dir, exist_ok=True)
        logs = LogRouter(log_dir, cfg.driver_log_verbosity)
        secret = new_secret()
        service = DriverService(np=np, secret=secret, payload=payload, bind_host=bind_host, on_log=logs,
                                run_id=run_id)
        if cfg.driver_log_verbosity == "all":
            print(f"[sparkhvd] run {run_id}: np={cfg.np} on {launcher.description}; function pickled to "
                  f"{_size(len(payload))}; logs in {log_dir}", flush=True)
        try:
            launcher.start(TaskSpec(address=service.address, secret=secret, run_id=run_id,
                                    stall_tasks=cfg._stall_tasks, network_interface=cfg.network_interface,
                                    every_value=every_value))
            supervise(service, launcher, logs, np=np, start_timeout=cfg.start_timeout, run_id=run_id)
            import cloudpickle

            values = [cloudpickle.loads(service.results[r]) if every_value or r == 0 else None  # authenticated
                      for r in range(np)]
            regs = [service.registrations[t] for t in range(np)]
            order = sorted(range(np), key=lambda t: service.placements[t].rank)
            self.last_result = RunResult(
                values=values, run_id=run_id, log_dir=log_dir, log_paths=logs.paths(),
                placements=[service.placements[t] for t in order], hosts=[regs[t].host for t in order],
                gpus=[regs[t].gpus for t in order], payload_bytes=len(payload),
                seconds=time.monotonic() - started)
            return self.last_result
        finally:
            service.close()
            logs.close()


def _pickle(main, kwargs) -> bytes:
    import cloudpickle

    module = sys.modules.get(getattr(main, "__module__", None) or "")
    by_value = module is not None and _is_user_module(module)
    if by_value:  # a script beside the driver: the executors may not be able to import it
        cloudpickle.register_pickle_by_value(module)
    try:
        payload = cloudpickle.dumps((main, kwargs))
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
    from . import _context
    from ._protocol import Kind

    ctx = _context.current()
    if ctx is None:
        print(message, file=sys.stdout, flush=True)
        return
    ctx.client.notify(Kind.LOG, {"rank": ctx.placement.rank, "stream": "driver", "lines": str(message).splitlines()})
