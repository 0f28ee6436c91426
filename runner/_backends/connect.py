"""Runs under a Spark Connect session: the user's process is a gRPC client, with no SparkContext and no JVM.

As pyspark's TorchDistributor does under Connect, the barrier stage goes through the DataFrame API:
``spark.range(0, np, 1, np).mapInArrow(task, schema, barrier=True).collect()``, tagged so that
``spark.interruptTag`` cancels it; the conf is read through ``spark.conf``. Ranks reach the driver
service in this process, which binds to ``spark.driver.host``: the client must run where the executors
can reach it (a notebook on the cluster's driver node, a local server). What reads Spark's JVM in a
classic session (the executors' status, lost-executor causes, executor replacement, the task slot count,
the executors' Python check) has no Connect path; README's support table says what differs.

pyspark's Connect modules are imported inside the functions that use them: ``import sparkhvd`` and
classic sessions never import them.
"""

from __future__ import annotations

import functools
import ipaddress
import re
import socket
import threading
import time

from ..._common import settings
from .._agent.agent import TaskSpec, run_task
from .._shared.signed import expected_size
from . import connect_hosted
from .api import Backend, Launcher
from .job import JobLauncher
from .spark import check_barrier_conf, gpu_task_profile, max_slots
from .spark_info import spark_reason


def remote_session():
    """The user's Spark Connect session; where ``SPARK_REMOTE`` is set and none exists yet, the session it names;
    None where this process has no Connect session (a classic one, or none)."""
    # pyspark sets SPARK_CONNECT_MODE_ENABLED once a remote session exists (pyspark.sql.utils.is_remote)
    if settings.SPARK_CONNECT_MODE_ENABLED.raw() is None and not settings.SPARK_REMOTE.get():
        return None
    try:
        from pyspark.sql.connect.session import SparkSession as RemoteSession
    except ImportError as exc:  # SPARK_REMOTE without pyspark[connect]'s dependencies
        raise RuntimeError(f"this process is set up for Spark Connect ({settings.SPARK_REMOTE.name}="
                           f"{settings.SPARK_REMOTE.get()!r}) but pyspark's Connect client cannot be imported "
                           f"({exc}); pip install 'pyspark[connect]', or unset {settings.SPARK_REMOTE.name} to use a "
                           "classic session.") from exc
    session = RemoteSession.getActiveSession() or getattr(RemoteSession, "_default_session", None)
    if session is None and settings.SPARK_REMOTE.get():
        from pyspark.sql import SparkSession

        session = SparkSession.builder.getOrCreate()  # a Connect session to SPARK_REMOTE
    return session


class Conf:
    """``spark.conf`` of a Connect session, read as the classic launcher reads a ``SparkConf``."""

    def __init__(self, spark):
        self._conf = spark.conf

    def get(self, key: str, default: str | None = None) -> str | None:
        value = self._conf.get(key, None)
        return default if value is None else value


def slots_bound(master: str, conf: Conf) -> int | None:
    """The most task slots the server's configuration allows, where it says: ``local[N]``, ``local``,
    ``local-cluster[...]`` and ``spark.cores.max``; None where only the cluster knows (no JVM here to ask)."""
    task_cpus = max(1, int(conf.get("spark.task.cpus", "1") or 1))
    if master == "local":
        return 1
    match = re.fullmatch(r"local\[\s*(\d+)\s*(?:,\s*\d+\s*)?\]", master)
    if match:
        return int(match.group(1)) // task_cpus
    return max_slots(master, conf)


def check(spark, np: int, service: str = "auto") -> str | None:
    """The pre-flight under Connect, failing in seconds with one sentence: dynamic allocation, the slots the
    configuration allows, and whether this process can serve the executors. Returns the address to bind; None where
    rank 0's task hosts the run's service instead (``service``: SPARKHVD_CONNECT_SERVICE's auto, client or task)."""
    _reachable(spark)
    conf = Conf(spark)
    try:
        master = conf.get("spark.master", "") or ""
    except Exception as exc:
        raise RuntimeError(f"the Spark Connect server ({_where(spark, master=False)}) did not answer: "
                           f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}; "
                           "check that it runs and that this address reaches it.") from exc
    check_barrier_conf(conf)
    bound = slots_bound(master, conf)
    if bound is not None and bound < np:
        raise RuntimeError(f"np={np} needs {np} task slots but the Spark Connect server's cluster has at most "
                           f"{bound} ({master}, spark.task.cpus={conf.get('spark.task.cpus', '1')}); use "
                           f"np<={max(bound, 1)}, add executors or cores, or use np=-{np} to run on the driver.")
    if service == "task":
        return None
    try:
        return bind_host(master, conf.get("spark.driver.host"))
    except NotOnDriver:
        if service == "client":
            raise
        return None


