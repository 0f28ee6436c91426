"""Horovod's elastic state (``hvd.elastic``) at np=2, in real rank processes: sync from rank 0,
commit and restore, the elastic sampler, a reset after ``HostsUpdatedInterrupt`` (shutdown and
init again in the same processes), and the Keras callbacks. Inputs come from the rank; the
expected values are exact."""

from __future__ import annotations

import pytest
from _tf_ranks import tf_ranks

from sparkhvd import HorovodRunner


def _torch_state():
    import torch

    import sparkhvd.collective.torch as hvd

    hvd.init()
    r = hvd.rank()
    out = {}
    torch.manual_seed(r)  # different weights on each rank until the state syncs
    model = torch.nn.Linear(2, 1)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=model.named_parameters())
    for p in model.parameters():  # momentum that differs between the ranks until the state syncs
        opt.state[p]["momentum_buffer"] = torch.full_like(p, float(r + 1))
    sampler = hvd.elastic.ElasticSampler(list(range(10)), shuffle=True, seed=3)
    state = hvd.elastic.TorchState(model=model, optimizer=opt, sampler=sampler, epoch=10 + r, batch=r)
    resets, calls = [], []
    state.register_reset_callbacks([lambda: resets.append(hvd.size())])

    def weights():
        return [p.detach().clone().tolist() for p in model.parameters()]

    @hvd.elastic.run
    def loop(state, steps):
        calls.append((state.epoch, state.batch))
        if len(calls) == 1:
            out["synced"] = (weights(), state.epoch, state.batch)
            out["momentum"] = [opt.state[p]["momentum_buffer"].tolist() for p in model.parameters()]
        x = torch.full((4, 2), float(r + 1))
        for _ in range(steps):
            opt.zero_grad()
            model(x).sum().backward()
            opt.step()
            state.batch += 1
        state.sampler.record_batch(0, 2)
        state.commit()
        committed = weights()
        if len(calls) == 1:
            out["committed"] = (committed, state.batch, state.sampler.state_dict())
            opt.zero_grad()
            model(x).sum().backward()
            opt.step()
            state.batch = 99
            state.restore()  # back to the commit: weights, momentum, batch
            out["restored"] = (weights() == committed, state.batch, len(opt.state_dict()["state"]))
            if r == 0:  # rank 0 heard of a new host: every rank resets at the next commit, and syncs
                state.on_hosts_updated(1.0, hvd.elastic.HostUpdateResult.added)
            else:
                state.epoch = 77  # the sync after the reset makes it rank 0's again
            state.commit()
        return committed, state.batch

    out["result"] = loop(state, 3)
    out["calls"], out["resets"] = calls, resets
    out["sampler"] = (state.sampler.state_dict(), list(iter(state.sampler)))
    sampler.set_epoch(1)
    out["sampler_next_epoch"] = sorted(hvd.allgather_object(list(iter(sampler)))[0] +
                                       hvd.allgather_object(list(iter(sampler)))[1])
    last = hvd.elastic.ElasticSampler(list(range(10)), shuffle=False)
    last.load_state_dict({"epoch": 0, "processed_num": 9})  # one sample left for two ranks: both get a batch
    out["last_one"] = list(iter(last))
    try:
        loop("not a state", 1)
    except TypeError as exc:
        out["not_a_state"] = str(exc)
    tries = []

    @hvd.elastic.run
    def failing(state):
        tries.append(1)
        raise ValueError("the user's own bug")

    try:
        failing(state)
    except ValueError as exc:
        out["user_error"] = (str(exc), len(tries))
    return out


@pytest.fixture(scope="module")
def torch_state():
    return HorovodRunner(np=-2).run_all(_torch_state).values


def test_torch_state_syncs_rank_0s_weights_values_and_optimizer_state(torch_state):
    v0, v1 = torch_state
    assert v0["synced"] == v1["synced"] and v0["synced"][1:] == (10, 0)  # rank 0's weights and values
    assert v0["momentum"] == v1["momentum"] == [[[1.0, 1.0]], [1.0]]  # and rank 0's optimizer state
    assert v0["last_one"] == v1["last_one"] == [9]


def test_torch_state_commits_the_same_on_every_rank(torch_state):
    v0, v1 = torch_state
    assert v0["committed"] == v1["committed"] and v0["committed"][1] == 3
    assert v0["committed"][2] == {"epoch": 0, "processed_num": 4}  # 2 samples on each of 2 ranks


def test_torch_state_restores_the_commit(torch_state):
    for v in torch_state:
        assert v["restored"] == (True, 3, 2)  # weights as committed, batch 3, momentum for both parameters


def test_a_hosts_update_resets_and_syncs_the_commit(torch_state):
    v0, v1 = torch_state
    for v in (v0, v1):
        # the loop ran twice: the interrupt at the second commit reset (shutdown, init) and synced the commit
        assert v["calls"] == [(10, 0), (10, 3)] and v["resets"] == [2]
        assert v["result"][1] == 6
    assert v0["result"] == v1["result"]


def test_elastic_run_needs_a_state_first(torch_state):
    for v in torch_state:
        assert v["not_a_state"].startswith("hvd.elastic.run: the wrapped function's first argument must be an "
                                           "hvd.elastic state (TorchState, ObjectState, ...), got str")


def test_a_users_own_exception_is_never_retried(torch_state):
    for v in torch_state:
        assert v["user_error"] == ("the user's own bug", 1)


