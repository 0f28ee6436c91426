"""The warm process (the zygote): one per executor (per interpreter and installed code), forking rank processes.

``python -m sparkhvd.runner._warm.server <key> [tensorflow]`` imports what a rank needs (cloudpickle, the
worker, torch and ``sparkhvd.collective.torch`` when torch is installed; with ``tensorflow``, for the runs
whose function names it (``runner/_payload/frameworks.py``), TensorFlow, Keras and their sparkhvd modules
too) once, then forks each rank process from that state, so that a rank starts without paying for
``import torch`` (or TensorFlow's 8 CPU-seconds) every run. It claims the abstract socket named by ``key``
(``runner/_warm/protocol.py``), serves agents' requests there, and exits after ``SPARKHVD_WARM_IDLE_S`` seconds with no rank running. The forked child
becomes the rank in ``runner/_warm/child.py``.
"""

from __future__ import annotations

import gc
import importlib
import json
import os
import select
import socket
import sys
import threading
import time

from ..._common import settings
from .child import become_rank
from .key import cwd_refusal
from .protocol import MAX_REQUEST_BYTES, SERVER_MODULE, address, peer_uid

_PRELOAD = ("torch", "sparkhvd.collective.torch")  # what every rank imports first, imported once here
# What a rank's first torch.optim optimizer imports (torch._dynamo: about 830 modules, a second of CPU each rank,
# four seconds of a restart at np=8 on 2 cores): where torch has it. Starts no thread (_unsafe_to_fork checks).
_PRELOAD_AFTER = ("torch._dynamo",)
# With "tensorflow": in this order, each where it imports. TensorFlow imports pandas, and so pyarrow, whose
# jemalloc starts one native thread ("jemalloc_bg_thd"): jemalloc's fork handlers make that fork-safe, and
# the child starts its own when it needs one. What TensorFlow prints while it loads (absl's and the CPU
# features notices) is kept and written to each rank's stderr, where a fresh rank's import would print it.
_PRELOAD_TENSORFLOW = ("tensorflow", "sparkhvd.collective.tensorflow", "keras", "sparkhvd.collective.keras")
_FORK_SAFE_THREADS = ("jemalloc_bg_thd",)
_REQUEST_TIMEOUT_S = 5.0  # a client that connects and says nothing does not hold the zygote up
_POLL_EXITS_S = 0.05  # where pidfd_open is missing, how often exited ranks are looked for


def _preload(extra: tuple = ()) -> str | None:
    """Import what ranks need (``extra``: ``("tensorflow",)`` or nothing); returns why this process cannot fork
    ranks safely, or None."""
    global _notices
    # OpenBLAS (numpy's) starts its threads when it loads unless told one: a forked rank gets its
    # count back in runner/_warm/child.py.
    blas = settings.OPENBLAS_NUM_THREADS
    saved = blas.raw()
    os.environ[blas.name] = "1"
    try:
        try:  # the worker and cloudpickle came with this module (runner/_warm/child.py imports the worker)
            for name in _PRELOAD:  # by name: the runner does not depend on the collectives, it warms what ranks load
                importlib.import_module(name)
            for name in _PRELOAD_AFTER:
                why = _import_whole(name)
                if why is not None:
                    return why
        except ImportError:  # no torch here: ranks import what they need themselves
            pass
        if "tensorflow" in extra:
            why, _notices = _keeping_stderr(_import_tensorflow)
            if why is not None:
                return why
    finally:
        if saved is None:
            os.environ.pop(blas.name, None)
        else:
            os.environ[blas.name] = saved
    return _unsafe_to_fork(tensorflow="tensorflow" in extra)


_notices = b""  # what the preloaded TensorFlow printed to stderr


def _import_whole(name: str) -> str | None:
    """Import ``name``; returns why no rank should be forked from here where that failed part-way, else None.

    A failed import removes ``name`` but keeps the submodules it had finished (torch._dynamo's import runs
    torch._inductor's, which imports ``torch._inductor.custom_graph_pass`` and fails later): a rank forked from
    that state fails at its own ``import torch._dynamo`` (``partially initialized module 'torch._inductor' has no
    attribute 'custom_graph_pass'``), where a fresh process would import it, or fail with the true cause."""
    before = set(sys.modules)
    try:
        importlib.import_module(name)
    except Exception as exc:  # noqa: BLE001 - told as the reason; the ranks import it themselves
        left = sorted(set(sys.modules) - before)
        if isinstance(exc, ModuleNotFoundError) and exc.name == name and not left:
            return None  # a torch without it: nothing was half-imported
        return (f"preloading {name} failed ({type(exc).__name__}: {exc}) with {len(left)} of its modules left "
                "imported, which a forked rank's own import of it would trip over")
    return None


def _import_tensorflow() -> str | None:
    """Import ``_PRELOAD_TENSORFLOW`` up to the first that is not installed; returns ``_import_whole``'s reason."""
    for name in _PRELOAD_TENSORFLOW:
        why = _import_whole(name)
        if why is not None or name not in sys.modules:
            return why
    return None


