"""HorovodRunner with np<0: real rank processes on the driver, the same bootstrap as Spark tasks."""

from __future__ import annotations

import linecache
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from sparkhvd import HorovodRunError, HorovodRunner, log_to_driver
from sparkhvd.runner import StartTimeoutError
from sparkhvd.runner._runner_config import RunnerConfig

SCALE = 10  # a module global the training functions close over


def _whoami(offset=0):
    from sparkhvd._common import context as _context

    p = _context.current().placement
    print(f"rank {p.rank} of {p.size} says hello")
    return {"rank": p.rank, "value": p.rank * SCALE + offset, "pid": os.getpid(),
            "cuda": os.environ.get("CUDA_VISIBLE_DEVICES")}


def test_np_minus_one_runs_one_process_on_the_driver(capsys):
    result = HorovodRunner(np=-1).run_all(_whoami, offset=3)
    assert result.value["value"] == 3
    assert result.value["pid"] != os.getpid()
    assert result.placements[0].size == 1
    out = capsys.readouterr().out
    assert "[0] rank 0 of 1 says hello" in out
    assert "function pickled to" in out
    with open(result.log_paths[0]) as f:
        assert "rank 0 of 1 says hello" in f.read()


def test_np_minus_two_kwargs_closure_and_every_value():
    runner = HorovodRunner(np=-2)
    assert runner.run(_whoami, offset=5)["value"] == 5
    assert runner.last_result.values[1] is None  # run() ships rank 0's value only
    result = runner.run_all(_whoami, offset=5)
    assert runner.last_result is result
    assert [v["value"] for v in result.values] == [5, 15]
    assert [p.rank for p in result.placements] == [0, 1]
    assert [(p.local_rank, p.local_size, p.cross_rank, p.cross_size) for p in result.placements] == [
        (0, 2, 0, 1), (1, 2, 0, 1)]
    assert len(set(v["pid"] for v in result.values)) == 2
    assert sorted(result.log_paths) == [0, 1]


def test_a_notebook_style_closure_runs():
    factor = 7

    def train(x):
        return x * factor

    assert HorovodRunner(np=-1).run(train, x=6) == 42


def test_log_callback_only_keeps_output_off_the_driver(capsys):
    def chatty():
        print("noisy line")
        log_to_driver("wanted line")
        return 1

    result = HorovodRunner(np=-2, driver_log_verbosity="log_callback_only").run_all(chatty)
    out = capsys.readouterr().out
    assert "noisy line" not in out
    assert "[0] wanted line" in out and "[1] wanted line" in out
    with open(result.log_paths[1]) as f:
        text = f.read()
    assert "noisy line" in text and "wanted line" in text


def _fails_on_rank_one():
    from sparkhvd._common import context as _context

    if _context.current().placement.rank == 1:
        raise ValueError("rank one cannot go on")  # the user's source line
    time.sleep(60)


def test_failing_rank_names_rank_type_message_and_source_line(rank_processes):
    started = time.monotonic()
    with pytest.raises(HorovodRunError) as info:
        HorovodRunner(np=-2).run(_fails_on_rank_one)
    text = str(info.value)
    assert "rank 1: ValueError: rank one cannot go on" in text
    assert 'raise ValueError("rank one cannot go on")  # the user\'s source line' in text
    assert "_rank/worker.py" not in text  # our wrapper frames are dropped
    assert isinstance(info.value.__cause__, ValueError)
    assert info.value.failures[0][:3] == (1, "ValueError", "rank one cannot go on")
    assert os.path.exists(os.path.join(info.value.log_dir, "rank-1.log"))
    assert time.monotonic() - started < 50  # rank 0's 60 s sleep was cut short
    assert rank_processes() == []


def test_a_notebook_cells_code_shows_its_lines_on_the_ranks(monkeypatch):
    # What IPython does with a cell: compile it under a file name that exists only in the driver's linecache.
    cell = '/tmp/ipykernel_0/no-such-cell.py'
    source = ("def helper():\n"
              "    return 'helper body'\n"
              "\n"
              "def train():\n"
              "    import inspect\n"
              "    if inspect.getsource(helper) != 'def helper():\\n    return \\'helper body\\'\\n':\n"
              "        raise AssertionError(inspect.getsource(helper))  # what AutoGraph reads, found on the rank\n"
              "    raise ValueError('bad label')  # the cell's line, quoted from the rank\n")
    lines = source.splitlines(keepends=True)
    monkeypatch.setitem(linecache.cache, cell, (len(source), None, lines, cell))
    namespace = {"__name__": "__main__"}
    exec(compile(source, cell, "exec"), namespace)
    assert not os.path.exists(cell)
    with pytest.raises(HorovodRunError) as info:
        HorovodRunner(np=-1).run(namespace["train"])
    text = str(info.value)
    assert "rank 0: ValueError: bad label" in text, text
    assert f'File "{cell}", line 8, in train' in text
    assert "raise ValueError('bad label')  # the cell's line, quoted from the rank" in text


