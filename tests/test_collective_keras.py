"""sparkhvd.collective.keras: model.fit under HorovodRunner(np=2) against single-process Keras."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("tensorflow")

from sparkhvd import HorovodRunner


def _data(rank, rows=32):
    rng = np.random.default_rng(rank)
    x = rng.normal(size=(rows, 3)).astype("float32")
    return x, (x @ np.array([[1.0], [-2.0], [0.5]], dtype="float32") + 0.3).astype("float32")


def _model(seed):
    import keras

    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, activation="tanh"), keras.layers.Dense(1)])
    return model


def _fit():
    import keras

    import sparkhvd.collective.keras as hvd

    hvd.init()
    model = _model(seed=hvd.rank())  # different on each rank: the callback makes them equal
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(learning_rate=0.1))
    model.compile(optimizer=opt, loss="mse")
    x, y = _data(hvd.rank())
    history = model.fit(x, y, batch_size=8, epochs=3, shuffle=False, verbose=0,
                        callbacks=[hvd.BroadcastGlobalVariablesCallback(0), hvd.MetricAverageCallback()])
    errors = []
    try:
        hvd.DistributedOptimizer("sgd")
    except ValueError as exc:
        errors.append(str(exc))
    try:
        hvd.DistributedOptimizer(keras.optimizers.SGD(), backward_passes_per_step=2)
    except NotImplementedError as exc:
        errors.append(str(exc))
    variants = {}
    for key, optimizer_args, compile_args in (("steps_per_execution", {}, {"steps_per_execution": 2}),
                                              ("accumulation", {"gradient_accumulation_steps": 2}, {})):
        m = _model(seed=0)
        m.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1, **optimizer_args)), loss="mse",
                  **compile_args)
        m.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
        variants[key] = [w.tolist() for w in m.get_weights()]
    errors.append(variants)
    import warnings

    xla = {}
    for case in ("callback", "no callback"):
        m = _model(seed=hvd.rank())
        m.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="mse",
                  jit_compile=True)  # XLA works on CPU too
        callbacks = [hvd.BroadcastGlobalVariablesCallback(0)] if case == "callback" else []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                m.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=callbacks)
                outcome = [w.tolist() for w in m.get_weights()]
            except Exception as exc:  # noqa: BLE001 - Keras may wrap it
                outcome = str(exc)
        xla[case] = (outcome, m.jit_compile, [str(w.message) for w in caught if "jit_compile" in str(w.message)])
    return [w.tolist() for w in model.get_weights()], history.history["loss"], errors, xla


def test_model_fit_averages_gradients_like_training_on_the_whole_batch():
    import keras

    (w0, loss0, errors, _), (w1, loss1, _, _) = HorovodRunner(np=-2).run_all(_fit).values
    for a, b in zip(w0, w1):
        np.testing.assert_array_equal(a, b)  # identical on both ranks
    assert loss0 == loss1 and loss0[-1] < loss0[0]  # metrics averaged over the ranks; it learns
    # The same steps in one process: each step's batch is both ranks' batches together.
    (x0, y0), (x1, y1) = _data(0), _data(1)
    x = np.concatenate([np.concatenate([x0[i:i + 8], x1[i:i + 8]]) for i in range(0, 32, 8)])
    y = np.concatenate([np.concatenate([y0[i:i + 8], y1[i:i + 8]]) for i in range(0, 32, 8)])
    model = _model(seed=0)
    model.compile(optimizer=keras.optimizers.SGD(learning_rate=0.1), loss="mse")
    model.fit(x, y, batch_size=16, epochs=3, shuffle=False, verbose=0)
    for got, want in zip(w0, model.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    for key, optimizer_args, compile_args in (("steps_per_execution", {}, {"steps_per_execution": 2}),
                                              ("accumulation", {"gradient_accumulation_steps": 2}, {})):
        model = _model(seed=0)
        model.compile(optimizer=keras.optimizers.SGD(learning_rate=0.1, **optimizer_args), loss="mse",
                      **compile_args)
        model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
        for got, want in zip(errors[2][key], model.get_weights()):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=key)
    assert errors[0] == "DistributedOptimizer wraps a Keras optimizer, got str."
    assert "create the optimizer with gradient_accumulation_steps=2 instead" in errors[1]


def test_xla_is_switched_off_with_a_warning_or_fails_clearly():
    (*_, xla0), (*_, xla1) = HorovodRunner(np=-2).run_all(_fit).values
    (w0, jit0, warned), (w1, _, _) = xla0["callback"], xla1["callback"]
    assert isinstance(w0, list) and w0 == w1  # trained, with the same weights on both ranks
    assert jit0 is False and len(warned) == 1
    assert warned[0].startswith("sparkhvd: this model was compiled with jit_compile=True (XLA;")
    assert "the train step runs without XLA instead" in warned[0]
    outcome, jit, warned = xla0["no callback"]  # nothing sees fit() start: the train step fails clearly
    assert "where sparkhvd's gradient averaging cannot run; pass jit_compile=False to model.compile()" in outcome
    assert jit is True and warned == []


def _callbacks(folder):
    import keras

    import sparkhvd.collective.keras as hvd

    hvd.init()
    r = hvd.rank()
    x, y = _data(r)
    out = {}
    model = _model(seed=0)
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="mse")
    history = model.fit(x, y, batch_size=8, epochs=3, verbose=0,
                        callbacks=[hvd.LearningRateWarmupCallback(initial_lr=0.1, warmup_epochs=2, verbose=1)])
    out["warmup"] = history.history["lr"]
    model = _model(seed=0)
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="mse")
    history = model.fit(x, y, batch_size=8, epochs=3, verbose=0,
                        callbacks=[hvd.LearningRateScheduleCallback(0.1, multiplier=lambda e: 0.5 ** e)])
    out["schedule"] = history.history["lr"]
    model = _model(seed=r)  # different on each rank; the first kernel stays each rank's own
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="mse")
    callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0, local_variables=[model.layers[0].kernel]),
                 hvd.callbacks.MetricAverageCallback(device="")]  # Horovod's spelling, arguments included
    history = model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=callbacks)
    out["local_variables"] = ([w.tolist() for w in model.get_weights()], history.history["loss"])
    path = f"{folder}/best-{r}.keras"  # a path per rank, to see who writes
    model.fit(x, y, batch_size=8, epochs=2, verbose=0, validation_data=(x, y),
              callbacks=[hvd.BestModelCheckpoint(path, monitor="val_loss")])
    import os

    out["written"] = os.path.exists(path)
    hvd.broadcast_object(None)  # wait until rank 0 has written
    loaded = hvd.load_model(f"{folder}/best-0.keras")
    out["rewrapped"] = type(loaded.optimizer).__mro__[1].__name__
    history = loaded.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[hvd.MetricAverageCallback()])
    out["after_load"] = ([w.tolist() for w in loaded.get_weights()], history.history["loss"])
    return out


def test_learning_rate_callbacks_checkpoint_and_load_model(tmp_path, capsys):
    v0, v1 = HorovodRunner(np=-2).run_all(_callbacks, folder=str(tmp_path)).values
    said = [line for line in capsys.readouterr().out.splitlines() if "finished gradual learning rate" in line]
    assert said == ["[0] Epoch 2: finished gradual learning rate warmup to 0.1."]  # Horovod's line, rank 0 only
    # size 2, 4 steps per epoch: lr = 0.1 / 2 * (e * 1 / 2 + 1) with e = 1 and 2 at the epochs' ends
    np.testing.assert_allclose(v0["warmup"], [0.075, 0.1, 0.1], rtol=1e-6)
    np.testing.assert_allclose(v0["schedule"], [0.1, 0.05, 0.025], rtol=1e-6)
    assert (v0["written"], v1["written"]) == (True, False)  # rank 0 only
    assert v0["rewrapped"] == "_DistributedKerasMixin"
    assert v0["after_load"] == v1["after_load"]  # still averaging after load_model
    (w0, loss0), (w1, loss1) = v0["local_variables"], v1["local_variables"]
    assert w0[0] != w1[0] and w0[1:] == w1[1:] and loss0 == loss1  # the local kernel was not broadcast