def _keeping_stderr(fn) -> tuple:
    """Run ``fn`` with file descriptor 2 going to memory; returns what it returned and what was written there."""
    sys.stderr.flush()
    saved = os.dup(2)
    kept = os.memfd_create("sparkhvd-zygote-stderr")
    try:
        os.dup2(kept, 2)
        try:
            value = fn()
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
        os.lseek(kept, 0, os.SEEK_SET)
        chunks = []
        while chunk := os.read(kept, 1 << 16):
            chunks.append(chunk)
        return value, b"".join(chunks)
    finally:
        os.close(kept)
        os.close(saved)


def _native_threads() -> list:
    """The names of this process's threads but the main one."""
    names = []
    try:
        for task in os.listdir("/proc/self/task"):
            if int(task) != os.getpid():
                with open(f"/proc/self/task/{task}/comm") as f:
                    names.append(f.read().strip())
    except OSError:
        pass
    return names


def _unsafe_to_fork(tensorflow: bool = False) -> str | None:
    """Why a fork of this process would not be a working rank, or None."""
    threads = threading.active_count()
    others = [name for name in _native_threads() if not (tensorflow and name in _FORK_SAFE_THREADS)]
    if threads != 1 or others:
        return (f"the preloaded modules started threads ({threads} Python; others: {', '.join(others) or 'none'}); "
                "forking is not safe")
    if "tensorflow" in sys.modules and not tensorflow:
        return "TensorFlow was imported by a zygote that does not preload it"
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "CUDA was initialized while preloading; a forked rank could not use its GPU"
    return None


def serve(key: str, extra: tuple = ()) -> int:
    """Claim the key's socket, preload (``extra`` too), then fork ranks on request until idle or told to stop."""
    start_dir = os.getcwd()  # sys.path[0] of this python -m
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        listener.bind(address(key))  # claims the name; a second zygote for the key ends here (EADDRINUSE)
    except OSError:
        return 0
    idle_s = settings.WARM_IDLE_S.get()
    why = _preload(extra)
    if why is not None:
        # Keep the name, refusing connections, so agents stop starting zygotes that cannot serve.
        sys.stderr.write(f"sparkhvd zygote {key}: {why}; ranks start as fresh processes.\n")
        time.sleep(idle_s)
        return 1
    gc.collect()
    gc.freeze()  # the forked ranks share these pages instead of copying them on the first collection
    listener.listen(64)
    return _Server(key, listener, start_dir).run(idle_s)


