"""Runs that outlive their driver (``HorovodRunner(run_id=, storage=)``): a driver process SIGKILLed mid-run, then a
new driver with the same run_id resumes from the storage's newest complete commit and ends with the uninterrupted
run's weights, bit for bit; a run that ends well removes its commits, or keeps the newest keep_commits; a second
driver of a running run_id is refused with a sentence."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from sparkhvd import HorovodRunner
from sparkhvd._common.settings import LOG_ROOT
from sparkhvd.runner import RunIdInUse

DRIVER = textwrap.dedent("""
    import json, os, sys, time
    from sparkhvd import HorovodRunner

    def train(marks, stop_at, tag):
        import torch
        import sparkhvd.collective.torch as hvd
        from sparkhvd._common import commits

        hvd.init()
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 1)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                       named_parameters=model.named_parameters())
        state = hvd.elastic.TorchState(model=model, optimizer=opt, step=0)

        @hvd.elastic.run
        def loop(state):
            while state.step < 12:
                if state.step == stop_at and hvd.rank() == 0:
                    commits.flush(60)  # the commit of step stop_at has reached the driver and its manifest
                    open(os.path.join(marks, "stopped"), "w").close()
                    time.sleep(600)  # until the test kills this driver
                if hvd.rank() == 0:
                    with open(os.path.join(marks, f"steps-{tag}"), "a") as f:
                        f.write(f"{state.step}\\n")
                g = torch.Generator().manual_seed(100 * state.step + hvd.rank())
                x = torch.randn(8, 4, generator=g)
                opt.zero_grad()
                torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True)).backward()
                opt.step()
                state.step += 1
                state.commit()
            return [p.tolist() for p in model.parameters()]

        return loop(state)

    marks, stop_at, run_id, storage = sys.argv[1], int(sys.argv[2]), sys.argv[3] or None, sys.argv[4] or None
    runner = HorovodRunner(np=-2, run_id=run_id, storage=storage, keep_commits=int(sys.argv[5]))
    weights = runner.run(train, marks=marks, stop_at=stop_at, tag=run_id or "none")
    print("WEIGHTS " + json.dumps(weights), flush=True)
    print("KEPT " + json.dumps([[c["key"], c["seq"]] for c in runner.last_result.commits]), flush=True)
""")


@pytest.fixture
def driver(tmp_path):
    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    env = {**os.environ, LOG_ROOT.name: str(tmp_path / "logs")}

    def start(stop_at=-1, run_id="", storage="", keep=0):
        return subprocess.Popen([sys.executable, str(script), str(tmp_path), str(stop_at), run_id, storage, str(keep)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    return start


def _ended(proc, timeout=180):
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err[-3000:]
    return out


def _weights(out: str):
    return json.loads(out.split("WEIGHTS ", 1)[1].splitlines()[0])


def test_a_new_driver_resumes_a_run_whose_driver_was_killed_and_ends_with_the_uninterrupted_weights(
        driver, tmp_path, rank_processes):
    uninterrupted = _weights(_ended(driver()))
    storage = str(tmp_path / "storage")
    first = driver(stop_at=5, run_id="r1", storage=storage)
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "stopped").exists():
            assert first.poll() is None and time.monotonic() < deadline, first.communicate()[1][-3000:]
            time.sleep(0.1)
    finally:
        first.send_signal(signal.SIGKILL)  # the driver dies: a notebook kernel restarted, a job's driver lost
        first.communicate()
    manifest = json.loads((tmp_path / "storage" / "r1" / "manifest.json").read_text())
    [(key, [newest])] = manifest["commits"].items()
    assert newest["fields"] == {"step": 5} and os.path.exists(newest["path"])
    (tmp_path / "stopped").unlink()
    out = _ended(driver(stop_at=-1, run_id="r1", storage=storage))  # the lease's driver is gone: taken over
    assert _weights(out) == uninterrupted  # bit for bit: JSON of the float32 values
    # the first driver trained steps 0-4 and stopped at 5; the second trained 5-11 only
    assert (tmp_path / "steps-r1").read_text().split() == [str(s) for s in range(12)]
    assert (f"[sparkhvd] run r1: resuming the run an earlier driver left in {storage}/r1, from its newest complete "
            "commit (step=5; commit 5 of 1 state).") in out
    assert not os.path.exists(tmp_path / "storage" / "r1")  # it ended well: its commits are removed
    deadline = time.monotonic() + 30
    while rank_processes() and time.monotonic() < deadline:  # the killed driver's ranks leave once it is gone
        time.sleep(0.2)
    assert not rank_processes()


def test_a_run_that_ends_well_keeps_its_newest_keep_commits(driver, tmp_path):
    storage = str(tmp_path / "storage")
    out = _ended(driver(run_id="r2", storage=storage, keep=2))
    [key] = json.loads((tmp_path / "storage" / "r2" / "manifest.json").read_text())["commits"]
    # the newest two that reached the storage: the last commit is sent before the rank returns; a loaded machine's
    # rank 0 may send a newer commit in place of one still waiting (docs/elastic.md, "A newer commit of a state replaces one ... not yet sent"), so the other is 11 or older
    [(key_a, newest), (key_b, older)] = json.loads(out.split("KEPT ", 1)[1].splitlines()[0])
    assert key_a == key_b == key and newest == 12 and 0 <= older < 12, out
    kept = sorted(name for name in os.listdir(tmp_path / "storage" / "r2") if name.endswith(".pkl"))
    assert len(kept) == 2 and not os.path.exists(tmp_path / "storage" / "r2" / "lease.json")


def test_a_second_driver_of_a_running_run_id_is_refused_and_a_failed_run_keeps_its_folder(tmp_path, monkeypatch):
    monkeypatch.setenv(LOG_ROOT.name, str(tmp_path / "logs"))
    storage = str(tmp_path / "storage")
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import os, sys, time
        from sparkhvd import HorovodRunner

        def hold(marks):
            open(os.path.join(marks, "holding"), "w").close()
            while not os.path.exists(os.path.join(marks, "release")):
                time.sleep(0.05)
            return "held"

        print(HorovodRunner(np=-1, run_id="r3", storage=sys.argv[1]).run(hold, marks=sys.argv[2]), flush=True)
    """), storage, str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, LOG_ROOT.name: str(tmp_path / "logs")})
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "holding").exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
            time.sleep(0.1)
        with pytest.raises(RunIdInUse, match=rf"^run_id='r3' is running under another driver \(pid {proc.pid} on host "
                                             r".+\), whose lease in .+/r3/lease\.json lasts until \d\d:\d\d:\d\d UTC "
                                             r"unless it renews it; wait for that run to end .+ or give this run "
                                             r"another run_id\.$"):
            HorovodRunner(np=-1, run_id="r3", storage=storage).run(_fails)
    finally:
        (tmp_path / "release").touch()
        out, err = proc.communicate(timeout=120)
    assert out.strip().endswith("held"), err[-3000:]
    with pytest.raises(Exception, match="no such state"):  # a failed run keeps its folder for the next driver
        HorovodRunner(np=-1, run_id="r4", storage=storage).run(_fails)
    assert os.path.isdir(tmp_path / "storage" / "r4") and not os.path.exists(tmp_path / "storage" / "r4" / "lease.json")


