"""Conformance harness (by hand, not a test, not run in CI): Horovod's own parallel test suites
run against sparkhvd.

Horovod's tests say ``import horovod.torch as hvd``; this harness makes that import give
``sparkhvd.collective.torch`` (and ``horovod.tensorflow`` -> ``sparkhvd.collective.tensorflow``,
``horovod.keras`` / ``horovod.tensorflow.keras`` -> ``sparkhvd.collective.keras``), then runs each
test of ``test/parallel/test_torch.py`` and/or ``test/parallel/test_tensorflow.py`` on np ranks
and counts how many pass.

How a test runs: np fresh processes, each ``python -m pytest -x -q FILE::Class::test`` from the
suite's folder, with torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
MASTER_ADDR=127.0.0.1, MASTER_PORT=a free port) plus Horovod's gloo variables (HOROVOD_RANK,
HOROVOD_SIZE, HOROVOD_LOCAL_RANK, HOROVOD_LOCAL_SIZE), OMP_NUM_THREADS=1 and CUDA hidden (and,
to leave nothing behind or on screen: PYTHONDONTWRITEBYTECODE=1, no pytest cache, TMPDIR in the
harness's temporary folder, TF_CPP_MIN_LOG_LEVEL=2). A free port that is taken before rank 0
binds it (EADDRINUSE) reruns the test once on another port. Each
rank's result is read from its JUnit XML. A test passes when every rank passes, is skipped when
every rank skips, and otherwise fails, keeping the first error line of the first rank to fail
(its peers get a few seconds, then are killed: they are usually blocked in a collective). A test
still running after ``--timeout`` seconds counts as a timeout. Each rank is the leader of its own
process group, and the whole group is killed when its test ends. One test at a time.

The aliases live in a temporary folder put first on PYTHONPATH: a ``horovod`` package whose
``__init__`` installs an import hook, plus the few harness shims the test files import that are
not Horovod's public API (``horovod.tensorflow.util._executing_eagerly``,
``horovod.runner.util.threads.in_thread`` for test/utils/common.py, and ``mock`` as
``unittest.mock``). The ranks import a copy of sparkhvd taken when the run starts (the working
tree of the installed checkout, or with ``--rev`` one of its commits), so edits made meanwhile do
not change the code under test halfway. The temporary folder (shims, copy, the tests' TMPDIR) is
removed at the end, also on Ctrl-C or SIGTERM.

This file copies none of Horovod's tests: it reads them from the checkout you name. Get one with
``git clone https://github.com/horovod/horovod`` (or any folder holding its ``test/``).

    python bench/conformance.py PATH_TO_HOROVOD_CHECKOUT [--suite torch|tensorflow|all]
        [-k PATTERN] [--np 2] [--timeout 120] [--json OUT.json] [--rev GIT_REV]

``-k`` is pytest's ``-k`` expression, applied when the test ids are collected. ``--json`` writes
every test's outcome and first error line (rewritten after each test, so an interrupted run
leaves what it had); without it the harness only prints. On 2 cores the torch suite takes
about ten minutes, the TensorFlow one longer.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass, field

SUITES = {"torch": "test_torch.py", "tensorflow": "test_tensorflow.py"}
# tf.test.TestCase's session helper: pytest collects it by its name, TensorFlow skips it as "not a test".
NOT_TESTS = {"test_session"}
PEER_GRACE_S = 5.0   # how long the other ranks may go on after one rank has failed
POLL_S = 0.1
EXCEPTION_LINE = re.compile(r"^[\w.]*(Error|Exception|Exit)\b[^ ]*: ")
# Errors that only say a peer went away: reported only when no rank has an error of its own.
COLLATERAL = re.compile(r"closed its control link|connection (reset|closed|refused)|broken pipe|peer", re.I)

# The harness's shim files, written into a temporary folder put first on PYTHONPATH.
# HARNESS SHIMS, not Horovod's code and not sparkhvd's: only what the test files import.
SHIM_FILES = {
    "horovod/__init__.py": '''
        """HARNESS SHIM (bench/conformance.py): `horovod.*` imports resolve to sparkhvd."""
        import importlib
        import importlib.abc
        import importlib.util
        import sys

        ALIASES = {
            "horovod.torch": "sparkhvd.collective.torch",
            "horovod.torch.mpi_ops": "sparkhvd.collective.torch",  # test_adasum_pytorch.py imports synchronize there
            "horovod.tensorflow": "sparkhvd.collective.tensorflow",
            "horovod.keras": "sparkhvd.collective.keras",
            "horovod.tensorflow.keras": "sparkhvd.collective.keras",
            # not public API; the test files import it as a helper
            "horovod.tensorflow.util": "horovod._shim_tensorflow_util",
        }


        class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
            """Finds the aliased names (also under an aliased parent) and loads the target module."""

            def find_spec(self, name, path=None, target=None):
                if name in ALIASES:
                    return importlib.util.spec_from_loader(name, self)
                return None

            def create_module(self, spec):
                return None

            def exec_module(self, module):
                # The import system returns sys.modules[name] after exec: the target module itself.
                sys.modules[module.__name__] = importlib.import_module(ALIASES[module.__name__])


        if not any(isinstance(f, _Alias) for f in sys.meta_path):
            sys.meta_path.insert(0, _Alias())
    ''',
    "horovod/_shim_tensorflow_util.py": '''
        """HARNESS SHIM for horovod.tensorflow.util (only what the tests import)."""
        import tensorflow as tf


        def _executing_eagerly():
            return tf.executing_eagerly()
    ''',
    "horovod/runner/__init__.py": '"""HARNESS SHIM."""\n',
    "horovod/runner/util/__init__.py": '"""HARNESS SHIM."""\n',
    "horovod/runner/util/threads.py": '''
        """HARNESS SHIM for horovod.runner.util.threads (imported by test/utils/common.py)."""
        import threading


        def in_thread(target, args=(), name=None, daemon=True, silent=False):
            thread = threading.Thread(target=target, args=args, name=name, daemon=daemon)
            thread.start()
            return thread
    ''',
    "mock.py": '''
        """HARNESS SHIM: the `mock` backport is unittest.mock (test/utils/common.py imports it)."""
        import sys
        import unittest.mock

        sys.modules[__name__] = unittest.mock
    ''',
}

# Inherited variables that would change how a rank starts; the harness sets its own.
DROPPED_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
               "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "PYTHONPATH", "PMI_RANK", "PMI_SIZE",
               "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE")


@dataclass
class RankResult:
    rank: int
    outcome: str          # passed | failed | skipped | timeout | killed
    error: str = ""       # first error line, "" when passed or skipped
    returncode: int | None = None


@dataclass
class TestResult:
    id: str
    outcome: str          # passed | failed | skipped | timeout
    error: str = ""
    seconds: float = 0.0
    ranks: list = field(default_factory=list)


# ---------------------------------------------------------------------------------------------
# set-up


def find_parallel_dir(checkout: str) -> str:
    """The folder holding test_torch.py: CHECKOUT/test/parallel, or CHECKOUT itself, or CHECKOUT/parallel."""
    for candidate in (os.path.join(checkout, "test", "parallel"), os.path.join(checkout, "parallel"), checkout):
        if os.path.isfile(os.path.join(candidate, SUITES["torch"])) or \
                os.path.isfile(os.path.join(candidate, SUITES["tensorflow"])):
            return os.path.abspath(candidate)
    raise SystemExit(f"{checkout} holds no test/parallel/{SUITES['torch']} or {SUITES['tensorflow']}; "
                     "pass the root of a Horovod checkout (git clone https://github.com/horovod/horovod).")


def snapshot_sparkhvd(root: str, rev: str | None) -> tuple[str, str]:
    """Copy sparkhvd's package folders into ROOT/src/sparkhvd; returns (that src folder, the source copied).

    The ranks import the copy, so edits made to the tree while a suite runs (a half-saved file)
    do not change the code under test halfway through. With REV, the copy is that commit of the
    installed checkout (``git archive``), not its working tree.
    """
    import importlib.util
    spec = importlib.util.find_spec("sparkhvd")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("sparkhvd is not installed in this interpreter; run this with the project's .venv/bin/python.")
    source = os.path.abspath(list(spec.submodule_search_locations)[0])
    tree = source
    if rev:
        tree = os.path.join(root, "archive")
        os.makedirs(tree)
        archive = subprocess.run(["git", "-C", source, "archive", "--format=tar", rev], capture_output=True)
        if archive.returncode != 0:
            raise SystemExit(f"git archive {rev} in {source} failed: {archive.stderr.decode().strip()}")
        subprocess.run(["tar", "-x", "-C", tree], input=archive.stdout, check=True)
    target = os.path.join(root, "src", "sparkhvd")
    os.makedirs(target)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in sorted(os.listdir(tree)):
        path = os.path.join(tree, name)
        if name == "__init__.py":
            shutil.copy2(path, target)
        elif name != "tests" and os.path.isfile(os.path.join(path, "__init__.py")):
            shutil.copytree(path, os.path.join(target, name), ignore=ignore)
    return os.path.dirname(target), source


def check_imports(module: str, parallel_dir: str, env: dict) -> None:
    """Fail in seconds, with the error, when the tree under test cannot import MODULE."""
    proc = subprocess.run([sys.executable, "-c", f"import {module}"], cwd=parallel_dir, env=env,
                          capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.strip().splitlines()[-15:])
        raise SystemExit(f"the sparkhvd under test cannot import {module}:\n{tail}")


def write_shims(root: str) -> str:
    """Write SHIM_FILES under ROOT/shims; returns that folder (first on the ranks' PYTHONPATH)."""
    shim_dir = os.path.join(root, "shims")
    for rel, source in SHIM_FILES.items():
        path = os.path.join(shim_dir, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(textwrap.dedent(source).lstrip())
    return shim_dir


def base_env(shim_dir: str, src_dir: str, tmp_dir: str) -> dict:
    """The environment every process starts from: ours, less rank variables, plus the shims and the copy."""
    env = {k: v for k, v in os.environ.items() if k not in DROPPED_ENV and not k.startswith("HOROVOD_")}
    env.update(PYTHONPATH=os.pathsep.join([shim_dir, src_dir]), PYTHONDONTWRITEBYTECODE="1", OMP_NUM_THREADS="1",
               CUDA_VISIBLE_DEVICES="", TMPDIR=tmp_dir, TF_CPP_MIN_LOG_LEVEL="2")
    return env


def rank_env(env: dict, rank: int, np_: int, port: int) -> dict:
    """torchrun's variables and Horovod's gloo ones for RANK of NP_, all on this host."""
    env = dict(env)
    env.update(RANK=str(rank), WORLD_SIZE=str(np_), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(np_),
               GROUP_RANK="0", GROUP_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
               HOROVOD_RANK=str(rank), HOROVOD_SIZE=str(np_), HOROVOD_LOCAL_RANK=str(rank),
               HOROVOD_LOCAL_SIZE=str(np_), HOROVOD_CROSS_RANK="0", HOROVOD_CROSS_SIZE="1")
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pytest_cmd(*args: str) -> list:
    return [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args]


def collect(parallel_dir: str, filename: str, pattern: str | None, env: dict) -> list:
    """The test ids of one suite, as pytest collects them (one process, no rank variables)."""
    cmd = pytest_cmd("--collect-only", "-q", filename, *(["-k", pattern] if pattern else []))
    proc = subprocess.run(cmd, cwd=parallel_dir, env=env, capture_output=True, text=True, timeout=600)
    ids = [line.strip() for line in proc.stdout.splitlines() if line.startswith(filename + "::")]
    ids = [i for i in dict.fromkeys(ids) if i.split("::")[-1] not in NOT_TESTS]   # in order, once each
    if proc.returncode not in (0, 5) or (not ids and not pattern):
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-30:])
        raise SystemExit(f"collecting {filename} failed (pytest exit {proc.returncode}):\n{tail}")
    return ids