def reachable(spark, timeout: float = 10.0) -> bool:
    """Whether the session's server takes a TCP connection (pyspark's client retries an unreachable one for minutes)."""
    try:
        _reachable(spark, timeout)
    except RuntimeError:
        return False
    return True


def _reachable(spark, timeout: float = 10.0) -> None:
    """A TCP connection to the server, or a RuntimeError naming it: pyspark's client retries an unreachable server
    for minutes before its first call fails."""
    builder = getattr(getattr(spark, "client", None), "_builder", None)
    host, port = getattr(builder, "host", None), getattr(getattr(builder, "url", None), "port", None)
    if not host or not port:
        return  # a custom channel builder: its first call says what is wrong
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as exc:
        raise RuntimeError(f"the Spark Connect server (sc://{host}:{port}) did not answer: {exc.strerror or exc}; "
                           "check that it runs and that this address reaches it (SPARK_REMOTE, or the session's "
                           "remote URL).") from exc


class NotOnDriver(RuntimeError):
    """This process is not on the Spark driver's node: the executors cannot reach a service here."""


def bind_host(master: str, driver_host: str | None) -> str:
    """Where this process's driver service listens: loopback for local masters, else ``spark.driver.host``,
    which must be an address of this machine (the executors reach the driver there, and so this process)."""
    if master.startswith("local"):
        return "127.0.0.1"
    if not driver_host:
        raise NotOnDriver("under Spark Connect the ranks reach this process at the Spark driver's address, but the "
                          "server's spark.driver.host is not set; run the notebook on the cluster's driver node, unset "
                          f"{settings.CONNECT_SERVICE.name} (now client) so that rank 0's task hosts the run's service, or "
                          "use np<0 to run on this machine.")
    problem = _not_local(driver_host)
    if problem is not None:
        raise NotOnDriver(
            f"under Spark Connect the ranks reach this process at the Spark driver's address, "
            f"spark.driver.host={driver_host}, but {problem}: this client does not run on the cluster's driver node "
            "(Databricks Connect from a laptop, say), and the executors cannot reach it. Run the notebook or "
            f"script on the cluster (a notebook attached to it, or a job), unset {settings.CONNECT_SERVICE.name} "
            "(now client) so that rank 0's task hosts the run's service, or use np<0 to run on this machine.")
    return driver_host


def _not_local(host: str) -> str | None:
    """Why this process cannot listen on ``host``, or None."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError as exc:
        return f"that name does not resolve here ({exc.strerror or exc})"
    for *_, sockaddr in infos:
        address = sockaddr[0]
        if ipaddress.ip_address(address).is_loopback:
            return None
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            try:
                probe.bind((address, 0))
                return None
            except OSError:
                continue
    return f"{host} is not an address of this machine"


class ConnectLauncher(JobLauncher):
    """Runs the task agents as one barrier stage of the Connect session's DataFrame API, tagged for cancelling."""

    def __init__(self, spark, np: int):
        super().__init__()
        self.spark = spark
        self.np = np
        self.description = f"a Spark barrier stage through Spark Connect ({_where(spark)})"
        self._tag: str | None = None

    def start(self, spec: TaskSpec) -> None:
        self._tag = f"sparkhvd-{spec.run_id}-{spec.attempt}"
        self._submit(spec, "sparkhvd-connect-job")

    def _job(self, spec: TaskSpec) -> None:
        spark = self.spark
        try:
            spark.addTag(self._tag)  # this thread's operations carry it: interruptTag cancels the stage
            df = spark.range(0, self.np, 1, self.np)
            profile = _gpu_profile(spark) if spec.use_gpu else None
            task, schema = self._task(spec)
            stage = (df.mapInArrow(task, schema, barrier=True) if profile is None
                     else df.mapInArrow(task, schema, barrier=True, profile=profile))
            self._consume(stage)
        except Exception as exc:  # noqa: BLE001 - reported through failure()
            if not self._stopped:
                self._error = f"the Spark job failed: {spark_reason(exc)}"
        finally:
            try:
                spark.removeTag(self._tag)
            except Exception:  # noqa: BLE001 - the session is closing: nothing to untag
                pass

    def _task(self, spec: TaskSpec) -> tuple:
        """The function each task of the stage runs, and the schema of its rows."""
        return functools.partial(_arrow_task, spec), "task binary"

    def _consume(self, stage) -> None:
        """Run the stage to its end."""
        stage.collect()  # the outcome arrives through the driver service

    def stop(self) -> None:
        self._stopped = True
        if self._tag is not None:
            try:
                self.spark.interruptTag(self._tag)
            except Exception:  # noqa: BLE001 - the session was stopped: no stage left to cancel
                pass


