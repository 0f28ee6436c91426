"""Every environment variable sparkhvd reads, sparkhvd's and Horovod's: its name, default, parser and meaning.

Code reads a setting through its entry here (``settings.WARM.get()``) and writes one for a child
process by its name (``env[settings.WARM.name] = ...``); nothing else names a variable.
docs/settings.md is made from this list (``python -m sparkhvd._common.settings``), and a test keeps
the two equal.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Callable, Generic, Mapping, TypeVar

T = TypeVar("T")

_ALL: list[Setting] = []
_SECTION = [""]  # the title of the settings defined now: section() sets it


def section(title: str) -> None:
    """Start a group of settings: docs/settings.md gives each group a heading ``title`` (which names the files that
    read them) and a table."""
    _SECTION[0] = title


@dataclass(frozen=True)
class Setting(Generic[T]):
    """One environment variable: ``get()`` is its parsed value, or ``default`` where it is unset or blank."""

    name: str
    default: T
    parse: Callable[[str], T]  # raises Invalid (below), or a ValueError whose sentence names the variable and fix
    doc: str  # one line, for docs/settings.md
    internal: bool = False  # set by sparkhvd for the processes it starts; users do not set it
    shown: str | None = None  # the default as docs/settings.md writes it, where ``default`` does not say it
    section: str = field(default_factory=lambda: _SECTION[0])  # section(): its heading in docs/settings.md

    def __post_init__(self) -> None:
        _ALL.append(self)

    def get(self, environ: Mapping[str, str] | None = None) -> T:
        return self.value_of(self.raw(environ))

    def raw(self, environ: Mapping[str, str] | None = None) -> str | None:
        """The variable's text as set, or None."""
        return (os.environ if environ is None else environ).get(self.name)

    def value_of(self, raw: str | None) -> T:
        """``raw`` (this variable's text from anywhere: an environment, a rank's heartbeat) parsed; ``default``
        where it is None or blank. A shared parser's ``Invalid`` becomes a ``SettingError`` naming the variable."""
        if raw is None or not raw.strip():
            return self.default
        try:
            return self.parse(raw)
        except Invalid as exc:
            raise SettingError(self, raw, exc) from None

    def is_set(self, environ: Mapping[str, str] | None = None) -> bool:
        """Whether the variable is set to something other than blanks."""
        raw = self.raw(environ)
        return raw is not None and bool(raw.strip())


class Invalid(ValueError):
    """A parser refusing a value: what is wrong with it (``problem``, e.g. "is not a whole number >= 0") and a
    sentence saying how to fix it (none where ``problem`` says it); the ``Setting`` adds its name and the value
    (``SettingError``)."""

    def __init__(self, problem: str, fix: str = "", shown: str | None = None):
        super().__init__(f"{problem}; {fix}" if fix else problem)
        self.problem, self.fix, self.shown = problem, fix, shown  # shown: the value as the message writes it


class SettingError(ValueError):
    """A variable set to a value its parser refuses: ``NAME='value' <problem>; <fix>``."""

    def __init__(self, setting: Setting, raw: str, invalid: Invalid):
        shown = repr(raw) if invalid.shown is None else invalid.shown
        super().__init__(f"{setting.name}={shown} {invalid}")
        self.setting, self.raw, self.problem, self.fix = setting, raw, invalid.problem, invalid.fix


# ---- the shared parsers: one per shape of value -------------------------------------------------
# Each takes the fix sentence (and what the value must be, where the default wording does not fit) and returns
# a parse function for ``Setting``; the Setting's error reads "NAME='value' is not <need>; <fix>". A parser of
# another shape raises Invalid itself.


def text(raw: str) -> str:
    return raw


def _under(value, below: str | None, need: str, fix: str) -> Invalid:
    """The refusal of a number under ``minimum``: ``below`` (a whole sentence, "must be 0 or more bytes.") after
    the number, where given; else the same as for a value that is not a number."""
    return Invalid(below, shown=f"{value:g}") if below else Invalid(f"is not {need}", fix)