def _fails():
    raise KeyError("no such state")


@pytest.mark.parametrize("kwargs, text", [
    ({"run_id": "a/b"}, "run_id='a/b' must be 1 to 64 letters, digits, '.', '_' or '-', starting with a letter or digit"),
    ({"storage": "/tmp/x"}, "storage='/tmp/x' keeps a run's commits under its run_id, so that a new driver resumes "
                            "them; pass run_id='...' too."),
    ({"run_id": "r", "storage": "/tmp/x", "commit_dir": "/tmp/y"}, "storage='/tmp/x' and commit_dir='/tmp/y' both say "
                                                                   "where commits go"),
    ({"run_id": "r", "storage": "nosuchscheme://b/x"}, "storage='nosuchscheme://b/x' is not a filesystem pyarrow can "
                                                       "open"),
    ({"keep_commits": 2}, "keep_commits=2 keeps commits in the run's storage, and there is none; pass run_id= and "
                          "storage= (or set SPARKHVD_STORAGE) too."),
    ({"run_id": "r", "storage": "/tmp/x", "keep_commits": -1}, "keep_commits=-1 must be a whole number >= 0"),
    ({"run_id": "r", "storage": "/tmp/x", "keep_best": ("loss", "lowest")}, "keep_best=('loss', 'lowest') must be "
                                                                             "(field, 'min') or (field, 'max')"),
    ({"keep_best": ("loss", "min")}, "keep_best=('loss', 'min') keeps commits in the run's storage, and there is none"),
])
@pytest.mark.unit
def test_bad_storage_settings_are_refused_with_the_fix(kwargs, text):
    import re

    with pytest.raises(ValueError, match=re.escape(text)):
        HorovodRunner(np=-1, **kwargs)


def test_a_run_keeps_its_commits_on_an_s3_storage(driver, s3):
    """storage= on s3:// (moto's S3 server on 127.0.0.1; credentials from the environment, the endpoint in the URL)."""
    import pyarrow.fs as pafs

    out = _ended(driver(run_id="r3", storage=s3.url("runs"), keep=1))
    fs = s3.filesystem()
    folder = f"{s3.bucket}/runs/r3"
    names = sorted(info.base_name for info in fs.get_file_info(pafs.FileSelector(folder)))
    with fs.open_input_stream(f"{folder}/manifest.json") as f:
        [(key, [newest])] = json.loads(f.read())["commits"].items()
    assert newest["fields"] == {"step": 12}, out
    assert newest["path"].startswith(f"s3://{folder}/") and newest["path"].endswith(f"?{s3.url('').split('?')[1]}")
    [kept] = [n for n in names if n.endswith(".pkl")]  # keep=1: the older commits were removed from the bucket
    assert newest["path"].split("?")[0].endswith(f"/{kept}") and "lease.json" not in names
    again = _ended(driver(run_id="r3", storage=s3.url("runs"), keep=1))  # a new driver: loads it from the bucket
    assert "from its newest complete commit (step=12; commit 12 of 1 state)" in again and _weights(again) == _weights(out)
