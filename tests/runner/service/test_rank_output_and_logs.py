"""Rank output on the driver: batched lines in order, live progress bars, malformed LOG frames,
and which runs' log folders are kept."""

from __future__ import annotations

import io
import logging
import os
import re
import selectors
import subprocess
import sys
import textwrap
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sparkhvd import HorovodRunError, HorovodRunner
from sparkhvd._common.client import ServiceClient
from sparkhvd._common.protocol import FILE_ONLY, MAX_LINE_BYTES, MAX_PROGRESS_CHARS, Kind, new_secret
from sparkhvd._common.settings import KEEP_FAILED_LOGS, KEEP_LOGS, LOG_ROOT
from sparkhvd.runner._agent.output import PROGRESS_S, _Lines
from sparkhvd.runner._service.logs import (
    FAILED,
    LogRouter,
    end_run_logs,
    log_root,
    run_log_dir,
)
from sparkhvd.runner._service.service import DriverService

LINES = 200_000


@pytest.fixture
def root(tmp_path, monkeypatch):
    """Runs without log_dir= keep their logs here."""
    monkeypatch.setenv(LOG_ROOT.name, str(tmp_path / "logs"))
    monkeypatch.delenv(KEEP_LOGS.name, raising=False)
    monkeypatch.delenv(KEEP_FAILED_LOGS.name, raising=False)
    return tmp_path / "logs"


# ---- many lines ----------------------------------------------------------------------------


def _many_lines(n):
    from sparkhvd._common import context as _context

    rank = _context.current().placement.rank
    for i in range(n if rank == 0 else 3):
        print(f"line {i}")
    return rank


def test_200k_lines_from_a_rank_arrive_in_order_in_the_log_file_and_on_stdout(root, capsys):
    result = HorovodRunner(np=-2).run_all(_many_lines, n=LINES)
    out = capsys.readouterr().out
    expected = [f"line {i}" for i in range(LINES)]
    assert [line[4:] for line in out.splitlines() if line.startswith("[0] ")] == expected
    assert [line[4:] for line in out.splitlines() if line.startswith("[1] ")] == ["line 0", "line 1", "line 2"]
    with open(result.log_paths[0]) as f:
        assert f.read().splitlines() == expected


def test_a_very_long_line_arrives_in_pieces_of_max_line_bytes(root):
    def long_line():
        print("x" * (2 * MAX_LINE_BYTES + 10) + "\nshort")

    result = HorovodRunner(np=-1, driver_log_verbosity="log_callback_only").run_all(long_line)
    with open(result.log_paths[0]) as f:
        assert [len(line) for line in f.read().splitlines()] == [MAX_LINE_BYTES, MAX_LINE_BYTES, 10, 5]


# ---- the rank side: bytes to lines ----------------------------------------------------------


def _terminal(data: bytes) -> list:
    """The reference: each line as a terminal leaves it (the text after its last \\r)."""
    lines = data.split(b"\n")
    if lines[-1] == b"":
        lines.pop()
    return [line.rstrip(b"\r").rsplit(b"\r", 1)[-1].decode("utf-8", errors="replace") for line in lines]


@settings(max_examples=300, deadline=None)
@given(parts=st.lists(st.sampled_from([b"a", b"bc", b"\r", b"\n", b"\r\n", "é".encode(), b"\rstep 9"]), max_size=40),
       cuts=st.lists(st.integers(0, 200), max_size=6))
@pytest.mark.unit
def test_lines_are_what_a_terminal_shows_however_the_bytes_are_chunked(parts, cuts):
    data = b"".join(parts)
    splitter, got = _Lines(), []
    start = 0
    for cut in sorted(cuts) + [len(data)]:
        got += splitter.feed(data[start:max(start, cut)])
        start = max(start, cut)
    got += splitter.end()
    assert got == _terminal(data)


@pytest.mark.unit
def test_a_bar_rewritten_forever_holds_only_its_current_state():
    splitter = _Lines()
    for i in range(10_000):
        assert splitter.feed(f"\rstep {i}".encode()) == []
    assert splitter.progress() == "step 9999"
    assert len(splitter._partial) < 20
    assert splitter.feed(b" done\nnext") == ["step 9999 done"]
    assert splitter.progress() is None  # "next" has not been rewritten: an ordinary unfinished line
    assert splitter.feed(b"x" * (MAX_PROGRESS_CHARS + 10) + b"\r") == []
    assert splitter.progress() == "next" + "x" * (MAX_PROGRESS_CHARS - 4)