def seconds(fix: str, *, positive: bool = False, minimum: float | None = 0.0, need: str | None = None,
            scale: float = 1.0, below: str | None = None, finite: bool = True) -> Callable[[str], float]:
    """A number of seconds: above 0 (``positive``), at least ``minimum`` (None: any), finite unless ``finite`` is
    False (then "inf" and "nan" pass, for a caller that checks the value itself). ``scale`` turns the value into
    seconds (0.001 for a setting given in milliseconds, as Horovod's HOROVOD_CYCLE_TIME)."""
    need = need or ("a positive number of seconds" if positive else "a number of seconds")

    def parse(raw: str) -> float:
        try:
            value = float(raw)
        except ValueError:
            raise Invalid(f"is not {need}", fix) from None
        if finite and not math.isfinite(value):
            raise Invalid(f"is not {need}", fix)
        if (positive and value <= 0) or (minimum is not None and value < minimum):
            raise _under(value, below, need, fix)
        return value * scale
    return parse


def whole(fix: str, *, minimum: int | None = 0, need: str = "a whole number >= 0",
          below: str | None = None) -> Callable[[str], int]:
    """A whole number (a count, bytes), at least ``minimum`` (None: any)."""
    def parse(raw: str) -> int:
        try:
            value = int(raw)
        except ValueError:
            raise Invalid(f"is not {need}", fix) from None
        if minimum is not None and value < minimum:
            raise _under(value, below, need, fix)
        return value
    return parse


def byte_count(fix: str, *, minimum: int | None = 0, need: str = "a number of bytes",
               below: str | None = None) -> Callable[[str], int]:
    """A whole number of bytes, at least ``minimum`` (None: any)."""
    return whole(fix, minimum=minimum, need=need, below=below)


def integer(fix: str, *, need: str = "a whole number") -> Callable[[str], int]:
    """Any whole number."""
    return whole(fix, minimum=None, need=need)


def positive(fix: str, *, need: str = "a whole number above 0") -> Callable[[str], int]:
    """A whole number above 0."""
    return whole(fix, minimum=1, need=need)


TRUE, FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def flag(fix: str, *, problem: str = "is not 1 or 0 (nor true/false, yes/no, on/off)") -> Callable[[str], bool]:
    """On or off, as Horovod's boolean variables: 1/true/yes/on or 0/false/no/off, any case."""
    def parse(raw: str) -> bool:
        word = raw.strip().lower()
        if word not in TRUE + FALSE:
            raise Invalid(problem, fix)
        return word in TRUE
    return parse


def _is_one(raw: str) -> bool:
    return raw == "1"


section("The warm process (runner/_warm/)")

WARM_FORKED = "forked"  # WARM's value in a rank forked by the zygote
WARM = Setting("SPARKHVD_WARM", "1", text,
               'Ranks fork from a warm process that has imported torch; "0" starts a fresh Python for each '
               f'rank. Set to "{WARM_FORKED}" by the warm process in the ranks it forks.')
WARM_IDLE_S = Setting("SPARKHVD_WARM_IDLE_S", 600.0,
                      seconds("set it to how long a warm process with no rank running stays, such as 600.",
                              minimum=None),
                      "Seconds a warm process with no rank running waits for the next run before it exits.")
WARM_DEBUG = Setting("SPARKHVD_WARM_DEBUG", False, _is_one,
                     '"1": say on stderr why a rank started as a fresh process instead of forking from the '
                     "warm process.")
# Read when OpenBLAS loads: the warm process preloads numpy with one thread, and a rank it forks gets the
# count its own environment asks for (OPENBLAS_NUM_THREADS, else GOTO_NUM_THREADS, else OMP_NUM_THREADS).
OPENBLAS_NUM_THREADS = Setting("OPENBLAS_NUM_THREADS", None, text,
                               "OpenBLAS's threads in a rank (numpy's); a rank forked by the warm process gets "
                               "them as a fresh one would.")
GOTO_NUM_THREADS = Setting("GOTO_NUM_THREADS", None, text,
                           "OpenBLAS's threads where OPENBLAS_NUM_THREADS is unset (OpenBLAS's own fallback).")


section("What the agent tells the rank process it starts (runner/_agent/env.py, runner/_rank/worker.py)")

