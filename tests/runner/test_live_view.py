"""The live view (runner/_policy/live.py): the figures of its rows, the notebook's table, the terminal's status line
under the driver's other output, where there is none, and a real run's status line on a real pseudo-terminal.
The notebook's view in a real Jupyter kernel is in tests/test_notebooks.py (the quickstart)."""

from __future__ import annotations

import fcntl
import io
import os
import pty
import re
import struct
import subprocess
import sys
import termios
import textwrap

import pytest

from sparkhvd.runner._policy import live

CLEAR = live.CLEAR


def _status(beats: dict):
    """A RunStatus of placed ranks whose latest heartbeats carry ``beats[rank]`` = (metrics, arrival time)."""
    from sparkhvd._common.topology import Placement
    from sparkhvd.runner._service.service import Registration
    from sparkhvd.runner._service.status import RunStatus

    np = len(beats)
    placements = tuple(Placement(rank=r, size=np, local_rank=0, local_size=1, cross_rank=r, cross_size=np)
                       for r in range(np))
    registrations = {r: Registration(task=r, host=f"host-{r}", pid=1, gpus=[str(r)], peer="10.0.0.1")
                     for r in range(np)}
    return RunStatus(np=np, at=0.0, registrations=registrations, placements=placements,
                     progress={r: ({"metrics": m}, at) for r, (m, at) in beats.items()})


def _metrics(steps: int, clock: float, waits: float = 0.0, data: float = 0.0, gpu=None) -> dict:
    return {"optimizer_steps": steps, "commits": 0, "collectives": steps, "negotiation_s": waits / 2,
            "transfer_s": waits / 2, "data_wait_s": data, "clock_s": clock, "gpu": gpu}


class _Logs:
    def __init__(self, lines: dict):
        self.lines = lines

    def last_line(self, rank: int) -> str:
        return self.lines.get(rank, "")


class _Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _run_seconds(view, clock, seconds: int, gpu=None):
    """``seconds`` polls, one a second: rank 0 makes 10 steps a second with 0.2 s in collectives and 0.1 s waiting
    for data; rank 1 the same steps, 0.5 s in collectives; neither made a step in its first second (start-up)."""
    for second in range(seconds + 1):
        clock.now = 100.0 + second
        steps = 10 * max(0, second - 1)
        busy = max(0, second - 1)
        view.check(_status({0: (_metrics(steps, 50.0 + second, 0.2 * busy, 0.1 * busy, gpu), clock.now),
                            1: (_metrics(steps, 70.0 + second, 0.5 * busy), clock.now)}))


@pytest.mark.unit
def test_each_rows_rates_come_from_its_own_clock_over_its_stepping_heartbeats():
    clock = _Clock()
    drawn = []

    class Recording(live.LiveView):
        def draw(self, rows, ending):
            drawn.append((rows, ending))

    view = Recording("r1", _Logs({0: "epoch 3 loss 0.12"}), clock=clock)
    _run_seconds(view, clock, 6, gpu={"util_pct": 87, "memory_bytes": 3 * 2**30, "temperature_c": 60})
    assert len(drawn) == 7  # once a second
    rows, ending = drawn[-1]
    assert ending is None and [r["rank"] for r in rows] == [0, 1] and [r["host"] for r in rows] == ["host-0", "host-1"]
    first, second = rows
    assert first["steps"] == 50 and first["steps_per_s"] == pytest.approx(10.0)
    assert first["collectives"] == pytest.approx(0.2) and first["data_wait"] == pytest.approx(0.1)
    assert second["collectives"] == pytest.approx(0.5) and second["data_wait"] == pytest.approx(0.0)
    assert first["gpu"]["util_pct"] == 87 and second["gpu"] is None
    assert first["line"] == "epoch 3 loss 0.12" and second["line"] == ""
    for second in range(7, 11):  # the steps end (an evaluation, the function returning): none in the last window
        clock.now = 100.0 + second
        view.check(_status({0: (_metrics(50, 50.0 + second, 1.0, 0.5), clock.now),
                            1: (_metrics(50, 70.0 + second, 2.5), clock.now)}))
    assert drawn[-1][0][0]["steps_per_s"] == 0.0
    view.close(ok=True)
    rows, ending = drawn[-1]  # the last state: the rates of the whole attempt, from the beat before its first step
    assert ending == "finished" and rows[0]["steps_per_s"] == pytest.approx(50 / (60 - 51))