# ---------------------------------------------------------------------------------------------
# one test on np ranks


def first_line(text: str) -> str:
    for line in (text or "").splitlines():
        if line.strip():
            return line.strip()[:400]
    return ""


def read_junit(path: str) -> tuple[str, str] | None:
    """(outcome, first error line) from one rank's JUnit XML, or None when it wrote none."""
    try:
        tree = ET.parse(path)
    except (OSError, ET.ParseError):
        return None
    cases = list(tree.iter("testcase"))
    errors = [e for e in tree.iter() if e.tag in ("failure", "error")]
    if errors:
        e = errors[0]
        message = e.get("message") or ""
        if message in ("", "collection failure") or message.startswith("failed on setup"):
            # pytest's placeholder: the exception is the last "E   " line of the traceback
            e_lines = [line[1:].strip() for line in (e.text or "").splitlines() if line.startswith("E ")]
            message = e_lines[-1] if e_lines else message or e.text or e.tag
        message = first_line(message)
        if message.endswith(":"):
            # TensorFlow's wrapper ("UnknownError: Graph execution error:"): add the error it wraps
            inner = [line[1:].strip() for line in (e.text or "").splitlines() if line.startswith("E ")]
            inner = [line for line in inner if EXCEPTION_LINE.match(line) and not line.endswith(":")]
            if inner:
                message = f"{message} {inner[0]}"
        return "failed", message[:400]
    if not cases:
        return "failed", "no test collected"
    if all(c.find("skipped") is not None for c in cases):
        return "skipped", ""
    return "passed", ""