def test_same_failure_on_every_rank_is_grouped():
    def boom():
        raise KeyError("missing column")

    with pytest.raises(HorovodRunError, match=r"ranks 0,1: KeyError: 'missing column'"):
        HorovodRunner(np=-2).run(boom)


def test_a_rank_killed_by_a_signal_is_reported_with_its_last_lines():
    def dies():
        print("about to die")
        os.kill(os.getpid(), signal.SIGKILL)

    with pytest.raises(HorovodRunError, match=r"(?s)rank 0's process was killed by signal 9 before "
                                              r"returning a result; its last output lines:.*about to die"):
        HorovodRunner(np=-1).run(dies)


@pytest.mark.timeout(90)
def test_rank_failing_while_peer_blocks_in_allreduce_does_not_hang(rank_processes):
    def train():
        import torch

        import sparkhvd.collective.torch as hvd

        hvd.init()
        if hvd.rank() == 1:
            raise RuntimeError("rank 1 broke before the allreduce")
        hvd.allreduce(torch.ones(4))  # rank 0 waits here for a peer that never comes
        return "unreachable"

    with pytest.raises(HorovodRunError, match="rank 1: RuntimeError: rank 1 broke before the allreduce"):
        HorovodRunner(np=-2).run(train)
    assert rank_processes() == []


def test_a_rank_that_never_registers_fails_at_start_timeout(rank_processes):
    runner = HorovodRunner._from_config(RunnerConfig(np=-2, start_timeout=1.5, stall_tasks=frozenset({1})))
    with pytest.raises(StartTimeoutError, match=r"1 of 2 ranks \(task 1\) did not register with the driver "
                                                r"on 2 processes on the driver within 1.5 s; raise start_timeout"):
        runner.run(_whoami)
    assert rank_processes() == []


def test_return_value_that_cannot_be_pickled():
    def returns_lock():
        return threading.Lock()

    with pytest.raises(HorovodRunError, match=r"return value \(lock\) cannot be pickled"):
        HorovodRunner(np=-1).run(returns_lock)


def test_function_that_cannot_be_pickled():
    lock = threading.Lock()

    def uses_lock():
        return lock.locked()

    with pytest.raises(TypeError, match="could not pickle 'uses_lock'.*Create unpicklable objects"):
        HorovodRunner(np=-1).run(uses_lock)


BIG = b"x" * (11 * 1024 * 1024)


def test_large_closure_warns_and_names_what_it_captured():
    def uses_big():
        return len(BIG)

    with pytest.warns(UserWarning, match=r"pickle to 11.\d MB.*global BIG \(11.\d MB\)"):
        assert HorovodRunner(np=-1).run(uses_big) == len(BIG)


@pytest.mark.parametrize("np_, message", [
    (0, "np=0 runs nothing"),
    (1.5, "np must be a non-zero integer, got 1.5 \\(float\\)"),
    (True, "np must be a non-zero integer, got True \\(bool\\)"),
    ("2", "np must be a non-zero integer, got '2' \\(str\\)"),
])
def test_bad_np_is_a_clear_value_error(np_, message):
    with pytest.raises(ValueError, match=message):
        HorovodRunner(np=np_)