DRIVER = Setting("SPARKHVD_DRIVER", None, text, "The driver service's host:port.", internal=True)
RUN_ID = Setting("SPARKHVD_RUN_ID", None, text, "The run this rank belongs to.", internal=True)
PLACEMENT = Setting("SPARKHVD_PLACEMENT", None, text, "The rank's place in the run (JSON).", internal=True)
TASK_CONTEXT = Setting("SPARKHVD_TASK_CONTEXT", None, text,
                       "The Spark task the rank runs for (JSON: _common/spark_task.py), which pyspark's TaskContext.get() "
                       "returns in the rank; unset: the rank runs on the driver (np<0).", internal=True)
PARENT_PID = Setting("SPARKHVD_PARENT_PID", None, text, "The agent's pid: the rank exits when it is gone.",
                     internal=True)
NETWORK_INTERFACE = Setting("SPARKHVD_NETWORK_INTERFACE", None, text,
                            "HorovodRunner(network_interface=): where the rank listens for its peers.",
                            internal=True)
RETURN = Setting("SPARKHVD_RETURN", "all", text,
                 '"all": every rank ships its return value to the driver; "0": only rank 0 does.', internal=True)
PYTHONUNBUFFERED = Setting("PYTHONUNBUFFERED", None, text,
                           'Set to "1" in each rank, so that its output reaches the driver line by line.',
                           internal=True)
OMP_NUM_THREADS = Setting("OMP_NUM_THREADS", None, text,
                          "CPU threads of each rank (OpenMP's, torch's); unset: the host's cores split evenly among "
                          "the run's ranks on it, as torchrun does.")
TF_CONFIG = Setting("TF_CONFIG", None, text,
                    "TensorFlow's cluster for MultiWorkerMirroredStrategy; set by the runner in every rank: every "
                    "rank's worker address and this rank's index (docs/frameworks.md).")
TORCH_FR_BUFFER_SIZE = Setting("TORCH_FR_BUFFER_SIZE", None, text,
                               "torch's flight recorder: how many collectives each rank's process groups keep; unset: "
                               "256, from which the stall report names the torch.distributed op ranks wait in "
                               "(0 turns it off).")
CUDA_VISIBLE_DEVICES = Setting("CUDA_VISIBLE_DEVICES", None, text,
                               "The executor's GPUs, which Spark's GPU addresses index; each rank gets the GPUs of "
                               "this run's ranks on its host.")
CUDA_DEVICE_ORDER = Setting("CUDA_DEVICE_ORDER", None, text,
                            'Set to "PCI_BUS_ID" in a rank given GPUs, so that their numbers are the host\'s.',
                            internal=True)
GLOO_SOCKET_IFNAME = Setting("GLOO_SOCKET_IFNAME", None, text,
                             "The interface gloo uses; unset: the one that holds the rank's address toward the "
                             "driver (or network_interface=).")
NCCL_SOCKET_IFNAME = Setting("NCCL_SOCKET_IFNAME", None, text,
                             "The interface NCCL uses; set to network_interface= where it is given.", internal=True)


section("Logs on the driver (runner/_service/logs.py)")

LOG_ROOT = Setting("SPARKHVD_LOG_ROOT", None, text,
                   "The folder under which each run without log_dir= gets its own log folder (made with mode 0700).",
                   shown="`<tempdir>/sparkhvd-logs-<user>`")
KEEP_LOGS = Setting("SPARKHVD_KEEP_LOGS", 5, whole(
    "set it to how many successful runs' log folders to keep (default 5; 0 keeps none), or pass log_dir= to keep "
    "a run's logs where you choose."), "How many successful runs' log folders are kept under the log root (0: none).")
KEEP_FAILED_LOGS = Setting("SPARKHVD_KEEP_FAILED_LOGS", 20, whole(
    "set it to how many failed runs' log folders to keep (default 20; 0 keeps none), or pass log_dir= to keep "
    "a run's logs where you choose."), "How many failed runs' log folders are kept under the log root (0: none).")


section("Commits (_common/commits.py on the rank, runner/_service/commit_store.py on the driver)")

COMMIT_DIR = Setting("SPARKHVD_COMMIT_DIR", None, text,
                     "HorovodRunner(commit_dir=): the folder (a path or a pyarrow filesystem URI) the rank writes its "
                     "commits to.", internal=True)