class HostedLauncher(ConnectLauncher):
    """Runs a ``HostedAttempt`` (runner/_policy/hosted.py) as one barrier stage through the Connect session, and
    collects partition 0's rows."""

    def __init__(self, spark, np: int):
        super().__init__(spark, np)
        self.description += ", rank 0's task hosting the run's service"
        self._blob = bytearray()
        self._size: int | None = None
        self._complete = threading.Event()
        self.arrived_at: float | None = None  # time.monotonic() when partition 0's last row came

    def _task(self, spec) -> tuple:
        """``spec``: a HostedAttempt, whose ``host`` runs in partition 0's task."""
        return functools.partial(connect_hosted.hosting_task, spec), connect_hosted.SCHEMA

    def _consume(self, stage) -> None:
        for row in stage.toLocalIterator():
            if not self._complete.is_set():
                self._blob += row[0]
                self._size = self._size or expected_size(bytes(self._blob[:64]))
                if len(self._blob) >= self._size:
                    self.arrived_at = time.monotonic()  # what task 0's clock is shifted to (its "now" in the blob)
                    self._complete.set()

    def rows(self, wait: float) -> bytes | None:
        """Partition 0's rows, once all have come (waiting up to ``wait`` seconds for them); None before."""
        if not self._complete.wait(wait):
            return None
        return bytes(self._blob)


def _where(spark, *, master: bool = True) -> str:
    """The server's address and master, for messages: ``sc://127.0.0.1:15002, local[2]``."""
    url = getattr(getattr(getattr(spark, "client", None), "_builder", None), "url", None)
    netloc = getattr(url, "netloc", None)
    try:
        master = Conf(spark).get("spark.master") if master else None
    except Exception:  # noqa: BLE001 - the server is going away: the address alone
        master = None
    return ", ".join(part for part in (f"sc://{netloc}" if netloc else "the server", master) if part)


def _gpu_profile(spark):
    """One GPU per task where the executors have GPUs (spark.executor.resource.gpu.amount), as the classic launcher
    asks; None otherwise."""
    conf = Conf(spark)
    if float(conf.get("spark.executor.resource.gpu.amount", "0") or 0) <= 0:
        return None
    return gpu_task_profile(int(conf.get("spark.task.cpus", "1") or 1))


def _arrow_task(spec: TaskSpec, batches):
    """Runs inside the barrier task on an executor: one rank's agent; yields one row saying how it ended."""
    import json

    import pyarrow as pa
    from pyspark import BarrierTaskContext

    for _ in batches:  # the task's one input row
        pass
    ctx = BarrierTaskContext.get()
    gpu = ctx.resources().get("gpu")
    row = run_task(spec, ctx.partitionId(), gpus=list(gpu.addresses) if gpu is not None else [],
                   spark_task=(ctx.stageId(), ctx.taskAttemptId()))
    yield pa.RecordBatch.from_pydict({"task": [json.dumps(row, default=str).encode()]})


class ConnectBackend(Backend):
    """A barrier stage per attempt through the user's Spark Connect session ``spark``: no SparkContext and no JVM
    here, so no task slot count (the run never grows), no executor replacement, and a restart asks for ``want``."""

    name = "connect"

    def __init__(self, spark):
        self.spark = spark

    def prepare(self, np: int, *, run_id: str, verbose: bool, gpus: bool) -> str:
        service = settings.CONNECT_SERVICE.get()
        address = check(self.spark, np, service)  # what the server's conf says, and where executors reach us
        self.hosts_service = address is None
        if self.hosts_service and verbose:
            driver_host = Conf(self.spark).get("spark.driver.host")
            why = (f"{settings.CONNECT_SERVICE.name}=task" if service == "task" else
                   f"this client is not on the Spark driver's node (spark.driver.host={driver_host}), so the "
                   "executors cannot reach it")
            print(f"[sparkhvd] run {run_id}: {why}: rank 0's Spark task hosts the run's service, and the ranks' "
                  "output comes when each attempt ends.", flush=True)
        return address or ""

    def launcher(self, n: int, *, gpus: bool) -> Launcher:
        if self.hosts_service:
            return HostedLauncher(self.spark, n)
        return ConnectLauncher(self.spark, n)

    def free_slots(self) -> int:
        return 0  # no slot count under Connect: the run does not grow

    def slots_for_restart(self, want: int, least: int | None, timeout: float) -> int:
        return want  # the barrier stage itself waits for its slots

    def replace_hosts(self, hosts: frozenset) -> None:
        pass  # no executor API under Connect: Spark notices a lost host itself


def backend_for(config) -> ConnectBackend | None:
    """For ``np > 0`` where the user has an active Spark Connect session: never an embedded session then."""
    remote = remote_session()
    if remote is not None and config.dataframe is not None:
        raise RuntimeError("TorchDistributor._train_on_dataframe runs its barrier stage over the DataFrame through "
                           "the SparkContext, which a Spark Connect session does not have; call it on a classic "
                           "SparkSession (on the cluster's driver), or read the data in the function with "
                           "sparkhvd.data.make_torch_loader.")
    return None if remote is None else ConnectBackend(remote)
