"""Opt-in retries of the user's own errors (``HorovodRunner(retry_on=, max_retries=)``), with real ranks on the
driver: a transient OSError relaunches every rank from the last commit and the run ends as the uninterrupted one
would; any other exception still fails at once; the restart line names the exception."""

from __future__ import annotations

import os

import pytest

from sparkhvd import HorovodRunner
from sparkhvd._common.settings import LOG_ROOT
from sparkhvd.runner import HorovodRunError

EPOCHS = 6


@pytest.fixture(autouse=True)
def _logs(tmp_path, monkeypatch):
    monkeypatch.setenv(LOG_ROOT.name, str(tmp_path / "logs"))


class Flaky(OSError):
    """An object store's 503, as a user's own subclass of OSError (defined in the test module, as users do)."""


def _sums(marks: str, fail_with=None, at: int = 3):
    """Sum each epoch's allreduce into the elastic state, committing each epoch; rank 1 raises ``fail_with`` once, at
    epoch ``at`` (a file under ``marks`` remembers it)."""
    import torch

    import sparkhvd.collective.torch as hvd

    hvd.init()
    state = hvd.elastic.TorchState(epoch=0, total=0.0)

    @hvd.elastic.run
    def loop(state):
        while state.epoch < EPOCHS:
            state.total += float(hvd.allreduce(torch.tensor([state.epoch + 1.0 + hvd.rank()]), op=hvd.Sum))
            mark = os.path.join(marks, "failed")
            if fail_with is not None and hvd.rank() == 1 and state.epoch == at and not os.path.exists(mark):
                open(mark, "w").close()
                raise fail_with("503 Service Unavailable")
            state.epoch += 1
            state.commit()
        return state.total

    return loop(state)


def test_a_transient_oserror_is_retried_from_the_last_commit_and_the_run_ends_as_the_uninterrupted_one(tmp_path, capsys):
    uninterrupted = HorovodRunner(np=-2).run(_sums, marks=str(tmp_path))
    runner = HorovodRunner(np=-2, retry_on=(OSError,), max_retries=2)
    assert runner.run(_sums, marks=str(tmp_path), fail_with=Flaky) == uninterrupted
    (event,) = runner.last_result.restarts
    assert (event.kind, event.attempt, event.attempts) == ("retry", 2, 3)
    # rank 0 commits epoch 4 while rank 1 fails; the driver holds that commit or, where rank 0 was stopped before
    # sending it, epoch 3's
    assert event.commit["epoch"] in (3, 4) and event.commit["total"] == sum(2 * e + 3 for e in range(event.commit["epoch"]))
    assert event.what() == "retry 1 of 2 after rank 1: Flaky: 503 Service Unavailable"
    assert f"{event.what()}; training resumed" in capsys.readouterr().out


def test_an_exception_not_in_retry_on_fails_the_run_at_once(tmp_path):
    runner = HorovodRunner(np=-2, retry_on=(OSError,), max_retries=2)
    with pytest.raises(HorovodRunError, match=r"rank 1: KeyError: '503 Service Unavailable'") as info:
        runner.run(_sums, marks=str(tmp_path), fail_with=KeyError, at=1)
    assert len(info.value.attempts) == 1 and info.value.retry_on is None and not info.value.retryable


def _mesh_fails_once():
    """hvd.init(); on the first attempt every rank's process group is refused as gloo refuses a mesh that lost a
    connection (TORCHELASTIC_RESTART_COUNT: the attempt)."""
    import sparkhvd.collective.torch as hvd

    if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
        raise RuntimeError("Gloo connectFullMesh failed with [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/"
                           "pair.cc:553] Connection closed by peer [127.0.0.1]:37553. This is typically caused by a "
                           "remote worker crashing. Check the logs of the remote worker before reporting an error.")
    hvd.init()
    return hvd.size()


def test_a_mesh_gloo_did_not_connect_is_relaunched_without_max_restarts(tmp_path, capsys):
    runner = HorovodRunner(np=-2)  # max_restarts=0
    assert runner.run(_mesh_fails_once) == 2
    (event,) = runner.last_result.restarts
    assert (event.kind, event.attempt, event.attempts) == ("mesh", 2, 3)
    assert ("relaunch 1 of 2 (not one of max_restarts) after gloo did not connect the ranks while they built their "
            "process group: ranks 0,1: RuntimeError: Gloo connectFullMesh failed with") in capsys.readouterr().out
