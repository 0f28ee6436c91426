"""No line lost: a run returns (or fails) only after every rank's output has reached the driver and its log files,
however loaded the machine; a pipe held open by a process outside the rank's group does not hold the run."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest
from _load import cpu_hogs

from sparkhvd import HorovodRunError, HorovodRunner
from sparkhvd._common.settings import LOG_ROOT
from sparkhvd.runner._agent.agent import drain

LINES = 10_000
HOGS = 4


@pytest.fixture
def root(tmp_path, monkeypatch):
    monkeypatch.setenv(LOG_ROOT.name, str(tmp_path / "logs"))
    return tmp_path


@pytest.fixture
def busy():
    """Four CPU-bound processes beside the run, on a 2-core machine."""
    with cpu_hogs(HOGS):
        yield


def _chatty(n, fail=False):
    for i in range(n):
        print(f"line {i}")
    sys.stderr.write("the last line\n")
    if fail:
        raise ValueError("after the lines")
    return n


def _logged(path) -> list:
    with open(path) as f:
        return f.read().splitlines()


def test_every_line_printed_just_before_returning_is_logged_and_shown_under_load(root, busy, capsys):
    for _ in range(2):
        result = HorovodRunner(np=-2).run_all(_chatty, n=LINES)
        shown = capsys.readouterr().out.splitlines()
        for rank in range(2):
            logged = _logged(result.log_paths[rank])
            assert [line for line in logged if line.startswith("line ")] == [f"line {i}" for i in range(LINES)]
            assert "the last line" in logged
            assert sum(line.startswith(f"[{rank}] line ") for line in shown) == LINES


def test_every_line_printed_just_before_failing_is_logged_under_load(root, busy):
    with pytest.raises(HorovodRunError, match="after the lines") as info:
        HorovodRunner(np=-2).run(_chatty, n=LINES, fail=True)
    for rank in range(2):
        logged = _logged(os.path.join(info.value.log_dir, f"rank-{rank}.log"))
        assert [line for line in logged if line.startswith("line ")] == [f"line {i}" for i in range(LINES)]
        assert "the last line" in logged


def _pump(read_fd: int, got: list, delay: float) -> None:
    """A pump that is behind: it reads a chunk, then falls asleep, as a starved thread would."""
    with os.fdopen(read_fd, "rb") as pipe:
        while data := pipe.read1(4096):
            got.append(data)
            time.sleep(delay)


def test_a_pump_that_is_behind_is_waited_for_past_the_quiet_limit():
    r, w = os.pipe()
    os.write(w, b"x" * 60_000)
    os.close(w)
    got = []
    pump = threading.Thread(target=_pump, args=(r, got, 0.05), daemon=True)
    watched = os.dup(r)
    pump.start()
    started = time.monotonic()
    try:
        assert drain(pump, watched, quiet_s=0.2)
    finally:
        os.close(watched)
    assert sum(map(len, got)) == 60_000
    assert time.monotonic() - started > 0.2  # 15 chunks, 0.05 s apart: longer than the quiet limit


def test_a_pipe_held_open_outside_the_ranks_group_is_given_up_once_quiet():
    r, w = os.pipe()
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], pass_fds=(w,),
                              start_new_session=True)  # as a daemon the rank started in a session of its own
    os.close(w)
    got = []
    pump = threading.Thread(target=_pump, args=(r, got, 0.0), daemon=True)
    watched = os.dup(r)
    pump.start()
    try:
        started = time.monotonic()
        assert not drain(pump, watched, quiet_s=0.3)
        assert 0.3 <= time.monotonic() - started < 30
        assert pump.is_alive()  # it goes on forwarding what the holder writes later
    finally:
        holder.kill()
        holder.wait()
        pump.join(10)
        os.close(watched)
    assert not pump.is_alive()