# ---- the driver side: one updating line per bar --------------------------------------------


class _Writes(io.StringIO):
    """A stdout that counts its writes."""

    writes = 0

    def write(self, text):
        self.writes += 1
        return super().write(text)


@pytest.mark.unit
def test_a_bar_is_rewritten_in_place_and_logged_once_as_its_final_state(tmp_path):
    out = _Writes()
    router = LogRouter(str(tmp_path), "all", out=out)
    router(0, "stderr", [], "10% |#   |")
    router(0, "stderr", [], "50%")
    router(0, "stderr", ["100% |####|", "after"])
    router(0, "stdout", [f"line {i}" for i in range(1000)])
    router.close()
    text = out.getvalue()
    assert text.startswith("\r[0] 10% |#   |\r[0] 50%       \r[0] 100% |####|\n[0] after\n[0] line 0\n")
    assert out.writes == 4  # one write per batch
    with open(tmp_path / "rank-0.log") as f:
        assert f.read().splitlines()[:3] == ["100% |####|", "after", "line 0"]


@pytest.mark.unit
def test_another_stream_ends_the_bar_line_first_and_close_keeps_an_unfinished_bar(tmp_path):
    out = io.StringIO()
    router = LogRouter(str(tmp_path), "all", out=out)
    router(0, "stderr", [], "3/10")
    router(1, "stdout", ["hello"])
    router(0, "stderr", [], "4/10")
    router.close()
    assert out.getvalue() == "\r[0] 3/10\n[1] hello\n\r[0] 4/10\n"
    with open(tmp_path / "rank-0.log") as f:
        assert f.read() == "4/10\n"
    assert router.tail(0) == ["4/10"]  # for an error message about rank 0


@pytest.mark.unit
def test_log_callback_only_shows_no_bar_but_logs_its_final_state(tmp_path):
    out = io.StringIO()
    router = LogRouter(str(tmp_path), "log_callback_only", out=out)
    router(0, "stderr", [], "3/10")
    router(0, "stderr", ["10/10"])
    router(0, "driver", ["wanted"])
    router.close()
    assert out.getvalue() == "[0] wanted\n"
    with open(tmp_path / "rank-0.log") as f:
        assert f.read() == "10/10\nwanted\n"


@pytest.mark.unit
def test_file_only_lines_reach_the_log_file_and_never_the_screen(tmp_path):
    out = io.StringIO()
    router = LogRouter(str(tmp_path), "all", out=out)
    router(0, "stderr", ["before"], "3/10")
    router(0, FILE_ONLY, ["Traceback (most recent call last):", "ValueError: x"])  # a failed rank's whole traceback
    router(0, "stderr", ["10/10"])
    router.close()
    assert out.getvalue() == "[0] before\n\r[0] 3/10\r[0] 10/10\n"  # the bar was not even interrupted
    with open(tmp_path / "rank-0.log") as f:
        assert f.read() == "before\nTraceback (most recent call last):\nValueError: x\n10/10\n"
    assert router.tail(0) == ["before", "10/10"]  # a dead rank's last output lines are what it printed


# Lines TensorFlow 2.21 printed on this machine, to stderr, on import (twice per process: two libraries) and at
# its first generator dataset.
_TF_NOTICES = [
    "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR",
    "I0000 00:00:1795625291.363495   {pid} port.cc:153] oneDNN custom operations are on. You may see slightly "
    "different numerical results due to floating-point round-off errors from different computation orders. To turn "
    "them off, set the environment variable `TF_ENABLE_ONEDNN_OPTS=0`.",
    "I0000 00:00:1795625291.541772   {pid} cpu_feature_guard.cc:227] This TensorFlow binary is optimized to use "
    "available CPU instructions in performance-critical operations.",
    "To enable the following instructions: AVX2 AVX512F AVX512_VNNI AVX512_BF16 FMA, in other operations, rebuild "
    "TensorFlow with the appropriate compiler flags.",
    "I0000 00:00:1795625075.298793   {pid} generator_dataset_op.cc:213] Memory patch applied: M_TRIM_THRESHOLD=128 "
    "kb was set.",
]


