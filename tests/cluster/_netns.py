"""Hosts made of network namespaces: a bridge in the root namespace, one veth pair per host.

Every name starts with ``shv<pid>`` (the pid of the process that built it), so a later session
can tell its own objects from the litter of a session that was killed, and remove that litter
(``sweep_stale``). Only one testbed exists at a time on a machine (``TestbedLock``): they all
use 198.18.0.0/24, and two bridges with the same subnet would steal each other's routes.
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass

SUBNET = "198.18.0"  # the benchmarking range (RFC 2544); nothing here leaves the machine
DRIVER_ADDRESS = f"{SUBNET}.1"
LOCK_PATH = "/tmp/sparkhvd-cluster-testbed.lock"
NETNS_ETC = "/etc/netns"
_NAME = re.compile(r"^shv(\d+)([a-z]|br|[a-z]0)$")


class TestbedError(RuntimeError):
    """The testbed could not be built or taken down."""


def sh(*args: str, timeout: float = 30, check: bool = True) -> subprocess.CompletedProcess:
    """Run a command; on failure raise with the command and its stderr."""
    try:
        done = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise TestbedError(f"`{' '.join(args)}` did not finish within {timeout} s") from None
    if check and done.returncode != 0:
        raise TestbedError(f"`{' '.join(args)}` failed with exit code {done.returncode}: "
                           f"{(done.stderr or done.stdout).strip()}")
    return done


def unavailable_reason() -> str | None:
    """Why namespaces (or Java) cannot be had here, or None when the testbed can be built."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "the cluster tests build network namespaces, which needs root"
    for tool, package in (("ip", "iproute2"), ("unshare", "util-linux"), ("nsenter", "util-linux"),
                          ("hostname", "hostname")):
        if shutil.which(tool) is None:
            return f"the cluster tests need `{tool}` on PATH (from {package})"
    from sparkhvd.runner._backends.java import JavaNotFoundError, check_java

    try:
        check_java()
    except JavaNotFoundError as exc:
        return str(exc)
    name = f"shv{os.getpid()}z"
    try:
        sh("ip", "netns", "add", name, timeout=10)
    except TestbedError as exc:
        return f"cannot create a network namespace: {exc}"
    try:
        sh("ip", "netns", "delete", name, timeout=10)
    except TestbedError:
        pass
    return None


class TestbedLock:
    """An exclusive lock on the one testbed this machine can hold; released when its process dies."""

    def __init__(self, path: str = LOCK_PATH):
        self.path = path
        self._fd: int | None = None

    def acquire(self, timeout: float) -> None:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
                    os.close(fd)
                    raise TestbedError(f"another session (pid {holder}) holds the cluster testbed "
                                       f"({self.path}) and did not release it within {timeout:.0f} s") from None
                time.sleep(0.5)
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.ftruncate(self._fd, 0)
            os.close(self._fd)  # closing drops the flock
            self._fd = None


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def netns_pids(name: str) -> list[int]:
    """Every process whose network namespace is ``name`` (what ``ip netns pids`` reports)."""
    done = sh("ip", "netns", "pids", name, check=False, timeout=10)
    return [int(p) for p in done.stdout.split() if p.strip().isdigit()]


def kill_netns_processes(name: str, timeout: float = 15) -> list[int]:
    """SIGKILL everything running in namespace ``name``; returns the pids that would not die."""
    deadline = time.monotonic() + timeout
    while True:
        pids = [p for p in netns_pids(name) if p != os.getpid()]
        if not pids or time.monotonic() >= deadline:
            return pids
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.1)


