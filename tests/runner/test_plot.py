"""``sparkhvd.plot(result)`` (runner/_policy/plot.py): real matplotlib, a real run's metrics (np=-2, heartbeats every
0.3 s), a PNG read back with Pillow."""

from __future__ import annotations

import pytest

import sparkhvd
from sparkhvd import HorovodRunner

pytest.importorskip("matplotlib", reason="the plot extra: pip install 'sparkhvd[plot]'")
Image = pytest.importorskip("PIL.Image")


def _train(steps: int):
    import time

    import torch

    import sparkhvd.collective.torch as hvd

    hvd.init()
    model = torch.nn.Linear(4, 1)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                   named_parameters=model.named_parameters())
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        time.sleep(0.05)
    return hvd.rank()


@pytest.mark.timeout(120)
def test_a_runs_steps_per_second_are_drawn_one_line_per_rank_into_a_png(tmp_path, monkeypatch):
    monkeypatch.setenv("SPARKHVD_HEARTBEAT_SECONDS", "0.3")
    result = HorovodRunner(np=-2, driver_log_verbosity="log_callback_only").run_all(_train, steps=30)
    path = tmp_path / "run.png"
    fig = sparkhvd.plot(result, str(path))
    (ax,) = fig.axes
    assert [line.get_label() for line in ax.get_lines()] == ["rank 0", "rank 1"]
    assert all(len(line.get_xdata()) >= 2 for line in ax.get_lines())  # each rank's rates over the run
    assert ax.get_xlabel() == "seconds since the run started" and ax.get_ylabel() == "steps per second"
    with Image.open(path) as png:
        assert png.format == "PNG" and png.size == (800, 400)
        colors = {color for _, color in png.convert("RGB").getcolors(1 << 20)}
    from matplotlib.colors import to_rgb

    for line in ax.get_lines():  # each rank's line is in the picture, in its colour
        assert tuple(round(c * 255) for c in to_rgb(line.get_color())) in colors, line.get_label()


def test_a_result_without_metrics_is_refused_with_why():
    from sparkhvd.runner._policy.result import RunResult

    empty = RunResult(values=[None], run_id="r1", log_dir="", log_paths={}, placements=[], hosts=[], gpus=[],
                      payload_bytes=0, seconds=0.0)
    with pytest.raises(ValueError) as info:
        sparkhvd.plot(empty)
    assert str(info.value) == ("this RunResult has no metrics to plot (the run sent none: SPARKHVD_METRICS=0, or it "
                               "ended before a heartbeat); RunResult.metrics is empty.")