@pytest.mark.unit
def test_a_new_attempt_starts_its_rates_again():
    clock = _Clock()
    view = live.TerminalView("r2", _Logs({}), io.StringIO(), clock=clock)
    assert view.line([]).startswith("[sparkhvd] run r2: 0 ranks starting")
    _run_seconds(view, clock, 4)
    assert view.rates.of(0)["steps_per_s"] == pytest.approx(10.0)
    view.check(_status({0: (_metrics(0, 1.0), clock.now), 1: (_metrics(0, 1.0), clock.now)}), attempt=1)
    assert view.rates.of(0)["steps_per_s"] is None and view.rates.of(0)["steps"] == 0


@pytest.mark.unit
def test_the_notebooks_table_has_a_row_per_rank_in_html_and_in_text():
    clock = _Clock()
    view = live.NotebookView("r3", _Logs({0: "loss <0.5> & falling", 1: "x" * 200}), clock=clock)
    _run_seconds(view, clock, 4, gpu={"util_pct": 87, "memory_bytes": 3 * 2**30})
    rows = view.rows(view._status)
    text = view.text(rows, ending=None)
    title, header, row0, row1 = text.splitlines()
    assert title == "sparkhvd run r3: 2 ranks, running, 4 s"
    assert header.split() == ["rank", "host", "steps", "steps/s", "collectives", "data", "wait", "GPU", "last", "line"]
    assert row0.split()[:8] == ["0", "host-0", "30", "10.0", "20%", "10%", "87%", "3.0"]
    assert row0.endswith("loss <0.5> & falling")
    assert row1.split()[:7] == ["1", "host-1", "30", "10.0", "50%", "0%", "1"]  # no NVML: the GPU's index
    assert row1.endswith("x" * live.LINE_CHARS) and "x" * (live.LINE_CHARS + 1) not in row1
    page = view.html(rows, ending="failed")
    assert "<b>sparkhvd run r3: 2 ranks, failed, 4 s</b>" in page
    assert page.count("<tr>") == 3 and re.search(r"<th [^>]*text-align:right[^>]*>steps/s</th>", page)
    assert "loss &lt;0.5&gt; &amp; falling" in page and "<0.5>" not in page


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.unit
def test_the_status_line_stays_below_every_other_line_and_a_progress_bar_hides_it(monkeypatch):
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stdout", terminal)
    monkeypatch.setattr(sys, "stderr", terminal)
    streams = live.LiveStreams(terminal)
    streams.show("status 1")
    assert isinstance(sys.stdout, live._Stream) and isinstance(sys.stderr, live._Stream)
    print("[0] epoch 1", flush=True)  # cleared, the line, and the status again at the flush
    sys.stderr.write("a warning\n")
    sys.stderr.flush()
    sys.stdout.write("\r[1] 50%|#####     |")  # a rank's bar: the cursor mid-line, no status line over it
    sys.stdout.flush()
    streams.show("status 2")  # not drawn over the bar
    sys.stdout.write("\r[1] 100%|##########|\n")
    sys.stdout.flush()
    streams.stop()
    assert sys.stdout is terminal and sys.stderr is terminal
    assert terminal.getvalue() == (
        f"{CLEAR}status 1{CLEAR}[0] epoch 1\n{CLEAR}status 1{CLEAR}a warning\n{CLEAR}status 1{CLEAR}"
        f"\r[1] 50%|#####     |\r[1] 100%|##########|\n{CLEAR}status 2{CLEAR}")


@pytest.mark.unit
def test_a_view_only_where_output_is_a_notebook_or_a_terminal_and_not_when_turned_off(monkeypatch):
    monkeypatch.delenv("SPARKHVD_LIVE_VIEW", raising=False)
    logs = _Logs({})
    assert live.live_view("r", "all", logs, out=io.StringIO()) is None  # a file, a pipe: no view
    assert isinstance(live.live_view("r", "all", logs, out=_Terminal()), live.TerminalView)
    assert live.live_view("r", "log_callback_only", logs, out=_Terminal()) is None
    monkeypatch.setenv("SPARKHVD_LIVE_VIEW", "off")
    assert live.live_view("r", "all", logs, out=_Terminal()) is None
    monkeypatch.setenv("SPARKHVD_LIVE_VIEW", "always")
    with pytest.raises(ValueError, match=r"^SPARKHVD_LIVE_VIEW='always' is not auto or off; use auto \(the default: "
                                         r"a live view in a notebook or a terminal\) or off\.$"):
        live.live_view("r", "all", logs, out=_Terminal())