def sweep_stale() -> list[str]:
    """Remove namespaces, links and /etc/netns folders left by testbed sessions that have died."""
    removed = []
    for line in sh("ip", "netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        m = _NAME.match(name)
        if m and not alive(int(m.group(1))):
            kill_netns_processes(name)
            sh("ip", "netns", "delete", name, check=False)
            removed.append(f"netns {name}")
    for line in sh("ip", "-o", "link", "show", check=False).stdout.splitlines():
        parts = line.split(":")
        link = parts[1].strip().split("@")[0] if len(parts) > 1 else ""
        m = _NAME.match(link)
        if m and not alive(int(m.group(1))):
            sh("ip", "link", "delete", link, check=False)
            removed.append(f"link {link}")
    if os.path.isdir(NETNS_ETC):
        for name in os.listdir(NETNS_ETC):
            m = _NAME.match(name)
            if m and not alive(int(m.group(1))):
                shutil.rmtree(os.path.join(NETNS_ETC, name), ignore_errors=True)
                removed.append(f"{NETNS_ETC}/{name}")
    return removed


@dataclass
class Host:
    """One host: a network namespace with one interface (``eth0``) on the bridge."""

    name: str  # the namespace's name, also the host's hostname at first
    address: str
    veth: str  # the root-namespace end of its link, a port of the bridge
    hostname: str = ""

    def __post_init__(self):
        self.hostname = self.hostname or self.name

    @property
    def etc_dir(self) -> str:
        return os.path.join(NETNS_ETC, self.name)

    def exec_args(self, *args: str, uts: bool = True) -> list[str]:
        """A command line that runs ``args`` on this host (its namespace and, with ``uts``, its hostname)."""
        if not uts:
            return ["ip", "netns", "exec", self.name, *args]
        return ["ip", "netns", "exec", self.name, "unshare", "--uts", "sh", "-c",
                'hostname "$0" && exec "$@"', self.hostname, *args]

    def run(self, *args: str, timeout: float = 30, check: bool = True) -> subprocess.CompletedProcess:
        return sh("ip", "netns", "exec", self.name, *args, timeout=timeout, check=check)


class Network:
    """The bridge (the driver's side, ``198.18.0.1``) and ``n`` hosts (``198.18.0.2`` ...)."""

    def __init__(self, n: int, prefix: str | None = None):
        self.prefix = prefix or f"shv{os.getpid()}"
        self.bridge = f"{self.prefix}br"
        self.hosts = [Host(name=f"{self.prefix}{chr(ord('a') + i)}", address=f"{SUBNET}.{i + 2}",
                           veth=f"{self.prefix}{chr(ord('a') + i)}0") for i in range(n)]
        self._loopback: set[str] = set()

    def create(self) -> None:
        sh("ip", "link", "add", self.bridge, "type", "bridge")
        sh("ip", "addr", "add", f"{DRIVER_ADDRESS}/24", "dev", self.bridge)
        sh("ip", "link", "set", self.bridge, "up")
        for host in self.hosts:
            os.makedirs(host.etc_dir, exist_ok=True)
            self._write_hosts(host)
            sh("ip", "netns", "add", host.name)
            sh("ip", "link", "add", host.veth, "type", "veth", "peer", "name", "eth0", "netns", host.name)
            sh("ip", "link", "set", host.veth, "master", self.bridge)
            sh("ip", "link", "set", host.veth, "up")
            host.run("ip", "link", "set", "lo", "up")
            host.run("ip", "addr", "add", f"{host.address}/24", "dev", "eth0")
            host.run("ip", "link", "set", "eth0", "up")

    def hosts_text(self, host: Host) -> str:
        lines = ["127.0.0.1 localhost", "::1 localhost ip6-localhost ip6-loopback"]
        if host.name in self._loopback:
            lines.append(f"127.0.1.1 {host.hostname}")  # Debian's way: the hostname resolves to loopback
        for other in self.hosts:
            if other is host and host.name not in self._loopback:
                lines.append(f"{host.address} {host.hostname}")
            elif other is not host and other.hostname != host.hostname:
                lines.append(f"{other.address} {other.hostname}")
        lines.append(f"{DRIVER_ADDRESS} sparkhvd-driver")
        return "\n".join(lines) + "\n"

    def _write_hosts(self, host: Host) -> None:
        # Rewritten in place: `ip netns exec` bind-mounts this very file over /etc/hosts, so a
        # process already running on the host sees the change at its next lookup.
        path = os.path.join(host.etc_dir, "hosts")
        with open(path, "a+") as f:
            f.seek(0)
            f.truncate()
            f.write(self.hosts_text(host))

    def set_loopback_hostname(self, host: Host, on: bool) -> None:
        """Make ``host``'s hostname resolve to 127.0.1.1 on the host itself (or undo it)."""
        (self._loopback.add if on else self._loopback.discard)(host.name)
        self._write_hosts(host)

    def set_hostname(self, host: Host, hostname: str, pid: int) -> None:
        """Rename ``host`` (the UTS namespace of process ``pid`` on it) and rewrite every hosts file."""
        sh("nsenter", "--target", str(pid), "--uts", "hostname", hostname)
        host.hostname = hostname
        for h in self.hosts:
            self._write_hosts(h)

    def delete(self) -> list[str]:
        """Remove everything; returns what could not be removed (empty when all went)."""
        problems = []
        for host in self.hosts:
            left = kill_netns_processes(host.name)
            if left:
                problems.append(f"processes {left} in {host.name} would not die")
            sh("ip", "link", "delete", host.veth, check=False)
            sh("ip", "netns", "delete", host.name, check=False)
            shutil.rmtree(host.etc_dir, ignore_errors=True)
        sh("ip", "link", "delete", self.bridge, check=False)
        names = sh("ip", "netns", "list", check=False).stdout + sh("ip", "-o", "link", "show", check=False).stdout
        for leftover in [self.bridge] + [h.name for h in self.hosts] + [h.veth for h in self.hosts]:
            if re.search(rf"\b{leftover}\b", names):
                problems.append(f"{leftover} still exists")
        return problems