COMMIT_MEMORY_BYTES = Setting("SPARKHVD_COMMIT_MEMORY_BYTES", 256 << 20, byte_count(
    "set it to e.g. 268435456 (commits larger than it are kept in a file on the driver).", minimum=None),
    "Bytes of commits the driver keeps in memory; larger ones go to a file on the driver.")
STORAGE = Setting("SPARKHVD_STORAGE", None, text,
                  "Where a run given run_id= keeps its commits, to outlive its driver, when storage= is not given: a "
                  "path every host reaches or a pyarrow/fsspec URL (docs/elastic.md).")
LEASE_SECONDS = Setting("SPARKHVD_LEASE_SECONDS", 30.0, seconds(
    "set it to e.g. 30: how long a driver's claim on its run_id in the storage lasts unless renewed.", positive=True),
    "How long a driver's lease on its run_id in the storage lasts unless renewed (it renews it every third of it).")


section("Horovod's module names (runner/_rank/aliases.py)")


def _not_zero(raw: str) -> bool:
    return raw.strip() != "0"


HOROVOD_ALIASES = Setting("SPARKHVD_HOROVOD_ALIASES", True, _not_zero,
                          '"0": `import horovod.torch` and `from sparkdl import HorovodRunner` find only real '
                          "installs, not sparkhvd's stand-ins (on the driver and the ranks).", shown="`1`")


section("The script's folder, in `sparkhvd run` (runner/_payload/script_folder.py)")

SHIP_SCRIPT_FOLDER = Setting("SPARKHVD_SHIP_SCRIPT_FOLDER", True, flag(
    "set it to 0 to ship the script alone (not the modules beside it), or unset it."),
    '"0": `sparkhvd run` ships the script alone, not the modules and config files beside it.', shown="`1`")
SCRIPT_FOLDER_MAX_BYTES = Setting("SPARKHVD_SCRIPT_FOLDER_MAX_BYTES", 10_000_000, positive(
    "set it to e.g. 50000000, or unset it for the default 10000000.", need="a whole number of bytes above 0"),
    "The most bytes of the script's folder that ship with it; a larger folder is refused before the run starts.")
SCRIPT_FOLDER_MAX_FILES = Setting("SPARKHVD_SCRIPT_FOLDER_MAX_FILES", 1000, positive(
    "set it to e.g. 5000, or unset it for the default 1000.", need="a whole number of files above 0"),
    "The most files of the script's folder that ship with it; a folder with more is refused before the run starts.")
TMPDIR = Setting("TMPDIR", None, text,
                 "Where temporary files go (Python's tempfile), and where a rank unpacks the script's folder.",
                 shown="unset (`/tmp`)")


section("Stalls and lost ranks (runner/_policy/stall_report.py, runner/_rank/heartbeat.py)")
# Never fatal: each rank sends the values its environment sets to the driver, which warns of a bad one and
# uses the default (runner/_shared/stall_settings.py: lenient), so the fix sentences say so.

STALL_CHECK_TIME = Setting("HOROVOD_STALL_CHECK_TIME_SECONDS", 60.0, seconds(
    "using 60 s instead. Set it to a number such as 60.", positive=True),
    "Seconds without a completed collective, while a rank waits in one, before the driver prints the stall report.")
STALL_CHECK_DISABLE = Setting("HOROVOD_STALL_CHECK_DISABLE", False, flag(
    "the stall check stays on. Set it to 1 to turn it off.", problem="is neither 1 nor 0"),
    '"1": no stall report and no stall shutdown (lost ranks are still found).', shown="`0`")
STALL_SHUTDOWN_TIME = Setting("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", 0.0, seconds(
    "using 0 s instead. Set it to a number such as 60.", need="a number of seconds (0 turns it off)"),
    "Seconds of stall after which the run fails with the stall report as its headline (0: never).")
HEARTBEAT = Setting("SPARKHVD_HEARTBEAT_SECONDS", 5.0, seconds(
    "using 5 s instead. Set it to a number such as 5.", positive=True),
    "How often each rank tells the driver it is alive and which collectives it waits in (read by each rank).")
HEARTBEAT_TIMEOUT = Setting("SPARKHVD_HEARTBEAT_TIMEOUT_SECONDS", 60.0, seconds(
    "using 60 s instead. Set it to a number such as 60.", need="a number of seconds (0 turns it off)"),
    "Seconds without a heartbeat after which a rank's host is taken for lost and the run fails (0: never).")