def last_error_line(log_path: str) -> str:
    """A fallback error line from a rank's output: the last 'E   ' line or the last line."""
    try:
        with open(log_path, errors="replace") as f:
            lines = [line.rstrip() for line in f if line.strip()]
    except OSError:
        return ""
    e_lines = [line[1:].strip() for line in lines if line.startswith("E ")]
    return (e_lines[-1] if e_lines else lines[-1] if lines else "")[:400]


def kill_group(proc: subprocess.Popen) -> None:
    """Kill the rank's whole process group (it leads its own session), then reap it."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)


def run_test(test_id: str, parallel_dir: str, env: dict, np_: int, timeout: float, work: str) -> TestResult:
    port = free_port()
    procs, logs, xmls = [], [], []
    start = time.monotonic()
    try:
        for rank in range(np_):
            logs.append(os.path.join(work, f"rank{rank}.log"))
            xmls.append(os.path.join(work, f"rank{rank}.xml"))
            with contextlib.suppress(FileNotFoundError):
                os.remove(xmls[-1])
            with open(logs[-1], "w") as log:
                procs.append(subprocess.Popen(
                    pytest_cmd("-x", "-q", f"--junitxml={xmls[-1]}", test_id), cwd=parallel_dir,
                    env=rank_env(env, rank, np_, port), stdin=subprocess.DEVNULL, stdout=log,
                    stderr=subprocess.STDOUT, start_new_session=True))
        deadline, first_failure_at, timed_out = start + timeout, None, False
        failed_order = []   # ranks in the order they exited non-zero
        while any(p.poll() is None for p in procs):
            now = time.monotonic()
            failed_order += [i for i, p in enumerate(procs) if p.poll() not in (None, 0) and i not in failed_order]
            if first_failure_at is None and failed_order:
                first_failure_at = now
            if now > deadline:
                timed_out = True
                break
            if first_failure_at is not None and now - first_failure_at > PEER_GRACE_S:
                break
            time.sleep(POLL_S)
        still_running = {i for i, p in enumerate(procs) if p.poll() is None}
        failed_order += [i for i, p in enumerate(procs) if p.poll() not in (None, 0) and i not in failed_order]
    finally:
        for p in procs:
            kill_group(p)
    seconds = time.monotonic() - start

    ranks = []
    for rank, proc in enumerate(procs):
        if rank in still_running:
            ranks.append(RankResult(rank, "timeout" if timed_out else "killed", returncode=None))
            continue
        parsed = read_junit(xmls[rank])
        if parsed is None:
            why = f"exited with {proc.returncode}" if proc.returncode >= 0 else \
                f"died of {signal.Signals(-proc.returncode).name}"
            parsed = ("failed", f"rank {rank} {why} without a result: {last_error_line(logs[rank])}")
        elif parsed[0] != "failed" and proc.returncode != 0:
            parsed = ("failed", f"rank {rank} {parsed[0]} its test, then exited with {proc.returncode}")
        ranks.append(RankResult(rank, *parsed, returncode=proc.returncode))

    outcomes = {r.outcome for r in ranks}
    failed = [r for r in ranks if r.outcome == "failed"]
    if failed:
        # The root cause: a rank whose error is its own (not "a peer went away"), the first to exit.
        order = {rank: i for i, rank in enumerate(failed_order)}
        first = min(failed, key=lambda r: (bool(COLLATERAL.search(r.error)), order.get(r.rank, len(order)), r.rank))
        outcome, error = "failed", first.error
    elif "timeout" in outcomes:
        waiting = [r.rank for r in ranks if r.outcome == "timeout"]
        outcome, error = "timeout", f"ranks {waiting} still running after {timeout:g} s"
    elif outcomes == {"passed"}:
        outcome, error = "passed", ""
    elif outcomes == {"skipped"}:
        outcome, error = "skipped", ""
    else:
        outcome, error = "failed", "ranks disagree: " + ", ".join(f"{r.rank}={r.outcome}" for r in ranks)
    return TestResult(test_id, outcome, error, round(seconds, 1), [asdict(r) for r in ranks])


# ---------------------------------------------------------------------------------------------
# reporting


def normalise(error: str) -> str:
    """Group errors that differ only in numbers, addresses or quoted names (Ray Train's poll.py)."""
    error = re.sub(r"0x[0-9a-fA-F]+", "<ADDR>", error)
    error = re.sub(r"'[^']*'", "'<STR>'", error)
    error = re.sub(r"(?<![\w.])[-+]?\d+(\.\d+)?(e[-+]?\d+)?(?![\w.])", "<NUM>", error)
    return error[:160]


def counts(results: list) -> dict:
    c = collections.Counter(r.outcome for r in results)
    return {k: c.get(k, 0) for k in ("passed", "failed", "skipped", "timeout")} | {"total": len(results)}


def summary_line(filename: str, c: dict) -> str:
    return (f"{filename}: passed {c['passed']} of {c['total']} "
            f"(failed {c['failed']}, skipped {c['skipped']}, timeout {c['timeout']})")


def print_report(all_results: dict) -> None:
    print("\n%-22s %6s %7s %7s %8s %8s" % ("suite", "total", "passed", "failed", "skipped", "timeout"))
    for filename, results in all_results.items():
        c = counts(results)
        print("%-22s %6d %7d %7d %8d %8d" % (filename, c["total"], c["passed"], c["failed"], c["skipped"],
                                             c["timeout"]))
    for filename, results in all_results.items():
        groups = collections.defaultdict(list)
        for r in results:
            if r.outcome in ("failed", "timeout"):
                groups[normalise(r.error) if r.outcome == "failed" else "timeout"].append(r.id.split("::")[-1])
        if groups:
            print(f"\n{filename}: failures by cause, most common first")
            for cause, tests in sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[0])):
                print(f"  {len(tests):3d}  {cause}")
                print(textwrap.fill(", ".join(tests), width=110, initial_indent=" " * 7,
                                    subsequent_indent=" " * 7))
    print()
    for filename, results in all_results.items():
        print(summary_line(filename, counts(results)))