@pytest.mark.unit
def test_start_up_notices_show_once_per_run_and_each_rank_logs_its_own(tmp_path):
    from sparkhvd.runner._service.notices import notice

    out = io.StringIO()
    router = LogRouter(str(tmp_path), "all", out=out)
    for rank in (0, 1):
        lines = [line.format(pid=100 + rank) for line in _TF_NOTICES]
        router(rank, "stderr", lines[:2] + [f"rank {rank} starts"] + lines + lines[:2])
    router(1, "stdout", [_TF_NOTICES[0]])  # on stdout it is no TensorFlow notice
    router.close()
    notices = [line.format(pid=100) for line in _TF_NOTICES]
    assert out.getvalue().splitlines() == [f"[0] {notices[0]}", f"[0] {notices[1]}", "[0] rank 0 starts",
                                           *(f"[0] {line}" for line in notices[2:]), "[1] rank 1 starts",
                                           f"[1] {_TF_NOTICES[0]}"]
    for rank in (0, 1):
        lines = [line.format(pid=100 + rank) for line in _TF_NOTICES]
        with open(tmp_path / f"rank-{rank}.log") as f:
            assert f.read().splitlines()[:2 + 1 + len(lines) + 2] == lines[:2] + [f"rank {rank} starts"] + lines + \
                lines[:2]
    # Precise: the same words in another line, or TensorFlow's own warnings and errors, are not notices.
    assert notice("I0000 00:00:1.5   7 port.cc:153] oneDNN custom operations are on. " + "x" * 10) is None
    assert notice("W0000 00:00:1795625291.541772   12 cpu_feature_guard.cc:227] This TensorFlow binary is "
                  "optimized to use available CPU instructions in performance-critical operations.") is None
    assert notice("ValueError: WARNING: All log messages before absl::InitializeLog() is called are written to "
                  "STDERR") is None


def _imports_tensorflow():
    import tensorflow  # noqa: F401 - the import prints the notices

    return os.getpid(), os.getppid()


def test_tensorflows_start_up_notices_reach_the_screen_once_and_every_ranks_log(root, capsys):
    """A real TensorFlow in each rank (the notices differ by CPU and build: each one a rank logged counts)."""
    pytest.importorskip("tensorflow")
    from sparkhvd.runner._service.notices import notice

    result = HorovodRunner(np=-2).run_all(_imports_tensorflow)
    shown = [line[4:] for line in capsys.readouterr().out.splitlines() if re.match(r"\[[01]\] ", line)]
    logged = {}
    for rank, (pid, parent) in enumerate(result.values):
        with open(result.log_paths[rank]) as f:
            logged[rank] = [line for line in f.read().splitlines() if notice(line)]
        assert "absl_before_init" in {notice(line) for line in logged[rank]}, logged[rank]  # TF 2.16 and later
        # Its own: printed by its import, or by its warm process's (runner/_warm/server.py), which imported TensorFlow
        # before forking it
        assert all(f" {pid} " in line or f" {parent} " in line for line in logged[rank] if line.startswith("I0")), \
            logged[rank]
    kinds = {notice(line) for lines in logged.values() for line in lines}
    assert sorted(notice(line) for line in shown if notice(line)) == sorted(kinds), shown  # each once
    assert sum(map(len, logged.values())) > len(kinds)


_BAR_DRIVER = textwrap.dedent("""
    import os, sys, time
    from sparkhvd import HorovodRunner

    def bar(flag):
        i = 0
        deadline = time.monotonic() + 120
        while i < 200 or not os.path.exists(flag):  # the test makes flag once the driver shows a bar
            i += 1
            sys.stderr.write(f"\\rstep {i}")
            sys.stderr.flush()
            time.sleep(0.002)
            if time.monotonic() > deadline:
                raise TimeoutError("no progress update reached the driver's stdout within 120 s")
        sys.stderr.write(f"\\rstep {i} done\\n")
        return i

    updates = HorovodRunner(np=-1).run(bar, flag=sys.argv[1])
    print(f"UPDATES {updates}", flush=True)
""")