@pytest.mark.unit
@pytest.mark.parametrize("observer, what", [("stragglers", "the straggler check"), ("live", "the live view")])
def test_a_failing_observer_warns_once_and_is_off_for_the_attempt(observer, what):
    from sparkhvd.runner._policy.supervise import Watch

    calls = []

    def broken(*args):
        calls.append(args)
        raise KeyError("placements")

    class Broken:
        check = staticmethod(broken)

    class Launcher:
        def failure(self):
            return None

    class Logs:
        verbosity = "all"

    class Stalls:
        def check(self, service):
            return None

    watch = Watch(None, Launcher(), Logs(), np=2, start_timeout=60, run_id="r7", stalls=Stalls(),
                  **{observer: Broken() if observer == "stragglers" else broken})
    status = _status({0: (_metrics(1, 1.0), 1.0), 1: (_metrics(1, 1.0), 1.0)})
    with pytest.warns(RuntimeWarning, match=rf"^sparkhvd run r7: {what} failed \(KeyError: 'placements'\) and is off "
                                            r"for the rest of this attempt; please report it with the run's logs\.$"):
        watch._observe(status)
    watch._observe(status)
    assert len(calls) == 1 and getattr(watch, observer) is None


_TRAIN = textwrap.dedent("""
    from sparkhvd import HorovodRunner

    def train():
        import time

        import torch

        import sparkhvd.collective.torch as hvd

        hvd.init()
        model = torch.nn.Linear(8, 1)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                       named_parameters=model.named_parameters())
        for step in range(60):
            time.sleep(0.06)
            opt.zero_grad()
            model(torch.randn(4, 8)).sum().backward()
            opt.step()
            if step % 10 == 0 and hvd.rank() == 0:
                print(f"step {step}", flush=True)
        return hvd.rank()

    print("returned", HorovodRunner(np=-2).run(train))
""")


@pytest.mark.timeout(120)
def test_a_run_on_a_terminal_shows_its_status_line_under_the_ranks_lines_and_erases_it_at_the_end(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(_TRAIN)
    primary, secondary = pty.openpty()
    fcntl.ioctl(secondary, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 200, 0, 0))  # 200 columns: a whole line
    env = {**os.environ, "SPARKHVD_LOG_ROOT": str(tmp_path / "logs")}
    for name in ("SPARKHVD_LIVE_VIEW", "COLUMNS", "LINES"):  # the terminal's own size, not a parent's setting
        env.pop(name, None)
    proc = subprocess.Popen([sys.executable, str(script)], stdin=subprocess.DEVNULL, stdout=secondary,
                            stderr=secondary, env=env, cwd=tmp_path)
    os.close(secondary)
    chunks = []
    while True:
        try:
            chunk = os.read(primary, 65536)
        except OSError:  # the child closed the terminal (EIO)
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(primary)
    assert proc.wait(timeout=60) == 0
    out = b"".join(chunks).decode().replace("\r\n", "\n")  # the terminal's newline
    statuses = re.findall(r"\x1b\[K(\[sparkhvd\] run \w+: 2 ranks [^\r\n\x1b]*)", out)
    stepping = [s for s in statuses if re.search(r"2 ranks at step \d+, [\d.]+ steps/s, \d+% in collectives, "
                                                 r"\d+% waiting for data, \d+ s$", s)]
    assert stepping, out
    rate = float(re.search(r"([\d.]+) steps/s", stepping[-1])[1])
    assert 3 < rate < 20, stepping[-1]  # 0.06 s of sleep per step and the allreduce: ~12 a second
    for line in ("[0] step 0", "[0] step 20", "[0] step 50"):  # each on a line of its own, the status line erased
        assert f"{CLEAR}{line}\n" in out, out
    assert out.rstrip("\n").endswith(f"{CLEAR}returned 0"), out[-300:]
