"""Benchmark (not a test): a rank's output through sparkhvd against a bare subprocess pipe.

Three workloads, each run ``--reps`` times, ours and the peer interleaved (the order reversed
every other round) so that the noise of a shared machine hits both alike:

- lines:    the rank prints ``--lines`` (default 200,000) short lines;
- bar:      the rank writes ``--updates`` (default 100,000) ``\\r``-rewritten progress states, then a newline;
- long:     the rank prints 100 lines of 1 MB (each reaches the driver in 16 pieces of 64 KB).

ours: ``HorovodRunner(np=-1).run(fn)`` (every line printed on the driver as ``[0] line``, to
/dev/null here, and written to the rank's log file). peer: the same loop in ``python -c`` under
``subprocess.Popen(stdout=PIPE)`` with ``PYTHONUNBUFFERED=1`` (as the ranks run), the parent
reading the pipe and writing what it reads to /dev/null. Each side's time is minus the median
of its own run of an empty body (start-up, not output). Prints median seconds and the ratio
ours/peer on the medians.

    python bench/logs.py
    python bench/logs.py --lines 50000 --reps 5
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

BODIES = {
    "lines": "for i in range({n}):\n    print(f'line {{i}} of the benchmark')",
    "bar": "import sys\nfor i in range({n}):\n    sys.stdout.write(f'\\r{{i}}/{n} |####      |')\nprint()",
    "long": "for i in range({n}):\n    print('x' * (1 << 20))",
}


def _rank(body: str) -> None:
    exec(compile(body, "<bench>", "exec"), {})


def ours(runner, body: str) -> float:
    started = time.perf_counter()
    runner.run(_rank, body=body)
    return time.perf_counter() - started


def peer(body: str) -> float:
    started = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-c", body], stdout=subprocess.PIPE,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    with open(os.devnull, "wb") as sink:
        while data := os.read(proc.stdout.fileno(), 1 << 16):
            sink.write(data)
    proc.wait()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, default=200_000)
    parser.add_argument("--updates", type=int, default=100_000)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()

    from sparkhvd import HorovodRunner

    counts = {"lines": args.lines, "bar": args.updates, "long": 100}
    with tempfile.TemporaryDirectory(prefix="sparkhvd-bench-logs-") as root:
        os.environ["SPARKHVD_LOG_ROOT"] = root  # the runs' log folders go with it
        runner = HorovodRunner(np=-1)
        real_stdout = sys.stdout
        rows = []
        with open(os.devnull, "w") as devnull:
            with contextlib.redirect_stdout(devnull):
                empty = statistics.median(ours(runner, "pass") for _ in range(args.reps))
            bare_empty = statistics.median(peer("pass") for _ in range(args.reps))
            for name, template in BODIES.items():
                body = template.format(n=counts[name])
                times = {"ours": [], "peer": []}
                for rep in range(args.reps):
                    for side in (("ours", "peer") if rep % 2 == 0 else ("peer", "ours")):
                        if side == "ours":
                            with contextlib.redirect_stdout(devnull):
                                times["ours"].append(ours(runner, body) - empty)
                        else:
                            times["peer"].append(peer(body) - bare_empty)
                rows.append((name, counts[name], statistics.median(times["ours"]), statistics.median(times["peer"])))
        sys.stdout = real_stdout

    print(f"{'workload':<8} {'count':>9} {'ours s':>8} {'pipe s':>8} {'ours/pipe':>10}")
    for name, count, mine, bare in rows:
        print(f"{name:<8} {count:>9,} {mine:>8.3f} {bare:>8.3f} {mine / bare:>10.2f}")
    print(f"each side: run time minus its empty run's (ours {empty:.3f} s, pipe {bare_empty:.3f} s); medians of "
          f"{args.reps} reps")
    print(f"machine: {os.cpu_count()} CPUs ({platform.machine()}, Linux {platform.release()}); "
          f"python {platform.python_version()}")


if __name__ == "__main__":
    main()