def test_a_bar_shows_live_throttled_on_one_line(root, tmp_path):
    flag = tmp_path / "seen"
    started = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-c", _BAR_DRIVER, str(flag)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    out = b""
    try:
        with selectors.DefaultSelector() as sel:  # the rank waits for flag, so this cannot pass if bars come late
            sel.register(proc.stdout, selectors.EVENT_READ)
            deadline = time.monotonic() + 120
            while b"\r[0] step " not in out and time.monotonic() < deadline and proc.poll() is None:
                if sel.select(1.0):
                    out += os.read(proc.stdout.fileno(), 65536)
        assert b"\r[0] step " in out, f"the driver showed no progress update; its output:\n{out.decode()}"
        flag.touch()
        rest, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
        proc.wait()
    elapsed = time.monotonic() - started
    text = (out + rest).decode()
    assert proc.returncode == 0, err.decode()
    updates = int(text.split("UPDATES ")[1])
    shown = text.count("\r[0] step ")
    assert updates >= 200
    assert shown <= elapsed / PROGRESS_S + 3  # throttled: at most one state per PROGRESS_S (plus the final one)
    rank_lines = [line for line in text.split("\n") if "[0] " in line]
    assert len(rank_lines) == 1 and rank_lines[0].rstrip().endswith(f"[0] step {updates} done")
    log_dir = text.split("logs in ")[1].split()[0]
    with open(os.path.join(log_dir, "rank-0.log")) as f:
        assert f.read() == f"step {updates} done\n"  # the bar's final state, not every update


# ---- malformed LOG frames ------------------------------------------------------------------


@pytest.mark.parametrize("meta, reason", [
    (["a"], r"its meta is a JSON list where an object was expected"),
    ({"rank": 2, "stream": "stdout", "lines": []}, r"its rank 2 is not a rank of this run \(0\.\.1\)"),
    ({"rank": True, "stream": "stdout", "lines": []}, r"its field 'rank' is True \(bool\) where a whole number was"),
    ({"rank": 0, "stream": "tty", "lines": []}, r"its stream 'tty' is not one of 'stdout', 'stderr', 'driver'"),
    ({"rank": 0, "stream": "stdout", "lines": "abc"}, r"its field 'lines' is 'abc' \(str\) where a list of strings was"),
    ({"rank": 0, "stream": "stdout", "lines": ["a", None]}, r"its field 'lines' is \['a', None\] \(list\) where a "
                                                            r"list of strings was expected"),
    ({"rank": 0, "stream": "stdout", "lines": [], "progress": 5}, r"its field 'progress' is 5 \(int\) where a string "
                                                                  r"or null was expected"),
    ({"rank": 0, "lines": []}, r"it lacks its field 'stream'"),
    ({"rank": 0, "stream": "stdout", "lines": [], "colour": "red"}, r"it has the field 'colour', which LOG does not"),
    ({"rank": 0, "stream": "stdout", "lines": [], "progress": "x" * (MAX_PROGRESS_CHARS + 1)},
     rf"its progress is {MAX_PROGRESS_CHARS + 1} characters long, over the {MAX_PROGRESS_CHARS}-character limit"),
])
@pytest.mark.unit
def test_a_malformed_log_frame_is_refused_with_a_clear_error_and_the_connection_goes_on(meta, reason, caplog):
    got = []
    service = DriverService(np=2, secret=new_secret(), payload=b"",
                            on_log=lambda rank, stream, lines, progress: got.append((rank, stream, lines, progress)))
    caplog.set_level(logging.WARNING, logger="sparkhvd.service")
    client = ServiceClient(service.address, service._secret)
    try:
        client.notify(Kind.LOG, meta)
        client.notify(Kind.LOG, {"rank": 1, "stream": "stderr", "lines": ["ok"], "progress": "5%"})
        client.request(Kind.STORE_SET, {"key": "k"}, b"v")  # answered after both frames: nothing stale in between
    finally:
        client.close()
        service.close()
    assert got == [(1, "stderr", ["ok"], "5%")]
    assert service.bad_frames == 1
    messages = [r.getMessage() for r in caplog.records if r.name == "sparkhvd.service"]
    assert len(messages) == 1
    assert messages[0].startswith("sparkhvd driver service: refused a LOG frame from 127.0.0.1")
    assert re.search(reason, messages[0]), messages[0]
    assert "install the same version on the driver and the executors" in messages[0]


# ---- which log folders are kept ------------------------------------------------------------


def _ok():
    print("fine")
    return 1


def _fails():
    raise ValueError("this run fails")


def test_failed_runs_and_the_last_n_successful_are_kept_and_log_dir_is_never_touched(root, tmp_path, monkeypatch):
    monkeypatch.setenv(KEEP_LOGS.name, "2")
    runner = HorovodRunner(np=-1, driver_log_verbosity="log_callback_only")
    first = runner.run_all(_ok).log_dir
    with pytest.raises(HorovodRunError) as failed:
        runner.run(_fails)
    second = runner.run_all(_ok).log_dir
    mine = tmp_path / "mine"
    assert HorovodRunner(np=-1, log_dir=str(mine)).run_all(_ok).log_dir == str(mine)
    assert os.path.exists(first)  # still one of the last 2
    third = runner.run_all(_ok).log_dir
    assert not os.path.exists(first)
    assert all(os.path.exists(os.path.join(d, "rank-0.log")) for d in (second, third, failed.value.log_dir))
    assert sorted(os.listdir(root)) == sorted(os.path.basename(d) for d in (second, third, failed.value.log_dir))
    assert sorted(os.listdir(mine)) == ["rank-0.log"]  # never marked, never removed
    assert os.stat(root).st_mode & 0o777 == 0o700


