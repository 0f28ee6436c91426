"""Restarts from the last commit (``HorovodRunner(max_restarts=)``): a rank process killed with SIGKILL
mid-training, on a real local Spark session and on the driver, and the run ends with the weights of
a run that was never interrupted, bit for bit. Commits live off the ranks (the driver, a file on the
driver, a ``commit_dir``); a user's exception is never retried; when restarts run out the error
names every failure in order."""

from __future__ import annotations

import glob
import os
import signal
import time

import pytest

from sparkhvd import HorovodRunner
from sparkhvd.runner import HorovodRunError

EPOCHS, BATCHES = 3, 8


def _train(marks: str, kills: tuple = (), commit_every: int = 3, reset_log: bool = False, pause: float = 0.0):
    """A deterministic CPU training loop; ``kills`` holds ``(rank, epoch, batch)`` where that rank's process
    kills itself with SIGKILL, once in the run (a file under ``marks`` remembers it)."""
    import torch

    import sparkhvd.collective.torch as hvd
    from sparkhvd._common import commits as _commits

    hvd.init()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05 * hvd.size(), momentum=0.9),
                                   named_parameters=model.named_parameters())
    state = hvd.elastic.TorchState(model=model, optimizer=opt, epoch=0, batch=0, seen=0)
    resets = []
    state.register_reset_callbacks([lambda: resets.append(hvd.size())])

    @hvd.elastic.run
    def loop(state):
        while state.epoch < EPOCHS:
            while state.batch < BATCHES:
                if any((epoch, batch) == (state.epoch, state.batch) for _, epoch, batch in kills):
                    _commits.flush(60)  # the commit before the kill has reached the driver: it is the one resumed
                    hvd.barrier()
                    for rank, epoch, batch in kills:
                        mark = os.path.join(marks, f"killed-{rank}-{epoch}-{batch}")
                        if (hvd.rank(), state.epoch, state.batch) == (rank, epoch, batch) and not os.path.exists(mark):
                            open(mark, "w").close()
                            os.kill(os.getpid(), signal.SIGKILL)
                with open(os.path.join(marks, f"steps-{hvd.rank()}"), "a") as f:
                    f.write(f"{state.epoch},{state.batch}\n")
                g = torch.Generator().manual_seed(1000 * state.epoch + 10 * state.batch + hvd.rank())
                x = torch.randn(16, 4, generator=g)
                y = x.sum(dim=1, keepdim=True).sin()
                opt.zero_grad()
                torch.nn.functional.mse_loss(model(x), y).backward()
                opt.step()
                time.sleep(pause)
                state.batch += 1
                state.seen += 1
                if state.batch % commit_every == 0:
                    state.commit()
            state.batch = 0
            state.epoch += 1
            state.commit()
        return {k: v.clone() for k, v in model.state_dict().items()}, state.seen

    weights, seen = loop(state)
    return (weights, seen, resets) if reset_log else (weights, seen)


def _same(a: dict, b: dict) -> bool:
    import torch

    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def reference(spark, tmp_path_factory):
    """The uninterrupted run's final weights (np=2) and steps taken."""
    weights, seen = HorovodRunner(np=2).run(_train, marks=str(tmp_path_factory.mktemp("marks")))
    return weights, seen


