"""A Spark standalone cluster on namespace hosts, with a driver process that runs jobs on it.

The master listens on the bridge (198.18.0.1, the root namespace) rather than inside a host:
then every host and the driver reach it the same way, and a fault on one host (its link down,
its processes killed) never takes the master with it, as on a real cluster whose master sits on
its own node. One Worker per host namespace (its own hostname through ``unshare --uts``), each
offering ``gpus`` fake GPUs through a discovery script. The driver: ``_client.Driver``.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from sparkhvd.runner._warm.protocol import WORKER_MODULE

from ._client import Driver, Outcome, PendingRun, _pyspark_home, _set_parent_death_signal, _tail
from ._netns import DRIVER_ADDRESS, Host, Network, TestbedError, TestbedLock, alive, netns_pids, sweep_stale

__all__ = ["Cluster", "Driver", "Outcome", "PendingRun"]

MASTER_PORT = 7077
# quick to start, light on 2 cores (tests/conftest.py's options)
_JVM_OPTS = "-XX:+UseSerialGC -XX:TieredStopAtLevel=1 -Xss1m -XX:+UnlockDiagnosticVMOptions -XX:-BytecodeVerificationRemote"
_DIR_PREFIX = "sparkhvd-cluster-"  # then the pid of the process that made it


def sweep_stale_dirs(parent: str) -> list[str]:
    """Remove the cluster folders in ``parent`` whose process has died (a session killed outright)."""
    removed = []
    for name in os.listdir(parent):
        pid = name[len(_DIR_PREFIX):].split("-", 1)[0]
        if name.startswith(_DIR_PREFIX) and pid.isdigit() and not alive(int(pid)):
            shutil.rmtree(os.path.join(parent, name), ignore_errors=True)
            removed.append(os.path.join(parent, name))
    return removed


class Cluster:
    """``n`` namespace hosts, a Spark standalone master on the bridge, one Worker per host."""

    def __init__(self, n: int = 2, *, cores: int = 2, memory: str = "1g", gpus: int = 2,
                 python: str | None = None, base_dir: str | None = None, master_opts: str = "",
                 host_env: dict | None = None):
        """``host_env``: ``{host index: {name: value}}``, extra environment of that host's Worker
        (its executors and ranks inherit it)."""
        self.network = Network(n)
        self.hosts: list[Host] = self.network.hosts
        self.cores, self.memory, self.gpus = cores, memory, gpus
        self.slots = n * min(cores, gpus)
        self.python = python or sys.executable
        self.base_dir = tempfile.mkdtemp(prefix=f"{_DIR_PREFIX}{os.getpid()}-", dir=base_dir)
        self.conf_dir = os.path.join(self.base_dir, "conf")
        self.master_url = f"spark://{DRIVER_ADDRESS}:{MASTER_PORT}"
        self.master_opts = master_opts
        self.host_env = {self.network.hosts[i].name: dict(env) for i, env in (host_env or {}).items()}
        self.master: subprocess.Popen | None = None
        self.workers: dict[str, subprocess.Popen] = {}
        self.driver: Driver | None = None
        self._lock = TestbedLock()
        self._logs: list = []
        self._closed = False
        self.start_seconds: float | None = None
        self.start_phases: dict = {}  # seconds from the start until the master, workers, executors were up

    # ---- start ---------------------------------------------------------------------------

    def start(self, *, timeout: float = 120, lock_timeout: float = 150, conf: dict | None = None,
              executor_env: dict | None = None) -> "Cluster":
        """Build the hosts, start master, workers and a driver; return when every executor registered."""
        self._lock.acquire(lock_timeout)
        started = time.monotonic()
        deadline = started + timeout
        sweep_stale()
        sweep_stale_dirs(os.path.dirname(self.base_dir))
        self.network.create()
        self._write_files()
        self.master = self._spawn("master", ["org.apache.spark.deploy.master.Master", "--host", DRIVER_ADDRESS,
                                             "--port", str(MASTER_PORT), "--webui-port", "0"],
                                  {"SPARK_LOCAL_IP": DRIVER_ADDRESS,
                                   "SPARK_MASTER_OPTS": self.master_opts})
        self._wait_for_line("master", "I have been elected leader", deadline)
        self.start_phases["master"] = time.monotonic() - started
        for host in self.hosts:
            self.workers[host.name] = self._spawn(
                f"worker-{host.name}",
                ["org.apache.spark.deploy.worker.Worker", "--host", host.address, "--cores", str(self.cores),
                 "--memory", self.memory, "--webui-port", "0", "--work-dir", self._dir(host.name, "work"),
                 self.master_url], self._worker_env(host), host=host)
        self.driver = Driver(self, conf or {}, executor_env or {}, os.path.join(self.base_dir, "driver.log"))
        for host in self.hosts:
            self._wait_for_line(f"worker-{host.name}", "Successfully registered with master", deadline)
        self.start_phases["workers"] = time.monotonic() - started
        self.driver.wait_ready(max(1.0, deadline - time.monotonic()))
        self.start_phases["executors"] = time.monotonic() - started
        self.start_seconds = time.monotonic() - started
        return self

    def restart_driver(self, *, conf: dict | None = None, executor_env: dict | None = None,
                       timeout: float = 90, slots: int | None = None) -> Driver:
        """Replace the driver (a new Spark application, new executors) with these settings; ``slots``: the task
        slots they give (default: the cluster's, one GPU per task)."""
        if self.driver is not None:
            self.driver.close()
        self.driver = Driver(self, conf or {}, executor_env or {}, os.path.join(self.base_dir, "driver.log"), slots)
        self.driver.wait_ready(timeout)
        return self.driver

    def _dir(self, *parts: str) -> str:
        path = os.path.join(self.base_dir, *parts)
        os.makedirs(path, exist_ok=True)
        return path

    def _write_files(self) -> None:
        os.makedirs(self.conf_dir, exist_ok=True)
        self.gpu_script = os.path.join(self.base_dir, "fake_gpus.sh")
        addresses = ", ".join(f'"{i}"' for i in range(self.gpus))
        with open(self.gpu_script, "w") as f:
            f.write(f"#!/bin/sh\necho '{{\"name\": \"gpu\", \"addresses\": [{addresses}]}}'\n")
        os.chmod(self.gpu_script, 0o755)
        with open(os.path.join(self.conf_dir, "log4j2.properties"), "w") as f:
            f.write("rootLogger.level = info\nrootLogger.appenderRef.stdout.ref = console\n"
                    "appender.console.type = Console\nappender.console.name = console\n"
                    "appender.console.target = SYSTEM_ERR\nappender.console.layout.type = PatternLayout\n"
                    "appender.console.layout.pattern = %d{HH:mm:ss.SSS} %p %c{1}: %m%n%ex\n"
                    "logger.jetty.name = org.sparkproject.jetty\nlogger.jetty.level = warn\n")

    def _worker_env(self, host: Host) -> dict:
        return {
            **self.host_env.get(host.name, {}),
            "TMPDIR": self._dir(host.name, "tmp"),
            "SPARK_LOCAL_IP": host.address,
            "SPARK_LOCAL_DIRS": self._dir(host.name, "local"),
            "SPARK_WORKER_DIR": self._dir(host.name, "work"),
            "SPARK_WORKER_OPTS": f"-Dspark.worker.resource.gpu.amount={self.gpus} "
                                 f"-Dspark.worker.resource.gpu.discoveryScript={self.gpu_script}",
        }

    def _spawn(self, name: str, args: list[str], extra_env: dict, host: Host | None = None) -> subprocess.Popen:
        home = _pyspark_home()
        env = dict(os.environ, SPARK_HOME=home, SPARK_CONF_DIR=self.conf_dir, SPARK_DAEMON_MEMORY="384m",
                   SPARK_DAEMON_JAVA_OPTS=_JVM_OPTS, SPARK_NO_DAEMONIZE="1", **extra_env)
        command = [os.path.join(home, "bin", "spark-class"), *args]
        if host is not None:
            command = host.exec_args(*command)
        log_path = os.path.join(self.base_dir, f"{name}.log")
        log = open(log_path, "ab")
        self._logs.append(log)
        return subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
                                cwd=self.base_dir, start_new_session=True, preexec_fn=_set_parent_death_signal)

    def log_path(self, name: str) -> str:
        return os.path.join(self.base_dir, f"{name}.log")

    def _wait_for_line(self, name: str, text: str, deadline: float) -> None:
        path = self.log_path(name)
        proc = self.master if name == "master" else self.workers[name.split("-", 1)[1]]
        while True:
            try:
                with open(path, errors="replace") as f:
                    if text in f.read():
                        return
            except OSError:
                pass
            if proc.poll() is not None:
                raise TestbedError(f"the Spark {name} exited with code {proc.returncode} before logging "
                                   f"{text!r}; {path} ends:\n{_tail(path)}")
            if time.monotonic() >= deadline:
                raise TestbedError(f"the Spark {name} did not log {text!r} in time (raise the cluster's start "
                                   f"timeout); {path} ends:\n{_tail(path)}")
            time.sleep(0.1)

    def set_hostname(self, host: Host, hostname: str) -> None:
        """Give ``host`` another hostname (its Worker and everything under it see it at once)."""
        self.network.set_hostname(host, hostname, self.workers[host.name].pid)

    def set_loopback_hostname(self, host: Host, on: bool = True) -> None:
        """Make ``host``'s hostname resolve to 127.0.1.1 on the host, as Debian's installer does (or undo it)."""
        self.network.set_loopback_hostname(host, on)

    def diagnostics(self) -> str:
        names = ["master"] + [f"worker-{h.name}" for h in self.hosts]
        return "\n".join(f"--- {n} ---\n{_tail(self.log_path(n), 15)}" for n in names)

    # ---- inspect -------------------------------------------------------------------------

    def host(self, key) -> Host:
        """A host by index, namespace name or hostname."""
        if isinstance(key, int):
            return self.hosts[key]
        for h in self.hosts:
            if key in (h.name, h.hostname, h.address):
                return h
        raise KeyError(key)

    def processes(self, host: Host, contains: str = "") -> list[tuple[int, str]]:
        """``(pid, command line)`` of the live processes on ``host`` whose command line has ``contains``."""
        found = []
        for pid in netns_pids(host.name):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
                with open(f"/proc/{pid}/stat") as f:
                    state = f.read().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if state != "Z" and contains in cmd:
                found.append((pid, cmd))
        return found

    def rank_pids(self, host: Host) -> list[int]:
        return [pid for pid, _ in self.processes(host, WORKER_MODULE)]

    def executor_pids(self, host: Host) -> list[int]:
        return [pid for pid, _ in self.processes(host, "CoarseGrainedExecutorBackend")]

    def leftover_ranks(self) -> dict:
        """Rank processes still running anywhere on the cluster (none should be, between runs)."""
        return {h.hostname: pids for h in self.hosts if (pids := self.rank_pids(h))}

    def wait_no_ranks(self, timeout: float = 15) -> dict:
        """Wait (bounded) until no rank process runs on any host; returns what is still left."""
        deadline = time.monotonic() + timeout
        while (left := self.leftover_ranks()) and time.monotonic() < deadline:
            time.sleep(0.1)
        return left

    # ---- stop ----------------------------------------------------------------------------

    def close(self) -> list[str]:
        """Stop everything and remove everything; returns what could not be cleaned up."""
        if self._closed:
            return []
        self._closed = True
        problems = []
        if self.driver is not None:
            try:
                self.driver.close()
            except Exception as exc:  # noqa: BLE001 - keep tearing down
                problems.append(f"driver: {exc}")
        for proc in [*self.workers.values(), self.master]:
            if proc is None:
                continue
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for proc in [*self.workers.values(), self.master]:
            if proc is not None:
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    problems.append(f"pid {proc.pid} did not exit")
        problems += self.network.delete()  # kills whatever still runs in the namespaces
        for log in self._logs:
            log.close()
        if os.environ.get("SPARKHVD_KEEP_CLUSTER_LOGS"):
            print(f"cluster logs kept in {self.base_dir}", file=sys.stderr)
        else:
            shutil.rmtree(self.base_dir, ignore_errors=True)
        self._lock.release()
        return problems