@pytest.mark.unit
def test_of_the_failed_runs_the_newest_n_folders_are_kept(root, tmp_path, monkeypatch):
    monkeypatch.setenv(KEEP_FAILED_LOGS.name, "2")
    monkeypatch.setenv(KEEP_LOGS.name, "1")
    going = run_log_dir("going")  # a run still going (or whose driver died): no mark, never removed
    mine = tmp_path / "mine"
    run_log_dir("given", str(mine))
    failed = []
    for i in range(4):
        failed.append(run_log_dir(f"failed{i}"))
        removed = end_run_logs(failed[-1], succeeded=False, given=False)
        assert removed == ([failed[i - 2]] if i >= 2 else []), i
        os.utime(os.path.join(failed[-1], FAILED), ns=(i, i))  # in this order, however coarse the clock
    succeeded = run_log_dir("ok")
    assert end_run_logs(succeeded, succeeded=True, given=False) == []
    assert end_run_logs(str(mine), succeeded=False, given=True) == []
    assert sorted(os.listdir(root)) == sorted(os.path.basename(d) for d in (going, succeeded, *failed[2:]))
    assert os.listdir(mine) == []  # never marked, never removed


def test_a_bad_keep_failed_logs_setting_fails_before_the_run_starts(root, monkeypatch):
    monkeypatch.setenv(KEEP_FAILED_LOGS.name, "-1")
    with pytest.raises(ValueError, match=r"SPARKHVD_KEEP_FAILED_LOGS='-1' is not a whole number >= 0; set it to how "
                                         r"many failed runs' log folders to keep \(default 20; 0 keeps none\), or pass "
                                         r"log_dir= to keep a run's logs where you choose\."):
        HorovodRunner(np=-1).run(_ok)
    assert not os.path.exists(root) or os.listdir(root) == []


def test_keep_logs_zero_removes_even_this_runs_folder(root, monkeypatch):
    monkeypatch.setenv(KEEP_LOGS.name, "0")
    assert not os.path.exists(HorovodRunner(np=-1).run_all(_ok).log_dir)


def test_a_bad_keep_logs_setting_fails_before_the_run_starts(root, monkeypatch):
    monkeypatch.setenv(KEEP_LOGS.name, "many")
    with pytest.raises(ValueError, match=r"SPARKHVD_KEEP_LOGS='many' is not a whole number >= 0; set it to how many "
                                         r"successful runs' log folders to keep \(default 5; 0 keeps none\)"):
        HorovodRunner(np=-1).run(_ok)


@pytest.mark.unit
def test_the_default_log_root_must_be_a_folder_of_ones_own(tmp_path, monkeypatch):
    import getpass

    monkeypatch.delenv(LOG_ROOT.name, raising=False)
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    assert log_root() == str(tmp_path / f"sparkhvd-logs-{getpass.getuser()}")
    os.rmdir(log_root())
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    os.symlink(elsewhere, tmp_path / f"sparkhvd-logs-{getpass.getuser()}")
    with pytest.raises(PermissionError, match=r"The sparkhvd log folder .*sparkhvd-logs-.* is a link; remove it, "
                                              r"set SPARKHVD_LOG_ROOT to a folder of your own, or pass log_dir="):
        log_root()


@pytest.mark.unit
@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="needs root to give a folder away")
def test_the_default_log_root_must_not_be_another_users(tmp_path, monkeypatch):
    import getpass

    monkeypatch.delenv(LOG_ROOT.name, raising=False)
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    theirs = tmp_path / f"sparkhvd-logs-{getpass.getuser()}"
    theirs.mkdir()
    os.chown(theirs, 12345, 12345)
    with pytest.raises(PermissionError, match=r"The sparkhvd log folder .* is owned by uid 12345, not by you \(0\); "
                                              r"remove it, set SPARKHVD_LOG_ROOT to a folder of your own"):
        log_root()
