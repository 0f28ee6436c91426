"""``sparkhvd run``: run a training script on np ranks from the shell (scheduled jobs, spark-submit).

    sparkhvd run --np 4 [--master URL | --remote sc://HOST:PORT] [--conf k=v ...] [--log-dir DIR] [--max-restarts N]
                 [--retry-on EXCEPTION ... [--max-retries N]] [--max-preemptions N]
                 [--run-id ID [--storage URL] [--keep-commits N] [--keep-best FIELD:min|max]] train.py [args...]

Everything after the script path goes to the script. Exit status: 0 when every rank succeeded, 1 when
the run failed (the error on stderr), 2 for bad usage, 130 / 143 when stopped by SIGINT / SIGTERM (every
rank is stopped and the Spark job cancelled first). Also ``python -m sparkhvd run ...``, and under
spark-submit as a file: ``spark-submit --master URL <path of this file> run --np 2 train.py`` (docs/cli.md).
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__" and not __package__:
    # Run as a file (spark-submit): its folder, first on sys.path, must not shadow other modules.
    _HERE = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]

import argparse
import importlib
import signal

from sparkhvd._common import settings

EXIT_FAILED = 1
EXIT_USAGE = 2  # argparse's own


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sparkhvd", description="Run Horovod-style training on Apache Spark.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    run = commands.add_parser(
        "run", help="run a Python script on np ranks",
        description="Run a Python script on np ranks, as HorovodRunner(np).run('train.py', *args) does.",
        epilog="Options go before the script path; everything after it is the script's own arguments. "
               "Exit status: 0 success, 1 the run failed, 2 bad usage, 130/143 stopped by SIGINT/SIGTERM.")
    run.add_argument("--np", type=int, required=True,
                     help="ranks: N>0 for N Spark barrier tasks, -N for N processes on this machine without Spark")
    run.add_argument("--master", help="Spark master URL (default: an embedded local[np] session, or spark-submit's)")
    run.add_argument("--remote", metavar="sc://HOST:PORT",
                     help="a Spark Connect server to run on, as pyspark --remote (default: $SPARK_REMOTE, if set)")
    run.add_argument("--conf", action="append", default=[], metavar="KEY=VALUE",
                     help="a Spark setting for the session; repeat for more")
    run.add_argument("--log-dir", help="where each rank's log (rank-<r>.log) goes (default: a new temp folder)")
    run.add_argument("--max-restarts", type=int, default=0, metavar="N",
                     help="relaunch every rank up to N times after an infrastructure failure (docs/elastic.md)")
    run.add_argument("--retry-on", action="append", default=[], metavar="EXCEPTION",
                     help="an exception class (OSError, or module.Class) that relaunches every rank from the last "
                          "commit when a rank raises it; repeat for more")
    run.add_argument("--max-retries", type=int, default=None, metavar="N",
                     help="how many times --retry-on's exceptions relaunch the run (default 3)")
    run.add_argument("--max-preemptions", type=int, default=None, metavar="N",
                     help="how many times the run relaunches after Spark decommissions an executor of its ranks "
                          "(default: no limit)")
    run.add_argument("--run-id", metavar="ID",
                     help="names the run; with --storage, running it again with the same ID resumes its commits")
    run.add_argument("--storage", metavar="URL",
                     help="where a run with --run-id keeps its commits to outlive this command (default: "
                          "$SPARKHVD_STORAGE)")
    run.add_argument("--keep-commits", type=int, default=0, metavar="N",
                     help="the newest commits of each state a successful run leaves in --storage (default 0)")
    run.add_argument("--keep-best", metavar="FIELD:min|max",
                     help="also keep, in --storage, each state's commit whose plain field FIELD is lowest (min) or "
                          "highest (max), such as val_loss:min")
    run.add_argument("--start-timeout", type=float, default=None, metavar="SECONDS",
                     help="how long ranks have to start (default 120, or $SPARKHVD_START_TIMEOUT)")
    run.add_argument("script", help="the Python script every rank runs as __main__")
    run.add_argument("args", nargs=argparse.REMAINDER, help="the script's arguments")
    parser.set_defaults(usage=run)  # errors after parsing show `sparkhvd run`'s usage
    return parser


def main(argv: list[str] | None = None) -> int:
    """The ``sparkhvd`` console script; returns the exit status."""
    parser = _parser()
    ns = parser.parse_args(argv)
    parser = ns.usage
    confs = [_conf(parser, item) for item in ns.conf]
    if ns.np < 0 and (ns.master or ns.remote or confs):
        parser.error(f"--master, --remote and --conf configure the Spark session that --np N>0 runs on; --np {ns.np} "
                     f"runs {-ns.np} process{'es' if ns.np < -1 else ''} on this machine without Spark: drop them, or "
                     f"use --np {-ns.np}.")
    if ns.master and ns.remote:
        parser.error(f"--master {ns.master} and --remote {ns.remote} both say where to run: a Spark Connect server "
                     "has its own master; give one of them.")
    from sparkhvd.runner._horovod_runner import HorovodRunner
    from sparkhvd.runner._payload.script import as_payload
    from sparkhvd.runner._shared.errors import HorovodRunError

    try:
        # The script read and its folder collected (runner/_payload/script_folder.py) here, so that a script or folder
        # that cannot run is bad usage (exit 2), before any session starts.
        main_fn, kwargs = as_payload(ns.script, tuple(ns.args), {})
        runner = HorovodRunner(ns.np, log_dir=ns.log_dir, max_restarts=ns.max_restarts,
                               start_timeout=ns.start_timeout, max_retries=ns.max_retries,
                               retry_on=tuple(_exception_class(name) for name in ns.retry_on),
                               run_id=ns.run_id, storage=ns.storage, keep_commits=ns.keep_commits,
                               keep_best=_keep_best(parser, ns.keep_best), max_preemptions=ns.max_preemptions)
    except ValueError as exc:
        parser.error(str(exc))
    stopping = _StopOnSignal()
    try:
        remote = ns.remote or (None if ns.master or _under_spark_submit() else settings.SPARK_REMOTE.get())
        if ns.np > 0 and remote:
            _remote_session(remote, confs)
        elif ns.np > 0 and (ns.master or confs or _under_spark_submit()):
            _session(ns.master, confs, ns.np)
        runner.run(main_fn, **kwargs)
        if runner.last_result.commits:
            print(kept_lines(runner.last_result.commits, runner.config.storage), flush=True)
        return 0
    except KeyboardInterrupt:
        name = signal.Signals(stopping.signum or signal.SIGINT).name
        print(f"sparkhvd run: stopped by {name}; every rank was stopped.", file=sys.stderr, flush=True)
        return 128 + (stopping.signum or signal.SIGINT)
    except HorovodRunError as exc:
        print(exc, file=sys.stderr, flush=True)
        return EXIT_FAILED
    except (RuntimeError, OSError, ValueError) as exc:  # np above the cluster's slots, no Java, a bad --conf value
        print(f"sparkhvd run: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        return EXIT_FAILED
    finally:
        stopping.restore()
        _stop_spark()


class _StopOnSignal:
    """SIGTERM does what Ctrl-C does: KeyboardInterrupt in the main thread, which HorovodRunner answers by
    stopping every rank and cancelling the Spark job. Signals after the first are ignored, so the clean-up
    they started is not cut short."""

    def __init__(self):
        self.signum: int | None = None
        self._previous = {s: signal.signal(s, self._handle) for s in (signal.SIGINT, signal.SIGTERM)}

    def _handle(self, signum, _frame):
        if self.signum is None:
            self.signum = signum
            raise KeyboardInterrupt

    def restore(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)


def _conf(parser: argparse.ArgumentParser, item: str) -> tuple[str, str]:
    key, sep, value = item.partition("=")
    if not sep or not key.strip():
        parser.error(f"--conf {item!r} is not KEY=VALUE; write e.g. --conf spark.executor.memory=4g.")
    return key.strip(), value


def _keep_best(parser: argparse.ArgumentParser, item: str | None) -> tuple | None:
    if item is None:
        return None
    field, sep, how = item.rpartition(":")
    if not sep or not field:
        parser.error(f"--keep-best {item!r} is not FIELD:min or FIELD:max; write e.g. --keep-best val_loss:min.")
    return field, how


def kept_lines(commits: list, storage: str) -> str:
    """What a run left in its storage (``RunResult.commits``), one line per commit, newest of each state first."""
    lines = [f"sparkhvd run: the run left {len(commits)} commit{'s' if len(commits) != 1 else ''} in {storage}:"]
    for meta in commits:
        fields = " ".join(f"{k}={v}" for k, v in (meta.get("fields") or {}).items()) or "no plain fields"
        lines.append(f"  {meta['key']} commit {meta['seq']} ({fields}): {meta.get('path', '')}")
    return "\n".join(lines)


def _exception_class(name: str) -> type:
    """``--retry-on``'s class: a builtin's name (``OSError``) or ``module.Class``."""
    module, _, attr = name.rpartition(".")
    try:
        found = getattr(importlib.import_module(module or "builtins"), attr)
    except (ImportError, AttributeError, ValueError):
        found = None
    if not (isinstance(found, type) and issubclass(found, Exception)):
        raise ValueError(f"--retry-on {name} names no exception class; give a builtin's name (OSError, TimeoutError) or "
                         "module.Class of one the driver can import.")
    return found


def _under_spark_submit() -> bool:
    """Started by spark-submit, whose JVM (and its --master, --conf) is already up."""
    return settings.PYSPARK_GATEWAY_PORT.raw() is not None


def _session(master: str | None, confs: list, np: int) -> None:
    """Start the SparkSession that HorovodRunner then finds active (runner/_backends/spark.py: spark_context)."""
    from pyspark.sql import SparkSession

    builder = SparkSession.builder
    if not _under_spark_submit():
        from sparkhvd.runner._backends.java import check_java

        check_java()
        os.environ.setdefault(settings.PYSPARK_PYTHON.name, sys.executable)  # executors run this interpreter
        builder = builder.appName("sparkhvd").master(master or f"local[{max(np, 2)}]")
    elif master:
        builder = builder.master(master)
    for key, value in confs:
        builder = builder.config(key, value)
    builder.getOrCreate()


def _remote_session(url: str, confs: list) -> None:
    """Open the Spark Connect session that HorovodRunner then finds (runner/_backends/connect.py: remote_session)."""
    from pyspark.sql import SparkSession

    builder = SparkSession.builder.remote(url)
    for key, value in confs:
        builder = builder.config(key, value)
    builder.getOrCreate()


def _stop_spark() -> None:
    if "pyspark" not in sys.modules:
        return
    if settings.SPARK_CONNECT_MODE_ENABLED.raw() is not None:
        from pyspark.sql.connect.session import SparkSession as RemoteSession

        from sparkhvd.runner._backends.connect import reachable

        session = RemoteSession.getActiveSession()
        if session is not None and reachable(session, timeout=2.0):
            session.stop()  # the client's channel; the server and its cluster stay
        elif session is not None:  # stop(), and pyspark's own clean-up at exit, retry an unreachable server for minutes
            session.client.close()
    from pyspark import SparkContext

    sc = SparkContext._active_spark_context
    if sc is not None:
        try:
            sc.stop()
        except Exception:  # noqa: BLE001 - a JVM already gone: nothing left to stop
            pass


if __name__ == "__main__":
    sys.exit(main())