def git_head(path: str, rev: str = "HEAD") -> str:
    proc = subprocess.run(["git", "-C", path, "rev-parse", rev], capture_output=True, text=True)
    return proc.stdout.strip() if proc.returncode == 0 else ""


def git_changed(path: str) -> list:
    proc = subprocess.run(["git", "-C", path, "status", "--short"], capture_output=True, text=True)
    return proc.stdout.splitlines() if proc.returncode == 0 else []


def write_json(path: str, meta: dict, all_results: dict) -> None:
    doc = dict(meta, suites={name: {"counts": counts(results), "summary": summary_line(name, counts(results)),
                                    "tests": [asdict(r) for r in results]}
                             for name, results in all_results.items()})
    tmp = path + ".part"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1)
    os.replace(tmp, path)


# ---------------------------------------------------------------------------------------------


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkout", help="a Horovod checkout (the folder holding test/parallel)")
    ap.add_argument("--suite", choices=["torch", "tensorflow", "all"], default="all")
    ap.add_argument("-k", dest="pattern", help="pytest -k expression selecting tests")
    ap.add_argument("--np", dest="np_", type=int, default=2, metavar="N", help="ranks per test (default 2)")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds per test (default 120)")
    ap.add_argument("--json", help="write every test's outcome here (default: print only)")
    ap.add_argument("--rev", help="test this commit of the sparkhvd checkout (default: its working tree as it is now)")
    args = ap.parse_args(argv)
    if args.np_ < 1:
        ap.error("--np must be at least 1")

    parallel_dir = find_parallel_dir(args.checkout)
    suites = [SUITES[s] for s in (SUITES if args.suite == "all" else [args.suite])]
    suites = [s for s in suites if os.path.isfile(os.path.join(parallel_dir, s))]
    root = tempfile.mkdtemp(prefix="sparkhvd-conformance-")
    # SIGTERM ends the run like Ctrl-C does: through the finally below, which cleans up.
    signal.signal(signal.SIGTERM, _interrupt)
    all_results: dict = {}
    interrupted = False
    try:
        src_dir, source = snapshot_sparkhvd(root, args.rev)
        meta = {"horovod": parallel_dir, "horovod_commit": git_head(parallel_dir), "sparkhvd": source,
                "sparkhvd_commit": git_head(source, args.rev or "HEAD"),
                "sparkhvd_changed_files": [] if args.rev else git_changed(source),
                "np": args.np_, "timeout_s": args.timeout, "k": args.pattern, "started": time.strftime("%FT%T%z")}
        changes = "" if args.rev else f" + {len(meta['sparkhvd_changed_files'])} changed files"
        print(f"sparkhvd: a copy of {source} at {meta['sparkhvd_commit'][:12] or '?'}{changes};"
              f" Horovod tests: {parallel_dir}", flush=True)
        shim_dir = write_shims(root)
        tmp_dir = os.path.join(root, "tmp")
        work = os.path.join(root, "work")
        os.makedirs(tmp_dir)
        os.makedirs(work)
        env = base_env(shim_dir, src_dir, tmp_dir)
        for filename in suites:
            check_imports("sparkhvd.collective." + [k for k, v in SUITES.items() if v == filename][0],
                          parallel_dir, env)
            ids = collect(parallel_dir, filename, args.pattern, env)
            print(f"{filename}: {len(ids)} tests, np={args.np_}, timeout {args.timeout:g} s", flush=True)
            results = all_results[filename] = []
            width = len(str(len(ids)))
            for i, test_id in enumerate(ids, 1):
                r = run_test(test_id, parallel_dir, env, args.np_, args.timeout, work)
                if r.outcome == "failed" and "EADDRINUSE" in r.error:
                    # free_port() found a port that something else took before rank 0 bound it: not
                    # the test's doing, so run it once more on another port
                    r = run_test(test_id, parallel_dir, env, args.np_, args.timeout, work)
                results.append(r)
                tail = f"  {r.error}" if r.error else ""
                print(f"[{i:{width}d}/{len(ids)}] {test_id.split('::')[-1]} {r.outcome} ({r.seconds:.1f}s){tail}",
                      flush=True)
                if args.json:
                    write_json(args.json, meta, all_results)
    except KeyboardInterrupt:
        interrupted = True
        print("\ninterrupted: the results so far", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if args.json and all_results:
        write_json(args.json, dict(meta, interrupted=interrupted, finished=time.strftime("%FT%T%z")), all_results)
    print_report(all_results)
    return 130 if interrupted else 0


if __name__ == "__main__":
    sys.exit(main())