def test_the_elastic_sampler_recuts_what_is_left_after_a_reset(torch_state):
    v0, v1 = torch_state
    for v in (v0, v1):
        assert v["sampler_next_epoch"] == list(range(10))
    # 8 samples recorded this epoch; the reset re-cut what was left after the 4 committed before it: 6, 3 a rank
    assert v0["sampler"][0] == v1["sampler"][0] == {"epoch": 0, "processed_num": 8}
    assert len(v0["sampler"][1]) == len(v1["sampler"][1]) == 3 and len(set(v0["sampler"][1] + v1["sampler"][1])) == 6


def _tensorflow_state():
    import keras
    import numpy as np
    import tensorflow as tf

    import sparkhvd.collective.keras as khvd
    import sparkhvd.collective.tensorflow as hvd

    hvd.init()
    r = hvd.rank()
    out = {}
    v = 1.0 if r == 0 else 2.0
    variables = [tf.Variable(np.full((2, 2), v)), tf.Variable(np.full(2, v))]
    state = hvd.elastic.TensorFlowState(variables, batch=20 + r, epoch=10 + r)
    state.sync()
    out["synced"] = ([x.numpy().tolist() for x in variables], state.batch, state.epoch)
    for x in variables:
        x.assign(x * 5)
    state.batch = 21
    state.restore()
    out["restored"] = ([x.numpy().tolist() for x in variables], state.batch)
    for x in variables:
        x.assign(x * 3)
    state.batch = 22
    state.commit()
    state.restore()
    out["committed"] = ([x.numpy().tolist() for x in variables], state.batch)

    keras.utils.set_random_seed(r)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(optimizer=khvd.DistributedOptimizer(keras.optimizers.Adam(0.01)), loss="mse")
    state = khvd.elastic.KerasState(model, epoch=0, batch=0)
    commits = []
    original_commit = state.commit
    state.commit = lambda: (commits.append(state.batch), original_commit())

    @khvd.elastic.run
    def fit(state):
        x = np.full((8, 3), float(r), dtype="float32")
        model.fit(x, np.ones((8, 1), dtype="float32"), batch_size=2, epochs=2 - state.epoch, verbose=0,
                  callbacks=[khvd.elastic.UpdateBatchStateCallback(state), khvd.elastic.UpdateEpochStateCallback(state),
                             khvd.elastic.CommitStateCallback(state, batches_per_commit=3)])
        return [w.tolist() for w in model.get_weights()]

    out["keras"] = (fit(state), state.epoch, state.batch, commits)
    iterations = int(model.optimizer.iterations.numpy())
    model.fit(np.ones((8, 3), dtype="float32"), np.zeros((8, 1), dtype="float32"), batch_size=2, verbose=0)
    state.restore()  # back to the commit at the end of the last epoch: weights and Adam's slots and step count
    out["keras_restored"] = ([w.tolist() for w in model.get_weights()] == out["keras"][0],
                             int(model.optimizer.iterations.numpy()) == iterations, iterations)
    try:
        hvd.elastic.TensorFlowState()
    except ValueError as exc:
        out["no_variables"] = str(exc)
    return out


@pytest.fixture(scope="module")
def tensorflow_state(tmp_path_factory):
    return tf_ranks("elastic", tmp_path_factory)[0]  # _tensorflow_state, in the ranks the TF modules share


ONES = [[[1.0, 1.0], [1.0, 1.0]], [1.0, 1.0]]


def test_tensorflow_state_syncs_restores_and_commits(tensorflow_state):
    for v in tensorflow_state:
        assert v["synced"] == (ONES, 20, 10)  # rank 0's
        assert v["restored"] == (ONES, 20)
        assert v["committed"] == ([[[3.0, 3.0], [3.0, 3.0]], [3.0, 3.0]], 22)


def test_the_keras_elastic_callbacks_commit_every_3_batches_and_at_each_epochs_end(tensorflow_state):
    v0, v1 = tensorflow_state
    for v in (v0, v1):
        weights, epoch, batch, commits = v["keras"]
        assert (epoch, batch) == (2, 0)
        # 4 batches an epoch; a commit every 3 batches, counted across epochs (after batch 2 of epoch 0 and batch 1
        # of epoch 1), and at each epoch's end, where state.batch is back to 0
        assert commits == [2, 0, 1, 0]
    assert v0["keras"][0] == v1["keras"][0]  # synced at the start, then averaged gradients


def test_the_keras_state_restores(tensorflow_state):
    for v in tensorflow_state:
        assert v["keras_restored"] == (True, True, 8)


def test_eager_tensorflow_state_needs_its_variables(tensorflow_state):
    for v in tensorflow_state:
        assert v["no_variables"].startswith("hvd.elastic.TensorFlowState(variables=None): eager TensorFlow has no")


def _restore_twice():
    import torch

    import sparkhvd.collective.torch as hvd

    hvd.init()
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def step():
        opt.zero_grad()
        model(torch.ones(3, 2)).sum().backward()
        opt.step()

    step()
    state = hvd.elastic.TorchState(model=model, optimizer=opt)
    committed = [opt.state[p]["momentum_buffer"].clone() for p in model.parameters()]
    state.restore()
    step()  # changes the momentum buffers the restore put in place
    state.restore()
    return all(torch.equal(opt.state[p]["momentum_buffer"], c) for p, c in zip(model.parameters(), committed))


def test_a_second_restore_brings_back_the_commit_not_what_the_steps_after_the_first_did():
    assert HorovodRunner(np=-1).run(_restore_twice) is True