def test_bad_settings_are_clear_value_errors(monkeypatch):
    with pytest.raises(ValueError, match="driver_log_verbosity='loud' is not one of 'all', 'log_callback_only'"):
        HorovodRunner(np=-1, driver_log_verbosity="loud")
    with pytest.raises(ValueError, match="start_timeout=-1 must be a positive number of seconds"):
        HorovodRunner(np=-1, start_timeout=-1)
    with pytest.raises(TypeError, match="needs a function to run, got int"):
        HorovodRunner(np=-1).run(3)
    monkeypatch.setenv("SPARKHVD_START_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="SPARKHVD_START_TIMEOUT='soon' is not a number of seconds"):
        HorovodRunner(np=-1)


def _driver_with_two_sleeping_ranks(tmp_path, run_line: str):
    """A driver process whose 2 ranks sleep; returns it and the ranks' pids once both run."""
    pids = tmp_path / "pids"
    script = tmp_path / "driver.py"
    script.write_text(textwrap.dedent(f"""
        import os, time
        from sparkhvd import HorovodRunner
        def train():
            with open({str(pids)!r}, "a") as f:
                f.write(f"{{os.getpid()}}\\n")
            time.sleep(120)
    """) + textwrap.dedent(run_line))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    deadline = time.monotonic() + 60
    while not (pids.exists() and len(pids.read_text().split()) == 2) and time.monotonic() < deadline:
        time.sleep(0.1)
    return proc, [int(p) for p in pids.read_text().split()]


def _alive(pids, wait: float = 0.5) -> list:
    import psutil

    deadline = time.monotonic() + wait
    while True:
        alive = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        if not alive or time.monotonic() >= deadline:
            return alive
        time.sleep(0.1)


@pytest.mark.timeout(120)
def test_ctrl_c_on_the_driver_stops_every_rank(tmp_path):
    """SIGINT to a driver process mid-run: KeyboardInterrupt, and the rank processes are gone."""
    proc, rank_pids = _driver_with_two_sleeping_ranks(tmp_path, """
        import signal
        # Ctrl-C reaches a driver in a terminal, where Python handles SIGINT. A suite started in the background
        # (`make test &`, nohup) ignores SIGINT, every process it starts inherits that, and Python keeps it ignored:
        # give the driver a terminal's handler, as the user who presses Ctrl-C has.
        signal.signal(signal.SIGINT, signal.default_int_handler)
        try:
            HorovodRunner(np=-2).run(train)
        except KeyboardInterrupt:
            print("driver got KeyboardInterrupt", flush=True)
            raise
    """)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=60)
    assert "driver got KeyboardInterrupt" in out
    assert proc.returncode != 0
    alive = _alive(rank_pids)
    assert alive == [], f"rank processes left behind: {alive}"


@pytest.mark.timeout(60)
def test_sigterm_on_the_driver_leaves_no_rank_running(tmp_path):
    proc, rank_pids = _driver_with_two_sleeping_ranks(tmp_path, "HorovodRunner(np=-2).run(train)\n")
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=30)
    alive = _alive(rank_pids, wait=10)
    assert alive == [], f"rank processes left behind after SIGTERM: {alive}"


def test_a_module_installed_only_on_the_driver_is_named(tmp_path, monkeypatch):
    site = tmp_path / "site-packages"  # looks installed, so it is pickled by reference
    site.mkdir()
    (site / "driver_only_pkg.py").write_text("def train():\n    return 1\n")
    monkeypatch.syspath_prepend(str(site))
    import driver_only_pkg

    with pytest.raises(HorovodRunError, match="rank 0 cannot import module 'driver_only_pkg', which the "
                                              "training function refers to; install it where the ranks run"):
        HorovodRunner(np=-1).run(driver_only_pkg.train)


def test_what_a_rank_leaves_running_is_stopped_without_delay(tmp_path):
    import psutil

    def train():
        import subprocess

        return subprocess.Popen(["sleep", "77"]).pid  # still running when train returns

    started = time.monotonic()
    with warnings_as_errors():
        pid = HorovodRunner(np=-1).run(train)
    assert time.monotonic() - started < 20  # not the 35 s exit wait
    time.sleep(0.2)
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def warnings_as_errors():
    import warnings

    ctx = warnings.catch_warnings()
    ctx.__enter__()
    warnings.simplefilter("error", RuntimeWarning)

    class _Exit:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            ctx.__exit__(*exc)

    return _Exit()


def test_a_very_long_output_line_reaches_the_log_in_pieces():
    def train():
        print("é" * 300_000)  # 600 kB of UTF-8, 1.8 MB as escaped JSON
        print("after the long line")
        return "ok"

    result = HorovodRunner(np=-1, driver_log_verbosity="log_callback_only").run_all(train)
    assert result.value == "ok"
    with open(result.log_paths[0], encoding="utf-8") as f:
        text = f.read()
    assert text.count("é") == 300_000 and "after the long line" in text


def _threads():
    import os

    import torch

    return os.environ.get("OMP_NUM_THREADS"), torch.get_num_threads()


def test_ranks_on_one_host_share_its_cores_unless_the_user_chose(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    share = str(max(1, len(os.sched_getaffinity(0)) // 2))
    assert HorovodRunner(np=-2).run_all(_threads).values == [(share, int(share))] * 2
    chosen = "2" if share == "1" else "1"  # something else than the share
    monkeypatch.setenv("OMP_NUM_THREADS", chosen)
    assert HorovodRunner(np=-2).run_all(_threads).values == [(chosen, int(chosen))] * 2