METRICS = Setting("SPARKHVD_METRICS", True, flag(
    "set it to 1 (the default) or 0."),
    "`0`: ranks count no metrics and send none with their heartbeats (`RunResult.metrics` is empty, no straggler "
    "line); read by each rank.", shown="`1`")


def _live_view(raw: str) -> str:
    value = raw.strip().lower()
    if value not in ("auto", "off"):
        raise Invalid("is not auto or off", "use auto (the default: a live view in a notebook or a terminal) or off.")
    return value


LIVE_VIEW = Setting("SPARKHVD_LIVE_VIEW", "auto", _live_view,
                    "`auto`: while a run goes on, a notebook shows a table of its ranks updated in place, and a "
                    "terminal one status line (not under driver_log_verbosity=\"log_callback_only\", nor where output "
                    "is neither); `off`: neither. Read on the driver.")


MLFLOW_SYSTEM_METRICS = Setting("SPARKHVD_MLFLOW_SYSTEM_METRICS", False, flag(
    "set it to 1 or 0 (the driver sets it for its ranks)."),
    "Set by the driver for its ranks where its active MLflow run logs system metrics: each rank then sends MLflow's "
    "own system metrics of its host with its heartbeats (runner/_payload/mlflow.py logs them as "
    "`system/rank_<r>/...`); read by each rank.", shown="`0`")


section("The run's timeline (runner/_service/timeline.py on the driver, collective/_engine/timeline.py in ranks)")

TIMELINE_PATH = Setting("HOROVOD_TIMELINE", None, text,
                        "On the driver: every rank records Horovod's timeline from its start, and the driver writes "
                        "the run's merged trace (a process per rank, on one clock) to this path at the run's end; "
                        "a run without it whose ranks call hvd.start_timeline gets its merged trace in its log "
                        "folder.", shown="unset")
TIMELINE_MARK_CYCLES = Setting("HOROVOD_TIMELINE_MARK_CYCLES", False, flag(
    "set it to 1 or 0.", problem="is neither 1 nor 0"),
    "On the driver, with HOROVOD_TIMELINE: the ranks' traces mark each batch of answers the engine carries out.",
    shown="`0`")
TIMELINE = Setting("SPARKHVD_TIMELINE", "", text,
                   "Set by the driver for its ranks under HOROVOD_TIMELINE: `1`, or `cycles` to mark cycles too; "
                   "each rank then records its timeline from hvd.init() and sends it to the driver as it ends. "
                   "Read by each rank.", shown="unset")


section("Stragglers (runner/_policy/stragglers.py)")

STRAGGLER_FACTOR = Setting("SPARKHVD_STRAGGLER_FACTOR", 1.5, seconds(
    "set it to a factor such as 1.5, or 0 to turn the straggler line off.", need="a number >= 0"),
    "A rank whose own work per step (its time outside collectives) stays above this many times the other ranks' "
    "median for a window is named on the driver, once per episode (0: never).")
STRAGGLER_WINDOW = Setting("SPARKHVD_STRAGGLER_WINDOW_SECONDS", 30.0, seconds(
    "set it to a number of seconds such as 30.", positive=True),
    "The window over which a straggler's work per step is measured against the others'.")

section("Horovod's Spark API (runner/_dropins/horovod_spark.py)")

HOROVOD_SPARK_START_TIMEOUT = Setting("HOROVOD_SPARK_START_TIMEOUT", 600.0, seconds(
    "set it to e.g. 600, or pass start_timeout=.", minimum=None, finite=False),
    "horovod.spark.run(start_timeout=None): seconds for the ranks to start, as Horovod's.")


section("Spark and Java on the driver (runner/_cli.py, runner/_backends/java.py, runner/_backends/spark.py, runner/_backends/connect.py)")

# runner/_backends/java.py reads JAVA_HOME itself: `make check-java` runs that file alone, before sparkhvd is installed.
JAVA_HOME = Setting("JAVA_HOME", None, text,
                    "The Java that Spark runs (else `java` on PATH); sparkhvd checks it is 17 or newer before a "
                    "SparkSession starts.")
