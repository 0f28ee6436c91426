"""sparkhvd.collective.keras: model.fit under HorovodRunner(np=2) trains as single-process Keras on both ranks'
batches together (steps_per_execution and gradient accumulation too), XLA is switched off or fails clearly, and
Horovod's callbacks, checkpoint and load_model work. One case per behaviour (tests/_cases.py), one test per case."""

from __future__ import annotations

import numpy as np
import pytest
from _cases import add_to, message_of, run_cases, values
from _installed import needs
from _tf_ranks import tf_ranks

pytestmark = needs("tensorflow")


def _data(rank, rows=32):
    rng = np.random.default_rng(rank)
    x = rng.normal(size=(rows, 3)).astype("float32")
    return x, (x @ np.array([[1.0], [-2.0], [0.5]], dtype="float32") + 0.3).astype("float32")


def _model(seed):
    import keras

    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, activation="tanh"), keras.layers.Dense(1)])
    return model


VARIANTS = (("steps_per_execution", {}, {"steps_per_execution": 2}),
            ("accumulation", {"gradient_accumulation_steps": 2}, {}))

# ---- model.fit ------------------------------------------------------------------------------------------------

FIT: dict = {}
fit = add_to(FIT)


@fit
def fit_from_different_weights(hvd, r):
    import keras

    model = _model(seed=r)  # different on each rank: the callback makes them equal
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(learning_rate=0.1)), loss="mse")
    x, y = _data(r)
    history = model.fit(x, y, batch_size=8, epochs=3, shuffle=False, verbose=0,
                        callbacks=[hvd.BroadcastGlobalVariablesCallback(0), hvd.MetricAverageCallback()])
    return [w.tolist() for w in model.get_weights()], history.history["loss"]


@fit
def wrap_a_string(hvd, r):
    return message_of(lambda: hvd.DistributedOptimizer("sgd"), ValueError)


@fit
def backward_passes_per_step(hvd, r):
    import keras

    return message_of(lambda: hvd.DistributedOptimizer(keras.optimizers.SGD(), backward_passes_per_step=2),
                      NotImplementedError)


def _variant(optimizer_args, compile_args):
    def case(hvd, r):
        import keras

        x, y = _data(r)
        m = _model(seed=0)
        m.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1, **optimizer_args)), loss="mse",
                  **compile_args)
        m.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
        return [w.tolist() for w in m.get_weights()]
    return case


for _key, _optimizer_args, _compile_args in VARIANTS:
    FIT[_key] = _variant(_optimizer_args, _compile_args)


def _xla(with_callback):
    def case(hvd, r):
        import warnings

        import keras

        x, y = _data(r)
        m = _model(seed=r)
        m.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="mse",
                  jit_compile=True)  # XLA works on CPU too
        callbacks = [hvd.BroadcastGlobalVariablesCallback(0)] if with_callback else []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                m.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=callbacks)
                outcome = [w.tolist() for w in m.get_weights()]
            except Exception as exc:  # noqa: BLE001 - Keras may wrap it
                outcome = str(exc)
        return outcome, m.jit_compile, [str(w.message) for w in caught if "jit_compile" in str(w.message)]
    return case


FIT["xla_with_a_callback"] = _xla(True)
FIT["xla_without_a_callback"] = _xla(False)


def _fit():
    import sparkhvd.collective.keras as hvd

    hvd.init()
    return run_cases(FIT, hvd, hvd.rank())


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return tf_ranks("keras_fit", tmp_path_factory)[0]  # _fit, in the ranks the TF modules share


def _whole_batches():
    """Each step's batch is both ranks' batches together."""
    (x0, y0), (x1, y1) = _data(0), _data(1)
    x = np.concatenate([np.concatenate([x0[i:i + 8], x1[i:i + 8]]) for i in range(0, 32, 8)])
    y = np.concatenate([np.concatenate([y0[i:i + 8], y1[i:i + 8]]) for i in range(0, 32, 8)])
    return x, y


def test_model_fit_gives_every_rank_the_same_weights_and_the_averaged_loss(ranks):
    (w0, loss0), (w1, loss1) = values(ranks, "fit_from_different_weights")
    for a, b in zip(w0, w1):
        np.testing.assert_array_equal(a, b)  # identical on both ranks
    assert loss0 == loss1 and loss0[-1] < loss0[0]  # metrics averaged over the ranks; it learns


