"""What a task agent calls to get a rank process forked from this executor's warm process.

``spawn`` asks the warm process of this key (``runner/_warm/key.py``) for a rank and returns a
``ForkedProcess``, which has the part of ``subprocess.Popen``'s surface the agent uses; where none answers,
it starts one (``start_server``) for the next run and raises, and the agent starts a fresh process
instead. ``SPARKHVD_WARM=0`` turns the warm path off. ``stop`` and ``marked`` are how a test session or
a benchmark ends the warm processes it started (they run detached).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time

from ..._common import settings
from .key import zygote_key
from .protocol import SERVER_MODULE, WORKER_ARGV, address, peer_uid

REPLY_TIMEOUT_S = 10.0  # an agent waits this long for the zygote's {"pid": n}, then uses a fresh process
RESTART_AFTER_S = 30.0  # a zygote that is still importing refuses connections meanwhile: start it once


class WarmUnavailable(Exception):
    """The warm path cannot start this rank; the agent starts a fresh process instead."""


def enabled(python: str | None) -> bool:
    """Whether a rank with interpreter ``python`` (None: this one) may be forked from a zygote."""
    return (sys.platform.startswith("linux") and settings.WARM.get() != "0"
            and (python is None or python == sys.executable))


def connect(key: str, timeout: float = REPLY_TIMEOUT_S) -> socket.socket:
    """A connection to this key's zygote, checked to belong to this user; OSError if none answers."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        sock.settimeout(timeout)
        sock.connect(address(key))
        uid = peer_uid(sock)
        if uid != os.getuid():
            raise WarmUnavailable(f"the zygote socket {address(key)[1:]!r} belongs to uid {uid}, not this user's "
                                  f"uid {os.getuid()}; ranks start as fresh processes (set {settings.WARM.name}=0 to skip it).")
    except BaseException:
        sock.close()
        raise
    return sock


def request(sock: socket.socket, message: dict, fds: list = ()) -> dict:
    """Send one request and return the zygote's first reply."""
    data = json.dumps(message).encode()
    if fds:
        socket.send_fds(sock, [data], list(fds))
    else:
        sock.sendall(data)
    reply = sock.recv(64 * 1024)
    if not reply:
        raise WarmUnavailable("the zygote closed the connection without answering; ranks start as fresh processes.")
    return json.loads(reply)


_starts: dict = {}  # key -> when this process last started a zygote for it


def start_server(key: str, env: dict | None = None, preload: tuple = ()) -> None:
    """Start a zygote for ``key`` in the background (detached; it outlives this process), at most once per
    ``RESTART_AFTER_S`` per key from one process; ``preload``: what it imports besides torch."""
    now = time.monotonic()
    if now - _starts.get(key, -1e9) < RESTART_AFTER_S:
        return
    _starts[key] = now
    out = None if settings.WARM_DEBUG.get() else subprocess.DEVNULL
    proc = subprocess.Popen([sys.executable, "-m", SERVER_MODULE, key, *preload], stdin=subprocess.DEVNULL,
                            stdout=out, stderr=out, close_fds=True, start_new_session=True,
                            env=dict(os.environ if env is None else env))
    # The zygote forks itself away at once (init adopts it); reap the short-lived first process.
    threading.Thread(target=proc.wait, daemon=True, name="sparkhvd-zygote-reaper").start()


class ForkedProcess:
    """A rank process forked by the zygote, with the part of ``subprocess.Popen``'s surface that the
    agent and the launchers use: ``pid``, ``stdin``, ``stdout``, ``stderr``, ``wait()``, ``poll()``,
    ``returncode``. The exit code comes from the zygote; if the zygote dies first, the rank died with
    it (its parent-death signal), and ``wait()`` returns -9."""

    def __init__(self, sock: socket.socket, pid: int, stdin, stdout, stderr):
        self._sock = sock
        self._lock = threading.Lock()
        self.pid = pid
        self.stdin, self.stdout, self.stderr = stdin, stdout, stderr
        self.returncode: int | None = None
        self.args = [f"<forked by {SERVER_MODULE}>"]

    def _read(self, block: bool) -> None:
        try:
            data = self._sock.recv(4096) if block else self._sock.recv(4096, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return
        except TimeoutError:  # wait(timeout): still running
            raise
        except OSError:
            data = b""
        code = -9
        if data:
            try:
                code = int(json.loads(data)["exit"])
            except (ValueError, KeyError, TypeError):
                code = -9
        self.returncode = code
        self._sock.close()

    def poll(self) -> int | None:
        with self._lock:
            if self.returncode is None:
                self._read(block=False)
            return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        with self._lock:
            if self.returncode is None:
                self._sock.settimeout(timeout)
                try:
                    self._read(block=True)
                except TimeoutError:
                    raise subprocess.TimeoutExpired(self.args, timeout) from None
                finally:
                    if self.returncode is None:
                        self._sock.settimeout(None)
            return self.returncode


def spawn(env: dict, key: str | None = None, argv=WORKER_ARGV, preload: tuple = ()) -> ForkedProcess:
    """Fork a rank process (``python -m sparkhvd.runner._rank.worker``, or ``python <argv>``) from this
    key's zygote, with ``env`` as its whole environment. ``preload`` (``("tensorflow",)``): from the zygote
    that imported it too, a key of its own.

    Raises OSError or WarmUnavailable when no zygote serves (then one is started for the next run
    when none answered) or when it refused; the caller starts a fresh process instead.
    """
    key = key or zygote_key(preload=preload)
    try:
        sock = connect(key)
    except (ConnectionRefusedError, FileNotFoundError):
        start_server(key, preload=preload)
        raise
    pipes = []
    try:
        pipes = [os.pipe() for _ in range(3)]
        theirs = [pipes[0][0], pipes[1][1], pipes[2][1]]
        env = dict(env)
        env[settings.WARM.name] = settings.WARM_FORKED
        reply = request(sock, {"env": env, "cwd": os.getcwd(), "argv": list(argv)}, theirs)
        if "pid" not in reply:
            raise WarmUnavailable(f"the zygote refused the rank: {reply.get('error', reply)}")
        for fd in theirs:
            os.close(fd)
        sock.settimeout(None)
        return ForkedProcess(sock, int(reply["pid"]), os.fdopen(pipes[0][1], "wb"), os.fdopen(pipes[1][0], "rb"),
                             os.fdopen(pipes[2][0], "rb"))
    except BaseException:
        sock.close()
        for r, w in pipes:
            for fd in (r, w):
                try:
                    os.close(fd)
                except OSError:
                    pass
        raise


def stop(key: str) -> bool:
    """Ask this key's zygote to exit (its running ranks die with it); False if none answered."""
    try:
        sock = connect(key, timeout=5.0)
    except OSError:
        return False
    try:
        request(sock, {"stop": True})
        return True
    except (OSError, ValueError):
        return False
    finally:
        sock.close()


def marked(entry: str) -> list:
    """The pids of the zygotes whose environment holds ``entry`` (``"NAME=value"``): how a test session or a
    benchmark that marked its environment finds the zygotes it started (they run detached)."""
    found = []
    mark = entry.encode()
    for name in os.listdir("/proc") if os.path.isdir("/proc") else []:
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                if SERVER_MODULE.encode() not in f.read():
                    continue
            with open(f"/proc/{name}/environ", "rb") as f:
                if mark in f.read().split(b"\0"):
                    found.append(int(name))
        except (OSError, ValueError):  # gone, or not ours to read
            pass
    return found