PYSPARK_PYTHON = Setting("PYSPARK_PYTHON", None, text,
                         "The Python the executors run; set to the driver's interpreter where unset, when sparkhvd "
                         "starts the SparkSession.")
PYSPARK_GATEWAY_PORT = Setting("PYSPARK_GATEWAY_PORT", None, text,
                               "Set by spark-submit: `sparkhvd run` then uses its SparkSession (its --master and "
                               "--conf).")
SPARK_REMOTE = Setting("SPARK_REMOTE", None, text,
                       "A Spark Connect server (`sc://host:port`; Databricks Connect sets it): runs go through a "
                       "Connect session there, never an embedded one.")
SPARK_CONNECT_MODE_ENABLED = Setting("SPARK_CONNECT_MODE_ENABLED", None, text,
                                     "Set by pyspark once the process has a Spark Connect session: runs use it.",
                                     internal=True)


def _service_place(raw: str) -> str:
    value = raw.strip().lower()
    if value not in ("auto", "client", "task"):
        raise Invalid("is not auto, client or task",
                      "use auto (the default), client (the ranks reach this process) or task (rank 0's task hosts "
                      "the run's service).")
    return value


CONNECT_SERVICE = Setting("SPARKHVD_CONNECT_SERVICE", "auto", _service_place,
                          "Under Spark Connect, where a run's driver service runs: `client` (this process, which the "
                          "executors must reach), `task` (rank 0's Spark task; the ranks' output comes when each "
                          "attempt ends), or `auto`: `client` where spark.driver.host is an address of this machine, "
                          "else `task`.")


section("MLflow (runner/_payload/mlflow.py)")
# Every MLFLOW_* variable of the driver goes to the ranks of a run started inside an active MLflow run, and:

MLFLOW_METRICS_SECONDS = Setting("SPARKHVD_MLFLOW_METRICS_SECONDS", 10.0, seconds(
    "set it to a number of seconds such as 10, or 0 to log none."),
    "Inside an active MLflow run on the driver: each rank's metrics go into that run (`steps_per_s/rank_3`, ...) at "
    "most this often per rank, and once more at the end (0: never).")

MLFLOW_TRACKING_URI = Setting("MLFLOW_TRACKING_URI", None, text,
                              "The driver's tracking URI (made absolute), for the ranks.", internal=True)
MLFLOW_RUN_ID = Setting("MLFLOW_RUN_ID", None, text, "The driver's active MLflow run, which the ranks log into.",
                        internal=True)
MLFLOW_EXPERIMENT_ID = Setting("MLFLOW_EXPERIMENT_ID", None, text, "That run's experiment.", internal=True)


section("The collective engine (collective/_engine/, collective/_core/_buffers.py)")

CYCLE_TIME = Setting("HOROVOD_CYCLE_TIME", 0.0, seconds(
    "set it to e.g. 1 (answer ready ops at most once a millisecond, fusing them), or 0 to answer each at once.",
    need="a number of milliseconds", scale=0.001, below="must be 0 or more milliseconds."),
    "Milliseconds (as Horovod's): a coordinator answers a process set at most once per cycle, so ops ready within "
    "one are answered, and fused, together (0: each op at once). Set, a set of two also leaves its blocking small "
    "reductions to the engine's turns (docs/engine.md).", shown="`0`")
FUSION_THRESHOLD = Setting("HOROVOD_FUSION_THRESHOLD", 64 << 20, byte_count(
    "set it to e.g. 67108864 (64 MB), or 0 to reduce each gradient on its own.", below="must be 0 or more bytes."),
    "Bytes of ready allreduces fused into one data op, and of DistributedOptimizer's buckets (0: each tensor on its "
    "own).")
CACHE_CAPACITY = Setting("HOROVOD_CACHE_CAPACITY", 1024, whole(
    "set it to e.g. 1024 (requests of a signature seen before travel as a number), or 0 to send every request "
    "whole.", need="a count of 0 or more"),
    "Request definitions each control link keeps, so a request seen before travels as its name and a number "
    "(0: every request whole).")
MAX_CONTROL_PAYLOAD = Setting("SPARKHVD_MAX_CONTROL_PAYLOAD", 64 << 20, byte_count(
    "set it to e.g. 67108864 (64 MB), the same on every rank, or unset it.", minimum=1,
    need="a number of bytes above 0"),
    "The most bytes of data one control frame may carry (a frame over it is refused before its body is read); "
    "every rank must use the same value.")