def test_killing_rank_0_then_rank_1_mid_training_ends_with_the_uninterrupted_weights(spark, tmp_path, reference,
                                                                                      capsys, rank_processes):
    runner = HorovodRunner(np=2, max_restarts=2)
    weights, seen = runner.run(_train, marks=str(tmp_path), kills=((0, 0, 5), (1, 1, 7)))
    assert _same(weights, reference[0])  # bit for bit
    assert seen == reference[1] == EPOCHS * BATCHES  # the counter came back with the commit: no step counted twice
    restarts = runner.last_result.restarts
    assert [(e.attempt, e.attempts, e.np_before, e.np_after) for e in restarts] == [(2, 3, 2, 2), (3, 3, 2, 2)]
    assert "rank 0's process was killed by signal 9" in restarts[0].lost
    assert "rank 1's process was killed by signal 9" in restarts[1].lost
    # commits after 3 and 6 batches and at each epoch's end: (0, 5) resumes from (0, 3); (1, 7) from (1, 6)
    assert restarts[0].commit == {"epoch": 0, "batch": 3, "seen": 3}
    assert restarts[1].commit == {"epoch": 1, "batch": 6, "seen": 14}
    assert all(0 < e.seconds < 60 for e in restarts)
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if "restart" in line and line.startswith("[sparkhvd]")]
    assert len(lines) == 2, out
    assert "restart 1 of 2 after rank 0's process was killed by signal 9" in lines[0]
    assert "from the last commit (epoch=0 batch=3 seen=3)" in lines[0]
    assert "restart 2 of 2 after rank 1's process" in lines[1]
    assert len(glob.glob(os.path.join(tmp_path, "killed-*"))) == 2
    # rank 0 stepped through (0,0)-(0,4) and was killed; resumed at (0,3) through (1,7), where rank 1 was killed
    # after their barrier; resumed at (1,6): 5 + 13 + 10 steps, where starting over would have taken 5 + 16 + 24
    steps = (tmp_path / "steps-0").read_text().split()
    assert len(steps) == 28 and steps[5] == "0,3" and steps[18] == "1,6", " ".join(steps)


def test_a_restart_before_any_commit_starts_from_the_beginning_on_the_driver(tmp_path, reference, capsys):
    runner = HorovodRunner(np=-2, max_restarts=1)
    weights, seen = runner.run(_train, marks=str(tmp_path), kills=((1, 0, 1),))
    assert _same(weights, reference[0])
    assert runner.last_result.restarts[0].commit is None
    assert "from the beginning (no state.commit() had reached the driver)" in capsys.readouterr().out


def test_commits_larger_than_the_memory_setting_go_to_a_file_on_the_driver_and_are_removed(
        tmp_path, reference, monkeypatch):
    monkeypatch.setenv("SPARKHVD_COMMIT_MEMORY_BYTES", "0")
    before = set(glob.glob(os.path.join(os.path.realpath(__import__("tempfile").gettempdir()), "sparkhvd-*-commits-*")))
    runner = HorovodRunner(np=-2, max_restarts=1)
    weights, _ = runner.run(_train, marks=str(tmp_path), kills=((0, 2, 4),))
    assert _same(weights, reference[0])
    assert runner.last_result.restarts[0].commit == {"epoch": 2, "batch": 3, "seen": 19}
    assert (tmp_path / "steps-1").read_text().split()[21] == "2,3"  # after (2,4), past the barrier: resumed at the commit
    after = set(glob.glob(os.path.join(os.path.realpath(__import__("tempfile").gettempdir()), "sparkhvd-*-commits-*")))
    assert after == before  # the spill folder went with the run


def test_commits_in_a_commit_dir_survive_a_restart_and_are_removed_at_the_end(tmp_path, reference):
    commit_dir = tmp_path / "commits"
    runner = HorovodRunner(np=-2, max_restarts=1, commit_dir=f"file://{commit_dir}")
    weights, _ = runner.run(_train, marks=str(tmp_path), kills=((1, 1, 4),))
    assert _same(weights, reference[0])
    assert runner.last_result.restarts[0].commit == {"epoch": 1, "batch": 3, "seen": 11}
    assert not os.path.exists(commit_dir / runner.last_result.run_id)


def test_a_users_exception_is_never_retried(tmp_path):
    def fails(marks):
        open(os.path.join(marks, f"ran-{os.getpid()}"), "w").close()
        import sparkhvd.collective.torch as hvd

        hvd.init()
        if hvd.rank() == 1:
            raise ValueError("bad learning rate -1")
        hvd.allreduce(__import__("torch").ones(1))

    with pytest.raises(HorovodRunError) as info:
        HorovodRunner(np=-2, max_restarts=3).run(fails, marks=str(tmp_path))
    assert "rank 1: ValueError: bad learning rate -1" in str(info.value).splitlines()[0]
    assert not info.value.retryable and len(info.value.attempts) == 1
    assert len(os.listdir(tmp_path)) == 2  # one attempt of two ranks