class _Server:
    """The fork server's state: its listening socket, the agents' connections and the ranks it forked."""

    def __init__(self, key: str, listener: socket.socket, start_dir: str):
        self.key, self.listener, self.start_dir = key, listener, start_dir
        self.me = os.getpid()
        self.conns: dict = {}  # socket -> pid of the rank it asked for, or None before the request
        self.children: dict = {}  # pid -> (connection or None, pidfd or None)
        self.pidfds: dict = {}  # pidfd -> pid

    def run(self, idle_s: float) -> int:
        """Serve until no rank has run for ``idle_s`` seconds, or a stop request; returns the exit code."""
        last = time.monotonic()
        while True:
            timeout = None
            if not self.children:
                timeout = max(0.0, last + idle_s - time.monotonic())
                if timeout == 0.0:
                    return 0
            if self.children and not self.pidfds:
                timeout = _POLL_EXITS_S
            readable, _, _ = select.select([self.listener, *self.conns, *self.pidfds], [], [], timeout)
            for r in readable:
                if self._on_readable(r):
                    return 0
            for pid in [p for p, (_, fd) in self.children.items() if fd is None]:
                self._reap(pid)
            if self.children or readable:
                last = time.monotonic()

    def _on_readable(self, r) -> bool:
        """Handle one ready socket or pidfd; True for "stop"."""
        if r is self.listener:
            self._accept()
        elif isinstance(r, int):  # a child's pidfd
            self._reap(self.pidfds.pop(r))
            os.close(r)
        elif self.conns.get(r) is None:  # a new connection's request
            return self._handle(r)
        else:  # a rank's connection: EOF means its agent died
            self._on_agent_message(r)
        return False

    def _accept(self) -> None:
        try:
            conn, _ = self.listener.accept()
        except OSError:
            return
        if peer_uid(conn) != os.getuid():
            conn.close()
            return
        self.conns[conn] = None

    def _on_agent_message(self, conn: socket.socket) -> None:
        """Its agent closed the connection of a running rank (a killed Spark task): kill the rank's group."""
        try:
            data = conn.recv(4096, socket.MSG_DONTWAIT)
        except OSError:
            data = b""
        if data:
            return
        pid = self.conns[conn]
        try:
            os.killpg(pid, 9)
        except OSError:
            pass
        conn.close()
        del self.conns[conn]
        self.children[pid] = (None, self.children[pid][1])

    def _reap(self, pid: int) -> None:
        """Collect rank ``pid`` if it has exited, and tell its agent the exit code."""
        try:
            done, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            done, status = pid, 9
        if done == 0:
            return
        conn, pidfd = self.children.pop(pid)
        if pidfd is not None and pidfd in self.pidfds:
            self.pidfds.pop(pidfd)
            os.close(pidfd)
        if conn is not None:
            try:
                conn.send(json.dumps({"exit": os.waitstatus_to_exitcode(status)}).encode())
            except OSError:
                pass
            conn.close()
            self.conns.pop(conn, None)

    def _handle(self, conn: socket.socket) -> bool:
        """Answer one request; True for "stop"."""
        fds: list = []
        try:
            conn.settimeout(_REQUEST_TIMEOUT_S)
            data, fds, flags, _ = socket.recv_fds(conn, MAX_REQUEST_BYTES, 3)
            message = _message(data, flags)
            if message.get("stop"):
                conn.send(b'{"stopping": true}')
                return True
            if message.get("ping"):
                conn.send(json.dumps({"pid": self.me, "key": self.key}).encode())
                conn.close()
                del self.conns[conn]
                return False
            env, cwd, argv = _rank_request(message, fds, self.start_dir)
        except (ValueError, OSError) as exc:
            try:
                conn.send(json.dumps({"error": f"bad request: {exc}"}).encode())
            except OSError:
                pass
            conn.close()
            del self.conns[conn]
            for fd in fds:
                os.close(fd)
            return False
        conn.settimeout(None)
        self._fork(conn, fds, env, cwd, argv)
        return False

    def _fork(self, conn: socket.socket, fds: list, env: dict, cwd: str, argv: list) -> None:
        """Fork the rank this connection asked for, and answer with its pid once the rank leads a session and
        process group of its own: before that, killing its group (what this server does when the agent's
        connection closes, and what the agent does) would find no group and miss the rank."""
        ready, ready_w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the rank
            try:
                os.close(ready)
                self.listener.close()
                for c in self.conns:
                    c.close()
                for fd in self.pidfds:
                    os.close(fd)
            except BaseException:  # noqa: BLE001
                os._exit(70)
            become_rank(self.me, fds, env, cwd, argv, self.start_dir, ready_w, _notices)  # never returns
        os.close(ready_w)
        for fd in fds:
            os.close(fd)
        _wait_closed(ready)  # the rank closes its end in its own session (or dies): its group exists, or it ended
        try:
            pidfd = os.pidfd_open(pid)
            self.pidfds[pidfd] = pid
        except (AttributeError, OSError):
            pidfd = None
        self.conns[conn] = pid
        self.children[pid] = (conn, pidfd)
        try:
            conn.send(json.dumps({"pid": pid}).encode())
        except OSError:
            pass


def _wait_closed(fd: int) -> None:
    """Block until every writer of pipe ``fd`` has closed it (the forked rank, or its death), then close it."""
    try:
        while os.read(fd, 64):
            pass
    finally:
        os.close(fd)


def _message(data: bytes, flags: int) -> dict:
    """One request's JSON object; ValueError saying what is wrong with it."""
    if not data:
        raise ValueError("empty request")
    if flags & socket.MSG_TRUNC:
        raise ValueError(f"the request is over {MAX_REQUEST_BYTES} bytes")
    message = json.loads(data)
    if not isinstance(message, dict):
        raise ValueError("the request is not a JSON object")
    return message


def _rank_request(message: dict, fds: list, start_dir: str) -> tuple:
    """``(env, cwd, argv)`` of a request for a rank; ValueError saying what is wrong with it."""
    env, cwd, argv = message.get("env"), message.get("cwd"), message.get("argv")
    if not (isinstance(env, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())):
        raise ValueError("'env' must be an object of strings")
    if not isinstance(cwd, str):
        raise ValueError("'cwd' must be a string")
    if not (isinstance(argv, list) and len(argv) >= 2 and argv[0] in ("-m", "-c")
            and all(isinstance(a, str) for a in argv)):
        raise ValueError("'argv' must be [\"-m\", module, ...] or [\"-c\", code, ...]")
    if len(fds) != 3:
        raise ValueError(f"the request must carry 3 file descriptors (stdin, stdout, stderr), not {len(fds)}")
    refusal = cwd_refusal(cwd, start_dir, sys.modules)
    if refusal is not None:
        raise ValueError(refusal)
    return env, cwd, argv


def main(argv: list) -> int:
    if not argv or any(extra != "tensorflow" for extra in argv[1:]):
        sys.stderr.write(f"usage: python -m {SERVER_MODULE} <key> [tensorflow]; task agents start it, not people.\n")
        return 2
    if os.fork() > 0:  # detach: init adopts the zygote, its starter only reaps this first process
        os._exit(0)
    return serve(argv[0], tuple(argv[1:]))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