section("Launchers' variables: hvd.init() outside HorovodRunner (collective/_engine/communicator.py, mpi.py)")

_SET_BY_LAUNCHER = integer("the launcher (torchrun or mpirun) sets it to one; unset it to run hvd.init() without "
                           "one.")

MASTER_ADDR = Setting("MASTER_ADDR", None, text,
                      "torchrun's: the host of rank 0's rendezvous store; under mpirun without mpi4py, where the "
                      "ranks meet (with MASTER_PORT).")
MASTER_PORT = Setting("MASTER_PORT", None, _SET_BY_LAUNCHER,
                      "torchrun's: the port of rank 0's rendezvous store (0 under mpirun: rank 0 picks a free one, "
                      "with mpi4py).")
RANK = Setting("RANK", None, _SET_BY_LAUNCHER,
               "torchrun's: this process's rank (with WORLD_SIZE and MASTER_ADDR: a torchrun job).")
WORLD_SIZE = Setting("WORLD_SIZE", None, _SET_BY_LAUNCHER, "torchrun's: the number of processes in the job.")
LOCAL_RANK = Setting("LOCAL_RANK", 0, _SET_BY_LAUNCHER,
                     "torchrun's: this process's rank on its host (hvd.local_rank()).")
LOCAL_WORLD_SIZE = Setting("LOCAL_WORLD_SIZE", 1, _SET_BY_LAUNCHER,
                           "torchrun's: the processes on this host (hvd.local_size()).")
GROUP_RANK = Setting("GROUP_RANK", None, _SET_BY_LAUNCHER,
                     "torchrun's: this host's index (hvd.cross_rank()); else RANK // LOCAL_WORLD_SIZE.",
                     shown="`RANK // LOCAL_WORLD_SIZE`")
GROUP_WORLD_SIZE = Setting("GROUP_WORLD_SIZE", None, _SET_BY_LAUNCHER,
                           "torchrun's: the number of hosts (hvd.cross_size()); else WORLD_SIZE // LOCAL_WORLD_SIZE.",
                           shown="`WORLD_SIZE // LOCAL_WORLD_SIZE`")
OMPI_COMM_WORLD_RANK = Setting("OMPI_COMM_WORLD_RANK", None, _SET_BY_LAUNCHER,
                               "Open MPI's mpirun: this process's rank.")
OMPI_COMM_WORLD_SIZE = Setting("OMPI_COMM_WORLD_SIZE", None, _SET_BY_LAUNCHER,
                               "Open MPI's mpirun: the number of processes.")
OMPI_COMM_WORLD_LOCAL_SIZE = Setting("OMPI_COMM_WORLD_LOCAL_SIZE", None, _SET_BY_LAUNCHER,
                                     "Open MPI's mpirun: the processes on this host (without mpi4py).")
PMI_RANK = Setting("PMI_RANK", None, _SET_BY_LAUNCHER, "MPICH's or Intel MPI's mpirun (Hydra): this process's rank.")
PMI_SIZE = Setting("PMI_SIZE", None, _SET_BY_LAUNCHER,
                   "MPICH's or Intel MPI's mpirun (Hydra): the number of processes.")
MPI_LOCALNRANKS = Setting("MPI_LOCALNRANKS", None, _SET_BY_LAUNCHER,
                          "MPICH's or Intel MPI's mpirun (Hydra): the processes on this host (without mpi4py).")


section("HorovodRunner on the driver (runner/_runner_config.py)")


# Any number float() reads: HorovodRunner then refuses one that is not positive, naming start_timeout.
START_TIMEOUT = Setting("SPARKHVD_START_TIMEOUT", 120.0, seconds(
    "set it to e.g. 120, or pass start_timeout=.", minimum=None, finite=False),
    "HorovodRunner(start_timeout=None): seconds for every rank to register with the driver.")


