"""The forked rank's first steps: become what ``python <argv>`` would be, run it, exit as Python would (without
finalizing the interpreter: runner/_rank/exit.py's ``end``).

The warm process (``runner/_warm/server.py``) forks; the child calls ``become_rank``, which takes the
agent's pipes as its stdin, stdout and stderr, the rank's working directory and whole environment, its
own session (before the zygote tells the agent its pid) and the command line ``ps`` shows; then the process
state every rank starts with (runner/_rank/startup.py: signals, CPU threads, seeds), and never returns.
"""

from __future__ import annotations

import ctypes
import io
import os
import runpy
import signal
import sys
import traceback

from .._rank import startup
from .._rank import worker as _worker  # the rank's bootstrap, imported once in the warm process
from .._rank.exit import end
from .protocol import WORKER_ARGV

_PR_SET_PDEATHSIG = 1


def become_rank(zygote: int, fds: list, env: dict, cwd: str, argv: list, start_dir: str | None,
                ready: int | None = None, notices: bytes = b"") -> None:
    """In the forked rank (``zygote``: its parent's pid; ``start_dir``: the warm process's working directory
    when it started; ``ready``: a pipe's write end, closed once this process leads its own session and process
    group, which the zygote waits for before it tells the agent the pid; ``notices``: what the zygote's preloaded
    modules printed to stderr, which a fresh rank's imports would have): become ``python <argv>`` with these
    pipes, directory and environment; never returns."""
    code = 70
    try:
        os.setsid()
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)  # die with the zygote
        if os.getppid() != zygote:
            os._exit(75)
        if ready is not None:
            os.close(ready)  # killing the group (pid) now reaches this process: the zygote may reply
        for target, fd in enumerate(fds):
            os.dup2(fd, target)  # dup2 makes 0, 1, 2 inheritable
        for fd in fds:
            if fd > 2:
                os.close(fd)
        view = memoryview(notices)
        while view:
            view = view[os.write(2, view):]
        os.chdir(cwd)
        if start_dir is not None and sys.path and sys.path[0] == start_dir and not sys.flags.safe_path:
            sys.path[0] = cwd  # as python -m in the rank's own working directory puts it
        os.environ.clear()
        os.environ.update(env)
        _stdio()
        _set_cmdline(argv)
        startup.prepare(env)  # signals, threads, seeds, temp folder: what a fresh rank's __main__ runs too
    except BaseException:  # noqa: BLE001
        os._exit(code)
    end(_run(argv))  # as interpreter exit, without finalization (runner/_rank/exit.py)


def _stdio() -> None:
    """sys.stdin/stdout/stderr as Python builds them for a fresh process with PYTHONUNBUFFERED=1."""
    encoding = sys.stdout.encoding if sys.stdout is not None else "utf-8"
    errors = sys.stdout.errors if sys.stdout is not None else "strict"
    sys.stdin = sys.__stdin__ = io.TextIOWrapper(io.BufferedReader(io.FileIO(0, "rb", closefd=False)),
                                                 encoding=encoding, errors=errors, newline="\n")
    sys.stdout = sys.__stdout__ = io.TextIOWrapper(io.FileIO(1, "wb", closefd=False), encoding=encoding,
                                                   errors=errors, newline="\n", write_through=True)
    sys.stderr = sys.__stderr__ = io.TextIOWrapper(io.FileIO(2, "wb", closefd=False), encoding=encoding,
                                                   errors="backslashreplace", newline="\n", write_through=True)


def _set_cmdline(argv: list) -> None:
    """Show ``python -m sparkhvd.runner._rank.worker`` in ps (and to tools that find ranks by it) instead of
    the zygote's command line: rewrite the process's argument area in place (as setproctitle does;
    Python keeps its own copy of argv). Left alone if the new line does not fit."""
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


def _run(argv: list) -> int:
    """Run ``-m module`` or ``-c code`` as ``__main__`` would; returns the exit code."""
    try:
        if tuple(argv[:2]) == WORKER_ARGV:
            sys.argv = [_worker.__file__, *argv[2:]]
            return _worker.run()
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
