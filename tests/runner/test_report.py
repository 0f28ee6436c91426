"""``sparkhvd.report(metrics, checkpoint=)`` and ``get_checkpoint()``, as Ray Train's: a function that saves its
own checkpoint folder and reports it resumes from it after a rank is killed, and a new driver with the same
run_id from the newest one kept; keep_best keeps the best report by its metric; without a folder the checkpoint
goes through the driver; bad arguments and a changed file are refused with a sentence."""

from __future__ import annotations

import os
import signal

import pytest

import sparkhvd
from sparkhvd import HorovodRunner
from sparkhvd.runner import HorovodRunError

EPOCHS, KILL_AT = 5, 3
LOSSES = [0.9, 0.4, 0.6, 0.5, 0.7]  # epoch 1's is the best


def _train(marks: str, kill_at: int = -1):
    """Ray Train's pattern: resume from get_checkpoint(), save a folder each epoch, report it with the metrics."""
    import json
    import tempfile

    import sparkhvd
    import sparkhvd.collective.torch as hvd

    hvd.init()
    start, seen = 0, []
    checkpoint = sparkhvd.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as folder:
            with open(os.path.join(folder, "state.json")) as f:
                start = json.load(f)["epoch"] + 1
            with open(os.path.join(folder, "seen.json")) as f:
                seen = json.load(f)
        seen.append(f"resumed {checkpoint.metrics}")
    hvd.barrier()  # every rank has read it before rank 0's next report may replace it (docs/elastic.md)
    for epoch in range(start, EPOCHS):
        if epoch == kill_at and os.environ["RANK"] == "0" and not os.path.exists(os.path.join(marks, "killed")):
            open(os.path.join(marks, "killed"), "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
        seen.append(epoch)
        with tempfile.TemporaryDirectory() as folder:
            with open(os.path.join(folder, "state.json"), "w") as f:
                json.dump({"epoch": epoch}, f)
            os.makedirs(os.path.join(folder, "more"))
            with open(os.path.join(folder, "seen.json"), "w") as f:
                json.dump(seen, f)
            sparkhvd.report({"epoch": epoch, "val_loss": LOSSES[epoch]},
                            checkpoint=sparkhvd.Checkpoint.from_directory(folder))
        sparkhvd.report({"epoch": epoch, "lr": 0.1})  # metrics alone: the checkpoint before stays the one resumed
    return seen


@pytest.mark.timeout(240)
def test_a_killed_run_resumes_from_its_reported_checkpoint_and_keep_best_keeps_the_best(tmp_path):
    storage = str(tmp_path / "storage")
    runner = HorovodRunner(np=-2, max_restarts=1, run_id="rep", storage=storage, keep_commits=1,
                           keep_best=("val_loss", "min"))
    seen = runner.run(_train, marks=str(tmp_path), kill_at=KILL_AT)
    assert seen == [0, 1, 2, "resumed {'epoch': 2, 'val_loss': 0.6}", 3, 4]
    kept = [(c["key"], c["fields"]) for c in runner.last_result.commits]
    assert sorted(kept, key=str) == [("report", {"epoch": 1, "val_loss": 0.4}), ("report", {"epoch": 4, "val_loss": 0.7}),
                                     ("report-metrics", {"epoch": 4, "lr": 0.1})]
    folders = sorted(name for name in os.listdir(f"{storage}/rep") if name.endswith(".ckpt"))
    assert len(folders) == 2  # the others were removed with their reports
    newest = next(c for c in runner.last_result.commits if c["fields"]["epoch"] == 4 and "shards" in c)["shards"]
    assert sorted(newest["sha256"]) == ["seen.json", "state.json"]

    # a new driver with the run_id: the newest kept report is the one it resumes from
    again = HorovodRunner(np=-1, run_id="rep", storage=storage, keep_commits=1).run(_train, marks=str(tmp_path))
    assert again == [0, 1, 2, "resumed {'epoch': 2, 'val_loss': 0.6}", 3, 4, "resumed {'epoch': 4, 'val_loss': 0.7}"]

    with open(os.path.join(newest["path"], "state.json"), "a") as f:
        f.write(" ")
    with pytest.raises(HorovodRunError) as caught:
        HorovodRunner(np=-1, run_id="rep", storage=storage).run(_train, marks=str(tmp_path))
    assert f"ValueError: the checkpoint {newest['path']} is not the one rank 0 reported: state.json (" in str(caught.value)
    assert ("do not match the SHA-256 the driver recorded; something else wrote to the run's folder. Give each run a "
            "folder only it writes to (or a new run_id). Nothing was read from it.") in str(caught.value)


@pytest.mark.timeout(240)
def test_without_a_folder_the_checkpoint_goes_through_the_driver_and_a_restart_gets_it_back(tmp_path):
    seen = HorovodRunner(np=-2, max_restarts=1).run(_train, marks=str(tmp_path), kill_at=KILL_AT)
    assert seen == [0, 1, 2, "resumed {'epoch': 2, 'val_loss': 0.6}", 3, 4]


def test_outside_a_run_report_checks_its_arguments_and_get_checkpoint_is_none(tmp_path):
    sparkhvd.report({"loss": 0.5, "step": 3, "note": "ok", "flag": True, "none": None}, checkpoint=str(tmp_path))
    assert sparkhvd.get_checkpoint() is None
    import numpy as np
    import torch

    sparkhvd.report({"loss": torch.tensor(0.5), "n": np.int64(3)})
    with pytest.raises(TypeError) as caught:
        sparkhvd.report({"weights": [1.0, 2.0]})
    assert str(caught.value) == (
        "sparkhvd.report: metric 'weights' is a list; report numbers, strings, booleans or None by name (a tensor of "
        "one value with .item()), and keep other results in the checkpoint's files.")
    with pytest.raises(TypeError, match=r"^sparkhvd.report: metrics must be a dict of plain values by name, such as "
                                        r"\{'val_loss': 0.25\}; got float.$"):
        sparkhvd.report(0.5)
    missing = str(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError) as caught:
        sparkhvd.report({}, checkpoint=missing)
    assert str(caught.value) == (
        f"sparkhvd.report: checkpoint={missing!r} is not a folder on this host; save the checkpoint's files into a "
        "local folder first and pass its path (or Checkpoint.from_directory(path)).")


def test_a_checkpoint_held_by_the_driver_is_written_to_a_folder_on_demand(tmp_path):
    checkpoint = sparkhvd.Checkpoint(None, metrics={"a": 1}, _files={"x.bin": b"1", "sub/y.bin": b"22"})
    with checkpoint.as_directory() as folder:
        assert open(os.path.join(folder, "sub", "y.bin"), "rb").read() == b"22"
    assert not os.path.exists(folder)
    assert sorted(os.listdir(checkpoint.to_directory(tmp_path / "out"))) == ["sub", "x.bin"]
    local = sparkhvd.Checkpoint.from_directory(tmp_path / "out")
    with local.as_directory() as folder:
        assert folder == str(tmp_path / "out")