def _always_killed(marks):
    import sparkhvd.collective.torch as hvd

    hvd.init()
    attempt = len(os.listdir(marks))
    if hvd.rank() == 1:
        open(os.path.join(marks, f"attempt-{attempt}"), "w").close()
        os.kill(os.getpid(), signal.SIGKILL)
    hvd.allreduce(__import__("torch").ones(1))


def test_when_restarts_run_out_the_error_names_every_failure_in_order(tmp_path):
    with pytest.raises(HorovodRunError) as info:
        HorovodRunner(np=-2, max_restarts=1).run(_always_killed, marks=str(tmp_path))
    text = str(info.value)
    assert text.splitlines()[0].endswith(
        "failed: every one of its 2 attempts (max_restarts=1) ended in a failure; in order:"), text
    assert "  1. rank 1's process was killed by signal 9 before returning a result" in text
    assert "  2. rank 1's process was killed by signal 9 before returning a result" in text
    assert "The last failure in full: rank 1's process was killed by signal 9" in text
    assert [e.cause for e in info.value.attempts] == [e.cause for e in info.value.attempts[:1]] * 2


def test_a_users_exception_after_a_restart_names_the_earlier_failure_too(tmp_path):
    def killed_then_fails(marks):
        import sparkhvd.collective.torch as hvd

        hvd.init()
        if hvd.rank() == 0 and not os.path.exists(os.path.join(marks, "killed")):
            open(os.path.join(marks, "killed"), "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
        if hvd.rank() == 0:
            raise KeyError("label")
        hvd.allreduce(__import__("torch").ones(1))

    with pytest.raises(HorovodRunError) as info:
        HorovodRunner(np=-2, max_restarts=2).run(killed_then_fails, marks=str(tmp_path))
    lines = str(info.value).splitlines()
    assert lines[0].endswith("failed: after 1 restart, a failure that no restart can fix; in order:")
    assert lines[1].startswith("  1. rank 0's process was killed by signal 9")
    assert lines[2] == "  2. rank 0: KeyError: 'label'"
    assert isinstance(info.value.__cause__, KeyError)


def _two_states(marks):
    """Two states committed in turn, each with a commit before its ``hvd.elastic.run``; rank 1 is killed once."""
    import sparkhvd.collective.torch as hvd
    from sparkhvd._common import commits as _commits

    hvd.init()
    restarted = os.path.exists(os.path.join(marks, "killed"))
    a = hvd.elastic.TorchState(n=0, pad=bytes(2 << 20))  # slow to send: commits queue up behind it
    b = hvd.elastic.TorchState(n=0)
    a.commit()  # made before run, e.g. after loading a checkpoint; in a restart it must not hide the newest commit
    b.commit()
    hvd.elastic.run(lambda state: None)(b)  # b resumes here, a in the run below

    @hvd.elastic.run
    def loop(a):
        seen = (a.n, b.n)
        while a.n < 30:
            a.n += 1
            a.commit()
            b.n += 1
            b.commit()
        _commits.flush(60)
        hvd.barrier()
        if hvd.rank() == 1 and not restarted:
            open(os.path.join(marks, "killed"), "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
        return seen

    return loop(a)


def test_each_states_newest_commit_is_resumed_even_with_a_commit_before_run(tmp_path):
    runner = HorovodRunner(np=-2, max_restarts=1)
    assert runner.run(_two_states, marks=str(tmp_path)) == (30, 30)  # the restart began where both had ended
    assert len(runner.last_result.restarts) == 1


def test_a_run_grows_to_max_np_at_a_commit_when_spark_has_free_slots(spark, tmp_path, capsys):
    runner = HorovodRunner(np=1, max_np=2)  # local[2]: a slot is free from the start
    weights, seen, resets = runner.run(_train, marks=str(tmp_path), commit_every=1, reset_log=True, pause=0.1)
    assert seen == EPOCHS * BATCHES  # every step counted once, across the two launches
    (event,) = runner.last_result.restarts
    assert (event.lost, event.np_before, event.np_after) == (None, 1, 2)
    assert event.commit["seen"] >= 2  # rank 0 heard of the slot with a commit, and every rank left at the next one
    assert resets == [2]  # the reset callbacks ran in the relaunched ranks, which are 2
    assert len(runner.last_result.hosts) == 2
    steps = (tmp_path / "steps-1").read_text().split()  # rank 1 exists from the growth on: it ran the rest
    assert len(steps) == EPOCHS * BATCHES - event.commit["seen"]
    out = capsys.readouterr().out
    assert "growing from np=1 to np=2 at a commit, as Spark has task slots for more ranks; training resumed" in out
    assert "[0] sparkhvd: rank 0 leaves at this commit" in out


@pytest.mark.parametrize("kwargs, text", [
    ({"max_restarts": -1}, "max_restarts=-1 must be a whole number >= 0"),
    ({"max_restarts": 1.5}, "max_restarts=1.5 must be a whole number >= 0"),
    ({"min_np": 0}, "min_np=0 must be a whole number from 1 to 2 (np=2)"),
    ({"min_np": 3}, "min_np=3 must be a whole number from 1 to 2 (np=2)"),
    ({"max_np": 1}, "max_np=1 must be a whole number >= np=2"),
    ({"np": -2, "max_np": 4}, "max_np=4 grows a Spark run when its cluster has free task slots; np=-2 runs a fixed 2 "
                              "processes on the driver"),
    ({"retry_on": ValueError("x")}, "retry_on=ValueError('x') must be an exception class or a tuple of them"),
    ({"retry_on": (OSError, KeyboardInterrupt)}, "retry_on=(<class 'OSError'>, <class 'KeyboardInterrupt'>) must be an "
                                                 "exception class or a tuple of them"),
    ({"retry_on": OSError, "max_retries": -1}, "max_retries=-1 must be a whole number >= 0: how many times a rank's "
                                               "exception of retry_on relaunches the run"),
    ({"max_retries": 2}, "max_retries=2 retries the exceptions named by retry_on, and retry_on is empty; pass "
                         "retry_on=(OSError, ...) too"),
    ({"max_preemptions": -1}, "max_preemptions=-1 must be a whole number >= 0 or None (no limit): how many times a "
                              "run relaunches its ranks after Spark decommissioned an executor of theirs."),
    ({"commit_dir": "nosuchscheme://bucket/x"}, "commit_dir='nosuchscheme://bucket/x' is not a filesystem pyarrow "
                                                "can open"),
])
def test_bad_restart_settings_are_refused_with_the_fix(kwargs, text):
    with pytest.raises(ValueError, match=text.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        HorovodRunner(**{"np": 2, **kwargs})


def _fit(marks: str, kill_at: tuple | None = None):
    """Keras ``model.fit`` with Horovod's elastic callbacks in Horovod's documented order; ``kill_at``:
    ``(rank, epoch, batch)`` where that rank's process kills itself, once."""
    import keras
    import numpy as np
    import tensorflow as tf

    import sparkhvd.collective.keras as hvd

    tf.config.experimental.enable_op_determinism()
    hvd.init()
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(1)])
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.05, momentum=0.9)), loss="mse")
    model.build((None, 4))
    state = hvd.elastic.KerasState(model, epoch=0, batch=0)
    rng = np.random.default_rng(hvd.rank())
    x = rng.normal(size=(48, 4)).astype("float32")
    y = np.sin(x.sum(axis=1, keepdims=True))

    class Kill(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            mark = os.path.join(marks, "killed")
            if kill_at == (hvd.rank(), state.epoch, batch) and not os.path.exists(mark):
                open(mark, "w").close()
                os.kill(os.getpid(), signal.SIGKILL)

    @hvd.elastic.run
    def train(state):
        model.fit(x, y, batch_size=8, shuffle=False, epochs=EPOCHS - state.epoch, verbose=0,
                  callbacks=[hvd.elastic.CommitStateCallback(state, batches_per_commit=100),
                             hvd.elastic.UpdateBatchStateCallback(state), hvd.elastic.UpdateEpochStateCallback(state),
                             Kill()])
        return [w for w in model.get_weights()], state.epoch

    return train(state)


def test_keras_fit_with_the_elastic_callbacks_resumes_at_the_epoch_after_the_last_commit(tmp_path):
    pytest.importorskip("tensorflow")
    import numpy as np

    reference, epochs = HorovodRunner(np=-2).run(_fit, marks=str(tmp_path / "none"))
    runner = HorovodRunner(np=-2, max_restarts=1)
    weights, resumed_epochs = runner.run(_fit, marks=str(tmp_path), kill_at=(1, 1, 3))
    assert epochs == resumed_epochs == EPOCHS
    assert all(np.array_equal(a, b) for a, b in zip(weights, reference, strict=True))  # bit for bit
    # committed at the end of epoch 0, in Horovod's order of callbacks: the restart runs epochs 1 and 2
    assert runner.last_result.restarts[0].commit == {"epoch": 1, "batch": 0}


def _tape(marks: str, kill_at: tuple | None = None):
    """A TensorFlow loop with ``DistributedGradientTape`` and ``TensorFlowKerasState``, committing every 3 batches."""
    import keras
    import tensorflow as tf

    import sparkhvd.collective.tensorflow as hvd
    from sparkhvd._common import commits as _commits

    tf.config.experimental.enable_op_determinism()
    hvd.init()
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(1)])
    opt = keras.optimizers.SGD(0.05, momentum=0.9)
    opt.build(model.trainable_variables)
    state = hvd.elastic.TensorFlowKerasState(model, opt, epoch=0, batch=0)

    @hvd.elastic.run
    def loop(state):
        while state.epoch < EPOCHS:
            while state.batch < BATCHES:
                if kill_at is not None and kill_at[1:] == (state.epoch, state.batch):
                    _commits.flush(60)
                    hvd.allreduce(tf.constant(0.0))  # a barrier (Horovod's TensorFlow API has none)
                    if kill_at[0] == hvd.rank() and not os.path.exists(os.path.join(marks, "killed")):
                        open(os.path.join(marks, "killed"), "w").close()
                        os.kill(os.getpid(), signal.SIGKILL)
                x = tf.random.stateless_normal((16, 4), seed=(state.epoch * 100 + state.batch, hvd.rank()))
                y = tf.sin(tf.reduce_sum(x, axis=1, keepdims=True))
                with tf.GradientTape() as tape:
                    loss = tf.reduce_mean((model(x) - y) ** 2)
                tape = hvd.DistributedGradientTape(tape)
                grads = tape.gradient(loss, model.trainable_variables)
                opt.apply_gradients(zip(grads, model.trainable_variables))
                state.batch += 1
                if state.batch % 3 == 0:
                    state.commit()
            state.batch = 0
            state.epoch += 1
            state.commit()
        return model.get_weights()

    return loop(state)


def test_a_tensorflow_loop_with_distributed_gradient_tape_resumes_from_its_commit(tmp_path):
    pytest.importorskip("tensorflow")
    import numpy as np

    reference = HorovodRunner(np=-2).run(_tape, marks=str(tmp_path))
    runner = HorovodRunner(np=-2, max_restarts=1)
    weights = runner.run(_tape, marks=str(tmp_path), kill_at=(0, 1, 5))
    assert all(np.array_equal(a, b) for a, b in zip(weights, reference, strict=True))  # bit for bit
    assert runner.last_result.restarts[0].commit == {"epoch": 1, "batch": 3}