# Horovod's own variables (horovod/common/common.h) that sparkhvd does not read: setting one changes nothing.
# Each with what to use instead, where there is something.
HOROVOD_NOT_READ = {
    "HOROVOD_GLOO_IFACE": "HorovodRunner(network_interface=), or GLOO_SOCKET_IFNAME",
    "HOROVOD_CPU_OPERATIONS": "CPU tensors always go over gloo (docs/mpirun.md)",
    "HOROVOD_CONTROLLER": "the negotiation runs over sparkhvd's own TCP links",
    "HOROVOD_ELASTIC": "HorovodRunner(max_restarts=) (docs/elastic.md)",
    "HOROVOD_AUTOTUNE": "", "HOROVOD_AUTOTUNE_LOG": "", "HOROVOD_AUTOTUNE_WARMUP_SAMPLES": "",
    "HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE": "", "HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES": "",
    "HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE": "",
    "HOROVOD_HIERARCHICAL_ALLREDUCE": "", "HOROVOD_HIERARCHICAL_ALLGATHER": "", "HOROVOD_TORUS_ALLREDUCE": "",
    "HOROVOD_NUM_NCCL_STREAMS": "", "HOROVOD_MPI_THREADS_DISABLE": "", "HOROVOD_CCL_CACHE": "",
    "HOROVOD_ADASUM_MPI_CHUNK_SIZE": "", "HOROVOD_THREAD_AFFINITY": "", "HOROVOD_DISABLE_GROUP_FUSION": "",
    "HOROVOD_DISABLE_NVTX_RANGES": "", "HOROVOD_ENABLE_ASYNC_COMPLETION": "", "HOROVOD_DYNAMIC_PROCESS_SETS": "",
    "HOROVOD_ENABLE_XLA_OPS": "",
}


def all_settings() -> list[Setting]:
    """Every setting, in the order this module defines them."""
    return list(_ALL)


def shown_default(s: Setting) -> str:
    """The default as docs/settings.md writes it."""
    if s.shown is not None:
        return s.shown
    if s.default is None:
        return "unset"
    if isinstance(s.default, bool):
        return "`1`" if s.default else "`0`"
    if isinstance(s.default, float):
        return f"`{s.default:g}`"
    return f"`{s.default}`"


_INTRO = """\
# Settings

Every environment variable sparkhvd reads: sparkhvd's own (`SPARKHVD_*`), Horovod's (`HOROVOD_*`) and the
others it reads or sets. This page is made from `_common/settings.py`, the one module that names them
(`python -m sparkhvd._common.settings > docs/settings.md`; `tests/common/test_settings.py` keeps the two equal).

An unset or blank variable takes its default. A value that cannot be used is an error whose sentence names
the variable, the value and the fix: read on the driver, it fails the run before the run starts; read on a
rank, it fails that rank. The stall and heartbeat settings warn instead, and use their defaults. A rank
reads its own environment: the driver's in an `np<0` run, the executor's in a Spark run (set a variable
there with `spark.executorEnv.NAME`); a run also gives every rank the driver's `SPARKHVD_HOROVOD_ALIASES`,
and the stall settings a rank's environment leaves unset are read on the driver.
"""


def markdown() -> str:
    """docs/settings.md."""
    lines = [_INTRO.rstrip("\n")]
    sections: dict[str, list[Setting]] = {}
    for s in _ALL:
        sections.setdefault(s.section, []).append(s)
    for title, members in sections.items():
        users = [s for s in members if not s.internal]
        if not users:
            continue
        lines += ["", f"## {title or 'Other settings'}", "", "| variable | default | meaning |", "|---|---|---|"]
        lines += [f"| `{s.name}` | {shown_default(s)} | {s.doc} |" for s in users]
    lines += ["", "## Horovod's variables that sparkhvd does not read", "",
              "Horovod reads these (`horovod/common/common.h`); in sparkhvd setting one changes nothing.", "",
              "| variable | instead |", "|---|---|"]
    lines += [f"| `{name}` | {instead or '-'} |" for name, instead in HOROVOD_NOT_READ.items()]
    internal = [s for s in _ALL if s.internal]
    if internal:
        lines += ["", "## Set by sparkhvd for the processes it starts", "",
                  "Not for users: sparkhvd sets these in the rank processes (or the ones it starts for them).", "",
                  "| variable | meaning |", "|---|---|"]
        lines += [f"| `{s.name}` | {s.doc} |" for s in internal]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(markdown(), end="")
