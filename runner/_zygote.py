"""The warm process: one per executor (per interpreter and installed code), forking rank processes.

``python -m sparkhvd.runner._zygote <key>`` imports what a rank needs (cloudpickle, the worker,
torch and ``sparkhvd.collective.torch`` when torch is installed; never TensorFlow) once, then
forks each rank process from that state, so a rank starts in milliseconds instead of paying for
``import torch`` every run. Task agents reach it on a Linux abstract Unix socket named by ``key``
(a hash of what decides the preloaded modules, see ``zygote_key``): an edited sparkhvd or an
upgraded torch gets a new zygote, and a stale one exits after ``SPARKHVD_WARM_IDLE_S`` seconds
with no rank running.

Protocol (SOCK_SEQPACKET, one JSON message each way, never pickle): a request
``{"env": {...}, "cwd": "...", "argv": ["-m", "sparkhvd.runner._worker"]}`` carries the rank's
stdin, stdout and stderr pipe ends as file descriptors; the zygote answers ``{"pid": n}`` and,
when the rank has exited, ``{"exit": code}`` on the same connection. If the agent's end of that
connection closes first (a killed Spark task), the rank's process group is killed. Abstract
sockets have no file permissions, so both ends check the other's uid (SO_PEERCRED): only the same
user may ask for a rank, and an agent only hands a rank's pipes to a zygote of its own user.

``SPARKHVD_WARM=0`` turns the warm path off (every rank a fresh ``python -m``).
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import socket
import struct
import sys

from .._common import settings

ENV_IDLE = "SPARKHVD_WARM_IDLE_S"  # a zygote with no rank running exits after this long (default 600)
ENV_DEBUG = "SPARKHVD_WARM_DEBUG"  # "1": say on stderr why the warm path fell back to a fresh process
DEFAULT_IDLE_S = 600.0
_PRELOAD = ("torch", "sparkhvd.collective.torch")  # what every rank imports first, imported once here
MAX_REQUEST_BYTES = 4 << 20
REPLY_TIMEOUT_S = 10.0  # an agent waits this long for the zygote's {"pid": n}, then uses a fresh process
_NAME_PREFIX = "\0sparkhvd-zygote-"
# TMPDIR (TEMP, TMP): a zygote and the ranks it forks belong to one temp folder; where a job has a folder of its
# own (a sandbox removed when the job ends, a test session), its ranks do not fork from another's zygote.
_KEY_ENV = ("PYTHONPATH", "PYTHONHOME", "LD_LIBRARY_PATH", "LD_PRELOAD", "VIRTUAL_ENV", "TMPDIR", "TEMP", "TMP")
# Read once when a library loads (libgomp, OpenBLAS, MKL) or when Python starts: a rank forked from
# the zygote has the zygote's, so they are part of the key. OMP_NUM_THREADS is not: the fork applies it.
_KEY_ENV_PREFIXES = ("PYTHON", "OMP_", "GOMP_", "KMP_", "MKL_", "OPENBLAS_", "GOTO_")
_KEY_ENV_SKIP = ("PYTHONUNBUFFERED", "OMP_NUM_THREADS")
# CPython's own variables are PYTHON<NAME> (PYTHONPATH, PYTHONHASHSEED, ...) and these PYTHON_<NAME>s. Other
# PYTHON_ names are other programs': Spark gives its Python workers PYTHON_WORKER_FACTORY_SECRET (and, by
# its settings, PYTHON_WORKER_FACTORY_PORT, PYTHON_FAULTHANDLER_DIR, ...), new for every application, so
# keying on them would start a zygote per application and serve none twice. A rank gets them all the
# same: its whole environment is the agent's (_child).
_CPYTHON_UNDERSCORED = ("PYTHON_CPU_COUNT", "PYTHON_FROZEN_MODULES", "PYTHON_GIL", "PYTHON_JIT",
                        "PYTHON_PERF_JIT_SUPPORT", "PYTHON_PRESITE", "PYTHON_TLBC", "PYTHON_CONTEXT_AWARE_WARNINGS",
                        "PYTHON_THREAD_INHERIT_CONTEXT", "PYTHON_DISABLE_REMOTE_DEBUG")
_SKIP_DIRS = ("tests", "bench", "notebooks")
_BLAS_SET_THREADS = ("openblas_set_num_threads", "openblas_set_num_threads64_",
                     "scipy_openblas_set_num_threads", "scipy_openblas_set_num_threads64_")


class WarmUnavailable(Exception):
    """The warm path cannot start this rank; the agent starts a fresh process instead."""


# ---------------------------------------------------------------------------------------------
# the key


def zygote_key(package_dir: str | None = None, torch_files: list | None = None, env: dict | None = None) -> str:
    """A short hash of what decides the zygote's preloaded modules: the interpreter, the environment
    Python and the native libraries read when they start (``_keyed``; not what Spark sets per
    application, so one zygote serves every application on an executor), the user, and (name,
    mtime, size) of every ``.py`` file of sparkhvd and of torch's ``__init__.py`` / ``version.py``
    (stat only: torch is not imported). Not the working directory, which Spark makes anew for each
    application's executors: the zygote refuses a rank whose directory would change what it imports
    (``cwd_refusal``), and the agent then starts a fresh process.

    Not this process's ``sys.path``: a rank's, forked or fresh, comes from its own interpreter's
    start-up with this environment and directory, whatever the agent (a notebook) appended to its own.
    """
    env = os.environ if env is None else env
    if package_dir is None:
        package_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if torch_files is None:
        torch_files = _torch_files()
    h = hashlib.sha256()
    for part in (sys.executable, sys.version, str(os.getuid())):
        h.update(part.encode("utf-8", "surrogateescape") + b"\0")
    for name in sorted(env):
        if _keyed(name):
            h.update(f"{name}={env[name]}\0".encode("utf-8", "surrogateescape"))
    for path in sorted(_package_files(package_dir)) + list(torch_files):
        try:
            st = os.stat(path)
            h.update(f"{path}:{st.st_mtime_ns}:{st.st_size}\0".encode("utf-8", "surrogateescape"))
        except OSError:
            h.update(f"{path}:missing\0".encode("utf-8", "surrogateescape"))
    return h.hexdigest()[:16]


def _keyed(name: str) -> bool:
    """Whether the environment variable ``name`` is part of the key: read by Python or a native library
    when it starts, never what a program sets per run (Spark's PYTHON_WORKER_FACTORY_SECRET)."""
    if name in _KEY_ENV:
        return True
    if name in _KEY_ENV_SKIP or not name.startswith(_KEY_ENV_PREFIXES):
        return False
    return not name.startswith("PYTHON_") or name in _CPYTHON_UNDERSCORED


def _package_files(root: str) -> list:
    """Every .py file of the package at ``root``, descending only into sub-packages."""
    found = []
    stack = [root]
    while stack:
        folder = stack.pop()
        try:
            entries = list(os.scandir(folder))
        except OSError:
            continue
        for entry in entries:
            if entry.name.endswith(".py") and entry.is_file():
                found.append(entry.path)
            elif (entry.is_dir() and not entry.name.startswith(".") and entry.name not in _SKIP_DIRS
                  and os.path.exists(os.path.join(entry.path, "__init__.py"))):
                stack.append(entry.path)
    return found


def _torch_files() -> list:
    import importlib.util

    try:
        spec = importlib.util.find_spec("torch")  # finds, does not import
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.origin:
        return ["torch:absent"]
    folder = os.path.dirname(spec.origin)
    return [os.path.join(folder, "__init__.py"), os.path.join(folder, "version.py")]


def address(key: str) -> str:
    return _NAME_PREFIX + key


# ---------------------------------------------------------------------------------------------
# the agent's side


def enabled(python: str | None) -> bool:
    """Whether a rank with interpreter ``python`` (None: this one) may be forked from a zygote."""
    return (sys.platform.startswith("linux") and settings.WARM.get() != "0"
            and (python is None or python == sys.executable))


def _peer_uid(sock: socket.socket) -> int:
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[1]


def connect(key: str, timeout: float = REPLY_TIMEOUT_S) -> socket.socket:
    """A connection to this key's zygote, checked to belong to this user; OSError if none answers."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        sock.settimeout(timeout)
        sock.connect(address(key))
        uid = _peer_uid(sock)
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


def start_server(key: str, env: dict | None = None) -> None:
    """Start a zygote for ``key`` in the background (detached; it outlives this process). Once per
    30 s per key from one process: a zygote that is still importing refuses connections meanwhile."""
    import subprocess
    import threading
    import time

    now = time.monotonic()
    if now - _starts.get(key, -1e9) < 30.0:
        return
    _starts[key] = now
    debug = os.environ.get(ENV_DEBUG) == "1"
    out = None if debug else subprocess.DEVNULL
    proc = subprocess.Popen([sys.executable, "-m", "sparkhvd.runner._zygote", key], stdin=subprocess.DEVNULL,
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
        import threading

        self._sock = sock
        self._lock = threading.Lock()
        self.pid = pid
        self.stdin, self.stdout, self.stderr = stdin, stdout, stderr
        self.returncode: int | None = None
        self.args = ["<forked by sparkhvd.runner._zygote>"]

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
        import subprocess

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


WORKER_ARGV = ("-m", "sparkhvd.runner._worker")


def spawn(env: dict, key: str | None = None, argv=WORKER_ARGV) -> ForkedProcess:
    """Fork a rank process (``python -m sparkhvd.runner._worker``, or ``python <argv>``) from this
    key's zygote, with ``env`` as its whole environment.

    Raises OSError or WarmUnavailable when no zygote serves (then one is started for the next run
    when none answered) or when it refused; the caller starts a fresh process instead.
    """
    key = key or zygote_key()
    try:
        sock = connect(key)
    except (ConnectionRefusedError, FileNotFoundError):
        start_server(key)
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


# ---------------------------------------------------------------------------------------------
# the zygote


def _preload() -> str | None:
    """Import what ranks need; returns why this process cannot fork ranks safely, or None."""
    import threading

    # OpenBLAS (numpy's) starts its threads when it loads unless told one: a forked rank gets its
    # count back in _apply_threads.
    saved = os.environ.get("OPENBLAS_NUM_THREADS")
    os.environ["OPENBLAS_NUM_THREADS"] = "1"
    try:
        import cloudpickle  # noqa: F401

        from . import _worker  # noqa: F401

        try:
            for name in _PRELOAD:  # by name: the runner does not depend on the collectives, it warms what ranks load
                importlib.import_module(name)
        except ImportError:  # no torch here: ranks import what they need themselves
            pass
    finally:
        if saved is None:
            os.environ.pop("OPENBLAS_NUM_THREADS", None)
        else:
            os.environ["OPENBLAS_NUM_THREADS"] = saved
    threads = threading.active_count()
    try:
        tasks = len(os.listdir("/proc/self/task"))
    except OSError:
        tasks = 1
    if threads != 1 or tasks != 1:
        return f"the preloaded modules started threads ({threads} Python, {tasks} in all); forking is not safe"
    if "tensorflow" in sys.modules:
        return "TensorFlow was imported; the zygote never preloads it"
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "CUDA was initialized while preloading; a forked rank could not use its GPU"
    return None


_START_DIR: str | None = None  # the zygote's working directory when it started: sys.path[0] of its ``python -m``


def serve(key: str) -> int:
    """Claim the key's socket, preload, then fork ranks on request until idle or told to stop."""
    import gc
    import select
    import time

    global _START_DIR
    _START_DIR = os.getcwd()

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        listener.bind(address(key))  # claims the name; a second zygote for the key ends here (EADDRINUSE)
    except OSError:
        return 0
    idle_s = float(os.environ.get(ENV_IDLE) or DEFAULT_IDLE_S)
    why = _preload()
    if why is not None:
        # Keep the name, refusing connections, so agents stop starting zygotes that cannot serve.
        sys.stderr.write(f"sparkhvd zygote {key}: {why}; ranks start as fresh processes.\n")
        time.sleep(idle_s)
        return 1
    gc.collect()
    gc.freeze()  # the forked ranks share these pages instead of copying them on the first collection
    listener.listen(64)
    me = os.getpid()
    conns: dict = {}  # socket -> pid, or None before the request
    children: dict = {}  # pid -> (connection, pidfd or None)
    pidfds: dict = {}  # pidfd -> pid
    last = time.monotonic()
    while True:
        timeout = None
        if not children:
            timeout = max(0.0, last + idle_s - time.monotonic())
            if timeout == 0.0:
                return 0
        if children and not pidfds:
            timeout = 0.05  # no pidfd_open: poll for exits
        readable, _, _ = select.select([listener, *conns, *pidfds], [], [], timeout)
        for r in readable:
            if r is listener:
                try:
                    conn, _ = listener.accept()
                except OSError:
                    continue
                if _peer_uid(conn) != os.getuid():
                    conn.close()
                    continue
                conns[conn] = None
            elif isinstance(r, int):  # a child's pidfd
                _reap(pidfds.pop(r), children, conns, pidfds)
                os.close(r)
            elif conns.get(r) is None:  # a new connection's request
                stop = _handle(r, key, me, listener, conns, children, pidfds)
                if stop:
                    return 0
            else:  # a rank's connection: EOF means its agent died
                try:
                    data = r.recv(4096, socket.MSG_DONTWAIT)
                except OSError:
                    data = b""
                if not data:
                    pid = conns[r]
                    try:
                        os.killpg(pid, 9)
                    except OSError:
                        pass
                    r.close()
                    del conns[r]
                    children[pid] = (None, children[pid][1])
        for pid in [p for p, (_, fd) in children.items() if fd is None]:
            _reap(pid, children, conns, pidfds)
        if children or readable:
            last = time.monotonic()


def _reap(pid: int, children: dict, conns: dict, pidfds: dict) -> None:
    try:
        done, status = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        done, status = pid, 9
    if done == 0:
        return
    conn, pidfd = children.pop(pid)
    if pidfd is not None and pidfd in pidfds:
        pidfds.pop(pidfd)
        os.close(pidfd)
    if conn is not None:
        try:
            conn.send(json.dumps({"exit": os.waitstatus_to_exitcode(status)}).encode())
        except OSError:
            pass
        conn.close()
        conns.pop(conn, None)


def _handle(conn, key, me, listener, conns, children, pidfds) -> bool:
    """Answer one request; True for "stop"."""
    fds: list = []
    try:
        conn.settimeout(5.0)  # a client that connects and says nothing does not hold the zygote up
        data, fds, flags, _ = socket.recv_fds(conn, MAX_REQUEST_BYTES, 3)
        if not data:
            raise ValueError("empty request")
        if flags & socket.MSG_TRUNC:
            raise ValueError(f"the request is over {MAX_REQUEST_BYTES} bytes")
        message = json.loads(data)
        if not isinstance(message, dict):
            raise ValueError("the request is not a JSON object")
        if message.get("stop"):
            conn.send(b'{"stopping": true}')
            return True
        if message.get("ping"):
            conn.send(json.dumps({"pid": me, "key": key}).encode())
            conn.close()
            del conns[conn]
            return False
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
        refusal = cwd_refusal(cwd, _START_DIR, sys.modules)
        if refusal is not None:
            raise ValueError(refusal)
    except (ValueError, OSError) as exc:
        try:
            conn.send(json.dumps({"error": f"bad request: {exc}"}).encode())
        except OSError:
            pass
        conn.close()
        del conns[conn]
        for fd in fds:
            os.close(fd)
        return False
    conn.settimeout(None)
    pid = os.fork()
    if pid == 0:  # the rank
        try:
            listener.close()
            for c in conns:
                c.close()
            for fd in pidfds:
                os.close(fd)
        except BaseException:  # noqa: BLE001
            os._exit(70)
        _child(me, fds, env, cwd, argv)  # never returns
    for fd in fds:
        os.close(fd)
    try:
        pidfd = os.pidfd_open(pid)
        pidfds[pidfd] = pid
    except (AttributeError, OSError):
        pidfd = None
    conns[conn] = pid
    children[pid] = (conn, pidfd)
    try:
        conn.send(json.dumps({"pid": pid}).encode())
    except OSError:
        pass
    return False


def _child(zygote: int, fds: list, env: dict, cwd: str, argv: list) -> None:
    """In the forked rank: become what ``python <argv>`` would be, run it, exit as Python would."""
    import ctypes
    import signal

    code = 70
    try:
        os.setsid()
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: die with the zygote
        if os.getppid() != zygote:
            os._exit(75)
        for target, fd in enumerate(fds):
            os.dup2(fd, target)  # dup2 makes 0, 1, 2 inheritable
        for fd in fds:
            if fd > 2:
                os.close(fd)
        os.chdir(cwd)
        if _START_DIR is not None and sys.path and sys.path[0] == _START_DIR and not sys.flags.safe_path:
            sys.path[0] = cwd  # as python -m in the rank's own working directory puts it
        os.environ.clear()
        os.environ.update(env)
        if "tempfile" in sys.modules:  # found again from the rank's own TMPDIR, as in a fresh process
            sys.modules["tempfile"].tempdir = None
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        _stdio()
        _set_cmdline(argv)
        _apply_threads(env)
        if "numpy" in sys.modules:  # a fresh process seeds numpy's global generator from the OS
            sys.modules["numpy"].random.seed()
    except BaseException:  # noqa: BLE001
        os._exit(code)
    code = _run(argv)
    _exit(code)


def cwd_refusal(cwd: str, start_dir: str | None, modules: dict) -> str | None:
    """Why a rank whose working directory is ``cwd`` cannot fork from a zygote started in ``start_dir`` with
    ``modules`` loaded, or None. A fresh ``python -m`` puts its working directory first on ``sys.path``, so the
    fork is the same process only where no preloaded module came from the zygote's own directory and none is
    shadowed by a module in the rank's (Spark gives each application's executors a working directory of its own,
    so the key leaves the directory out and this check stands in for it)."""
    if start_dir is None or os.path.realpath(cwd) == os.path.realpath(start_dir):
        return None
    for name, module in list(modules.items()):
        top, file = name.partition(".")[0], getattr(module, "__file__", None) or ""
        found_there = file.startswith(os.path.join(start_dir, top, "")) or (
            os.path.dirname(file) == start_dir and os.path.basename(file).startswith(f"{top}."))
        if found_there:  # through sys.path[0], which a rank elsewhere does not have
            return f"its module {name} was imported from its working directory {start_dir}, which the rank's is not"
    try:
        entries = set(os.listdir(cwd))
    except OSError as exc:
        return f"the rank's working directory {cwd} cannot be listed ({exc.strerror})"
    for top in sorted({name.partition(".")[0] for name in modules} - {"__main__"}):  # python -m never imports it
        if f"{top}.py" in entries or (top in entries and os.path.isfile(os.path.join(cwd, top, "__init__.py"))):
            return (f"the rank's working directory {cwd} holds a module {top}, which a fresh process would import "
                    "instead of the preloaded one")
    return None


def _stdio() -> None:
    """sys.stdin/stdout/stderr as Python builds them for a fresh process with PYTHONUNBUFFERED=1."""
    import io

    encoding = sys.stdout.encoding if sys.stdout is not None else "utf-8"
    errors = sys.stdout.errors if sys.stdout is not None else "strict"
    sys.stdin = sys.__stdin__ = io.TextIOWrapper(io.BufferedReader(io.FileIO(0, "rb", closefd=False)),
                                                 encoding=encoding, errors=errors, newline="\n")
    sys.stdout = sys.__stdout__ = io.TextIOWrapper(io.FileIO(1, "wb", closefd=False), encoding=encoding,
                                                   errors=errors, newline="\n", write_through=True)
    sys.stderr = sys.__stderr__ = io.TextIOWrapper(io.FileIO(2, "wb", closefd=False), encoding=encoding,
                                                   errors="backslashreplace", newline="\n", write_through=True)


def _set_cmdline(argv: list) -> None:
    """Show ``python -m sparkhvd.runner._worker`` in ps (and to tools that find ranks by it) instead of
    the zygote's command line: rewrite the process's argument area in place (as setproctitle does;
    Python keeps its own copy of argv). Left alone if the new line does not fit."""
    import ctypes

    try:
        with open("/proc/self/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        start, end = int(fields[45]), int(fields[46])  # arg_start, arg_end (stat fields 48, 49)
    except (OSError, IndexError, ValueError):
        return
    shown = argv if argv[0] == "-m" else argv[:1]
    line = b"\0".join(a.encode("utf-8", "surrogateescape") for a in [sys.executable, *shown]) + b"\0"
    if start <= 0 or len(line) > end - start:
        return
    ctypes.memmove(start, line.ljust(end - start, b"\0"), end - start)


def _apply_threads(env: dict) -> None:
    """What the rank's environment would have set when torch's OpenMP and numpy's OpenBLAS loaded."""
    omp = env.get("OMP_NUM_THREADS", "")
    torch = sys.modules.get("torch")
    if torch is not None and omp.isdigit() and int(omp) > 0:
        torch.set_num_threads(int(omp))
    wanted = env.get("OPENBLAS_NUM_THREADS") or env.get("GOTO_NUM_THREADS") or omp
    if not (wanted.isdigit() and int(wanted) > 0):
        wanted = str(len(os.sched_getaffinity(0)))
    if int(wanted) == 1:
        return
    import ctypes

    try:
        with open("/proc/self/maps") as maps:
            libs = {line.split()[-1] for line in maps if "openblas" in line and ".so" in line}
    except OSError:
        return
    for lib in libs:
        try:
            handle = ctypes.CDLL(lib)
        except OSError:
            continue
        for name in _BLAS_SET_THREADS:
            fn = getattr(handle, name, None)
            if fn is not None:
                fn(ctypes.c_int(int(wanted)))
                break


def _run(argv: list) -> int:
    """Run ``-m module`` or ``-c code`` as ``__main__`` would; returns the exit code."""
    import traceback

    try:
        if argv[0] == "-m" and argv[1] == "sparkhvd.runner._worker":
            from . import _worker

            sys.argv = [_worker.__file__, *argv[2:]]
            return _worker.run()
        import runpy

        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = ["-c", *argv[2:]]
            exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
        return 0
    except SystemExit as exc:
        return _exit_code(exc.code)
    except BaseException:  # noqa: BLE001 - printed as the interpreter would
        traceback.print_exc()
        return 1


def _exit_code(code) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    sys.stderr.write(f"{code}\n")
    return 1


def _exit(code: int) -> None:
    """End as interpreter exit would: join non-daemon threads, run atexit handlers, flush."""
    import atexit
    import threading

    try:
        threading._shutdown()  # what Py_FinalizeEx calls
    except BaseException:  # noqa: BLE001
        pass
    try:
        atexit._run_exitfuncs()
    except BaseException:  # noqa: BLE001
        pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:  # noqa: BLE001
            pass
    os._exit(code)


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
                if b"sparkhvd.runner._zygote" not in f.read():
                    continue
            with open(f"/proc/{name}/environ", "rb") as f:
                if mark in f.read().split(b"\0"):
                    found.append(int(name))
        except (OSError, ValueError):  # gone, or not ours to read
            pass
    return found


def main(argv: list) -> int:
    if len(argv) != 1:
        sys.stderr.write("usage: python -m sparkhvd.runner._zygote <key>; task agents start it, not people.\n")
        return 2
    if os.fork() > 0:  # detach: init adopts the zygote, its starter only reaps this first process
        os._exit(0)
    return serve(argv[0])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