def test_model_fit_averages_gradients_like_training_on_the_whole_batch(ranks):
    import keras

    model = _model(seed=0)  # the same steps in one process
    model.compile(optimizer=keras.optimizers.SGD(learning_rate=0.1), loss="mse")
    model.fit(*_whole_batches(), batch_size=16, epochs=3, shuffle=False, verbose=0)
    weights, _ = values(ranks, "fit_from_different_weights")[0]
    for got, want in zip(weights, model.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("key, optimizer_args, compile_args", VARIANTS, ids=[v[0] for v in VARIANTS])
def test_steps_per_execution_and_gradient_accumulation_train_as_one_process(ranks, key, optimizer_args,
                                                                            compile_args):
    import keras

    model = _model(seed=0)
    model.compile(optimizer=keras.optimizers.SGD(learning_rate=0.1, **optimizer_args), loss="mse", **compile_args)
    model.fit(*_whole_batches(), batch_size=16, epochs=2, shuffle=False, verbose=0)
    for got, want in zip(values(ranks, key)[0], model.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=key)


def test_distributed_optimizer_wraps_only_a_keras_optimizer(ranks):
    assert values(ranks, "wrap_a_string")[0] == "DistributedOptimizer wraps a Keras optimizer, got str."


def test_backward_passes_per_step_points_to_keras_gradient_accumulation(ranks):
    assert "create the optimizer with gradient_accumulation_steps=2 instead" in \
        values(ranks, "backward_passes_per_step")[0]


def test_xla_is_switched_off_with_a_warning_when_a_callback_sees_fit_start(ranks):
    (w0, jit0, warned), (w1, _, _) = values(ranks, "xla_with_a_callback")
    assert isinstance(w0, list) and w0 == w1  # trained, with the same weights on both ranks
    assert jit0 is False and len(warned) == 1
    assert warned[0].startswith("sparkhvd: this model was compiled with jit_compile=True (XLA;")
    assert "the train step runs without XLA instead" in warned[0]


def test_xla_without_a_callback_fails_clearly(ranks):
    outcome, jit, warned = values(ranks, "xla_without_a_callback")[0]  # nothing sees fit() start
    assert "where sparkhvd's gradient averaging cannot run; pass jit_compile=False to model.compile()" in outcome
    assert jit is True and warned == []


# ---- callbacks, checkpoint and load_model ---------------------------------------------------------------------

CALLBACKS: dict = {}
callback = add_to(CALLBACKS)


def _compiled(hvd, seed):
    import keras

    model = _model(seed=seed)
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="mse")
    return model


@callback
def warmup(hvd, r, folder):
    x, y = _data(r)
    history = _compiled(hvd, 0).fit(x, y, batch_size=8, epochs=3, verbose=0, callbacks=[
        hvd.LearningRateWarmupCallback(initial_lr=0.1, warmup_epochs=2, verbose=1)])
    return history.history["lr"]


@callback
def schedule(hvd, r, folder):
    x, y = _data(r)
    history = _compiled(hvd, 0).fit(x, y, batch_size=8, epochs=3, verbose=0, callbacks=[
        hvd.LearningRateScheduleCallback(0.1, multiplier=lambda e: 0.5 ** e)])
    return history.history["lr"]


@callback
def local_variables_and_checkpoint(hvd, r, folder):
    import os

    x, y = _data(r)
    model = _compiled(hvd, r)  # different on each rank; the first kernel stays each rank's own
    callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0, local_variables=[model.layers[0].kernel]),
                 hvd.callbacks.MetricAverageCallback(device="")]  # Horovod's spelling, arguments included
    history = model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=callbacks)
    out = {"local_variables": ([w.tolist() for w in model.get_weights()], history.history["loss"])}
    path = f"{folder}/best-{r}.keras"  # a path per rank, to see who writes
    model.fit(x, y, batch_size=8, epochs=2, verbose=0, validation_data=(x, y),
              callbacks=[hvd.BestModelCheckpoint(path, monitor="val_loss")])
    out["written"] = os.path.exists(path)
    return out


@callback
def load_model(hvd, r, folder):
    x, y = _data(r)
    hvd.broadcast_object(None)  # wait until rank 0 has written
    loaded = hvd.load_model(f"{folder}/best-0.keras")
    rewrapped = type(loaded.optimizer).__mro__[1].__name__
    history = loaded.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[hvd.MetricAverageCallback()])
    return rewrapped, ([w.tolist() for w in loaded.get_weights()], history.history["loss"])


def _callbacks(folder):
    import sparkhvd.collective.keras as hvd

    hvd.init()
    return run_cases(CALLBACKS, hvd, hvd.rank(), folder)


@pytest.fixture(scope="module")
def callbacks(tmp_path_factory):
    """Each rank's cases, and the lines the ranks printed (_callbacks, in the ranks the TF modules share)."""
    return tf_ranks("keras_callbacks", tmp_path_factory)


def test_learning_rate_warmup_as_horovod_said_by_rank_0_alone(callbacks):
    ranks, printed = callbacks
    said = [line for line in printed if "finished gradual learning rate" in line]
    assert said == ["[0] Epoch 2: finished gradual learning rate warmup to 0.1."]  # Horovod's line, rank 0 only
    # size 2, 4 steps per epoch: lr = 0.1 / 2 * (e * 1 / 2 + 1) with e = 1 and 2 at the epochs' ends
    np.testing.assert_allclose(values(ranks, "warmup")[0], [0.075, 0.1, 0.1], rtol=1e-6)


def test_learning_rate_schedule(callbacks):
    np.testing.assert_allclose(values(callbacks[0], "schedule")[0], [0.1, 0.05, 0.025], rtol=1e-6)


def test_a_local_variable_is_not_broadcast(callbacks):
    (w0, loss0), (w1, loss1) = [v["local_variables"] for v in values(callbacks[0], "local_variables_and_checkpoint")]
    assert w0[0] != w1[0] and w0[1:] == w1[1:] and loss0 == loss1  # the local kernel was not broadcast


def test_best_model_checkpoint_is_written_by_rank_0_alone(callbacks):
    assert [v["written"] for v in values(callbacks[0], "local_variables_and_checkpoint")] == [True, False]


def test_load_model_wraps_the_optimizer_again_and_still_averages(callbacks):
    (rewrapped, after0), (_, after1) = values(callbacks[0], "load_model")
    assert rewrapped == "_DistributedKerasMixin"
    assert after0 == after1  # still averaging after load_model
