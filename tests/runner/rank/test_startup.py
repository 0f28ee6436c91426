"""The rank's one start-up path (runner/_rank/startup.py): what a process left behind (a zygote's handlers, its
thread counts, its NumPy generator, its temp folder) is set as a fresh rank has it; the forked and fresh paths both
run it (tests/runner/warm/ checks a forked rank's threads and environment end to end)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

CHILD = textwrap.dedent("""
    import json, os, signal, sys, tempfile
    import numpy, torch
    from sparkhvd.runner._rank import startup

    def ignore(*_):
        pass

    # what a zygote's own start leaves: other handlers, other thread counts, a used generator, its temp folder
    signal.signal(signal.SIGINT, ignore)
    signal.signal(signal.SIGTERM, ignore)
    signal.signal(signal.SIGCHLD, ignore)
    torch.set_num_threads(2)
    numpy.random.seed(0)
    tempfile.tempdir = "/nonexistent-zygote-tmp"
    before = numpy.random.get_state()[1][:4].tolist()
    startup.prepare({"OMP_NUM_THREADS": "1", "PATH": os.environ.get("PATH", "")})
    print(json.dumps({
        "sigint": signal.getsignal(signal.SIGINT) is signal.default_int_handler,
        "sigterm": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL,
        "sigchld": signal.getsignal(signal.SIGCHLD) == signal.SIG_DFL,
        "threads": torch.get_num_threads(),
        "reseeded": numpy.random.get_state()[1][:4].tolist() != before,
        "tempdir": tempfile.tempdir,
    }))
""")


@pytest.mark.timeout(120)
def test_prepare_sets_a_forked_processes_state_as_a_fresh_ranks():
    done = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=100,
                          env={k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.splitlines()[-1]) == {
        "sigint": True, "sigterm": True, "sigchld": True, "threads": 1, "reseeded": True, "tempdir": None}

