"""KerasEstimator's training, on every rank (horovod/spark/keras/remote.py's, on sparkhvd): ``model.fit`` on the shards.

Each rank loads the model from the run's newest complete checkpoint (``checkpoint.keras``, with
its optimizer's state, and ``state.json``: the epochs done and the history), or else from
``initial.keras``, wraps its optimizer in ``hvd.DistributedOptimizer`` (in place: the compiled
loss and metrics stay), and runs ``model.fit`` from the next epoch on a ``tf.data`` stream of its
shard (``_keras_stream.py``: every row once per epoch, the same steps on every rank), under
``hvd.elastic.run`` with a ``KerasState``: every rank starts from rank 0's weights, or after a
restart from the last commit. Metrics are averaged over the ranks (MetricAverageCallback); rank 0
writes a checkpoint after every epoch, so a resumed fit goes on from the last finished epoch. With
restarts the state (weights, optimizer, epoch, steps into it, the metrics' sums, the history) is
committed every ``batches_per_commit`` steps and after each epoch: a relaunched fit trains the rest
of the committed epoch alone (Keras runs the same steps every epoch), then the epochs left. The
``.keras`` helpers here are shared with the driver (``_keras.py``), which imports this module,
never the reverse.
"""

from __future__ import annotations

import json
import os
import tempfile
import warnings

import numpy as np

from ._checkpoints import RunDir
from ._keras_stream import Stream
from ._spec import FitSpec

INITIAL = "initial.keras"  # the model as the ranks start it: compiled, its optimizer built
CHECKPOINT = "checkpoint.keras"  # in each checkpoint directory: the model, its optimizer's state
STATE = "state.json"  # beside it: the epochs done and the history
MODEL = "model.keras"  # a saved model's file; a fit writes model-<digest>.keras (RunDir.write_model)
_UNBUILT = "Skipping variable loading for optimizer"  # Keras's warning for a saved optimizer that never stepped


def keras_bytes(model) -> bytes:
    """``model`` as the bytes of a ``.keras`` file (Keras 3 saves to a local path only)."""
    with tempfile.TemporaryDirectory(prefix="sparkhvd-keras-") as folder:
        path = os.path.join(folder, MODEL)
        model.save(path)
        with open(path, "rb") as f:
            return f.read()


def load_keras(data: bytes, custom_objects: dict | None = None, compile: bool = True):
    """The model in ``data``, the bytes of a ``.keras`` file."""
    import keras

    with tempfile.TemporaryDirectory(prefix="sparkhvd-keras-") as folder, warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_UNBUILT)
        path = os.path.join(folder, MODEL)
        with open(path, "wb") as f:
            f.write(data)
        return keras.models.load_model(path, custom_objects=custom_objects or None, compile=compile)


def as_outputs(outputs) -> list:
    if isinstance(outputs, dict):
        return list(outputs.values())
    return list(outputs) if isinstance(outputs, (list, tuple)) else [outputs]


def _load(spec: FitSpec, hvd, custom_objects: dict):
    """The model to train, the epochs done and the history: rank 0's view of the run's newest checkpoint."""
    run = RunDir(spec.store, spec.run_id)
    newest = hvd.broadcast_object(run.newest() if hvd.rank() == 0 else None, 0, name="sparkhvd.ml.keras_newest")
    if newest is None:
        data, epoch, history = spec.store.read(run.file_url(INITIAL)), 0, []
    else:
        data = spec.store.read(f"{newest[1]}/{CHECKPOINT}")
        state = json.loads(spec.store.read(f"{newest[1]}/{STATE}"))
        epoch, history = state["epoch"], state["history"]
    model = load_keras(data, custom_objects)
    if getattr(model, "optimizer", None) is None:
        raise RuntimeError(f"The model loaded from {newest[1] if newest else run.file_url(INITIAL)} is not compiled "
                           "(Keras could not rebuild its optimizer, loss or metrics); pass their custom classes and "
                           "functions as custom_objects= to the estimator.")
    return run, model, epoch, history


def scale_lr(optimizer, factor: float, keras) -> None:
    """Multiply the optimizer's learning rate by ``factor``: horovod.spark trains with the rate times the ranks, and
    here the checkpoints keep it as given (a schedule's rates are left as they are)."""
    if isinstance(getattr(optimizer, "_learning_rate", None), keras.optimizers.schedules.LearningRateSchedule):
        return
    optimizer.learning_rate = float(np.asarray(optimizer.learning_rate)) * factor


def _resumed_metrics(state, model, rank: int, size: int) -> list | None:
    """This rank's committed metric sums, where the commit has them for this many ranks and these metrics."""
    if state.metrics is None or len(state.metrics) != size or len(state.metrics[rank]) != len(model.metrics_variables):
        return None
    return state.metrics[rank]


def _build_metrics(model, stream: Stream) -> None:
    """Build the compiled loss and metrics, which Keras builds at the first step, so that a resumed epoch can put
    their committed sums back before it. A model whose metrics cannot be built on zeros resumes without them: that
    epoch's metrics then cover the steps after the commit (they are history, not training state)."""
    xs = [np.zeros((1, *shape), np.float32) for shape in stream.feature_shapes]
    ys = [np.zeros((1, *shape), np.int64 if c.integer else np.float32)
          for c, shape in zip(stream.data.labels, stream.label_shapes)]
    x, y = (xs[0] if len(xs) == 1 else tuple(xs)), (ys[0] if len(ys) == 1 else tuple(ys))
    try:
        predicted = model(x, training=False)
        model.compute_loss(x, y, predicted)
        model.compute_metrics(x, y, predicted)
    except Exception:  # noqa: BLE001 - see above
        pass


# The fit's callbacks, as mixins: ``_callback_classes`` puts each on keras.callbacks.Callback once Keras is imported
# (in the ranks only); each takes what it needs as arguments.

class _Checkpoint:
    """Each epoch's history entry; on rank 0 the line and the checkpoint. After MetricAverageCallback."""

    def __init__(self, state, run: RunDir, spec: FitSpec, rank: int, size: int, keras):
        super().__init__()
        self.state, self.run, self.spec, self.rank, self.size, self.keras = state, run, spec, rank, size, keras

    def on_epoch_end(self, epoch, logs=None):
        state, spec = self.state, self.spec
        logs = {k: float(np.asarray(v)) for k, v in (logs or {}).items()}
        entry = {"epoch": epoch, "train": {k: v for k, v in logs.items() if not k.startswith("val_")}}
        val = {k[len("val_"):]: v for k, v in logs.items() if k.startswith("val_")}
        if val:
            entry["validation"] = val
        state.history = [*state.history, entry]
        if self.rank != 0:
            return
        if spec.verbose:
            shown = ", ".join(f"{k} {v:.6g}" for k, v in logs.items())
            print(f"epoch {epoch + 1}/{spec.epochs}: {shown}", flush=True)
        if spec.checkpoints(epoch + 1):
            self._write(epoch + 1)

    def on_train_end(self, logs=None):
        """A callback that stopped the fit early (EarlyStopping) left its last epoch without a checkpoint (where
        only the last is written): the fitted model is built from it."""
        done = len(self.state.history)
        if self.rank == 0 and done and not self.spec.checkpoints(done):
            self._write(done)

    def _write(self, epochs_done: int) -> None:
        state, size, keras = self.state, self.size, self.keras
        scale_lr(self.model.optimizer, 1 / size, keras)  # the checkpoint keeps the rate as given
        try:
            saved = keras_bytes(self.model)
        finally:
            scale_lr(self.model.optimizer, size, keras)
        written = json.dumps({"epoch": epochs_done, "history": state.history}).encode()
        self.run.write_checkpoint(epochs_done, {CHECKPOINT: lambda out: out.write(saved),
                                              STATE: lambda out: out.write(written)})


class _Commit:
    """Keeps ``state`` at the next step to run; commits it every ``batches_per_commit`` steps and after each epoch
    (with restarts). A fit resumed mid-epoch starts ``skip`` steps in, with the metrics' sums of those steps."""

    def __init__(self, skip: int, state, fitted, spec: FitSpec, per_epoch: int, hvd, rank: int, size: int):
        super().__init__()
        self.skip = skip
        self.state, self.fitted, self.spec, self.per_epoch, self.hvd = state, fitted, spec, per_epoch, hvd
        self.rank, self.size = rank, size

    def on_epoch_begin(self, epoch, logs=None):
        mine = _resumed_metrics(self.state, self.fitted, self.rank, self.size) if self.skip else None
        for variable, value in zip(self.fitted.metrics_variables, mine or ()):  # Keras has just reset them
            variable.assign(value)

    def on_train_batch_end(self, batch, logs=None):
        state, spec = self.state, self.spec
        state.batch = self.skip + batch + 1
        if spec.batches_per_commit and state.batch % spec.batches_per_commit == 0 and state.batch < self.per_epoch:
            # every rank's sums (the committed state is rank 0's): a collective, at the same step on every rank
            state.metrics = self.hvd.allgather_object([variable.numpy() for variable in self.fitted.metrics_variables],
                                                      name="sparkhvd.ml.keras_metrics")
            state.commit()

    def on_epoch_end(self, epoch, logs=None):
        state = self.state
        self.skip = 0
        state.epoch, state.batch, state.metrics = epoch + 1, 0, None
        if self.spec.batches_per_commit:
            state.commit()


class _Shifted:
    """A user's callback in the fit that finishes a resumed epoch: it sees that epoch's steps and step numbers as
    in an uninterrupted fit (``batch + skip`` of ``per_epoch``), so warm-ups and schedules set the same rates."""

    def __init__(self, inner, skip: int, per_epoch: int):
        super().__init__()
        self.inner, self.skip, self.per_epoch = inner, skip, per_epoch

    def set_model(self, model):
        super().set_model(model)
        self.inner.set_model(model)

    def set_params(self, params):
        super().set_params(params)
        self.inner.set_params({**params, "steps": self.per_epoch})

    def on_train_batch_begin(self, batch, logs=None):
        self.inner.on_train_batch_begin(batch + self.skip, logs)

    def on_train_batch_end(self, batch, logs=None):
        self.inner.on_train_batch_end(batch + self.skip, logs)


for _hook in ("on_train_begin", "on_train_end", "on_epoch_begin", "on_epoch_end", "on_test_begin", "on_test_end",
              "on_test_batch_begin", "on_test_batch_end", "on_predict_begin", "on_predict_end",
              "on_predict_batch_begin", "on_predict_batch_end"):  # the others as they are
    setattr(_Shifted, _hook, lambda self, *args, _hook=_hook, **kwargs: getattr(self.inner, _hook)(*args, **kwargs))
del _hook


def _callback_classes(keras) -> tuple[type, type, type]:
    """``_Checkpoint``, ``_Commit`` and ``_Shifted`` as ``keras.callbacks.Callback``s, made once Keras is imported."""

    class Checkpoint(_Checkpoint, keras.callbacks.Callback):
        """``_Checkpoint`` as a Keras callback."""

    class Commit(_Commit, keras.callbacks.Callback):
        """``_Commit`` as a Keras callback."""

    class Shifted(_Shifted, keras.callbacks.Callback):
        """``_Shifted`` as a Keras callback."""

    return Checkpoint, Commit, Shifted


class _Fit:
    """One rank's ``model.fit`` calls under ``hvd.elastic.run``: the epochs left, a resumed epoch alone first."""

    def __init__(self, spec: FitSpec, framework: dict, hvd, keras, run: RunDir, model, stream: Stream):
        self.spec, self.framework, self.hvd, self.keras, self.run, self.model = spec, framework, hvd, keras, run, model
        self.stream = stream
        self.validation, self.val_steps = stream.validation()
        self.Checkpoint, self.Commit, self.Shifted = _callback_classes(keras)

    def callbacks(self, state, skip: int) -> list:
        """The fit's callbacks: the metrics averaged, the user's (shifted, in a resumed epoch), then ours."""
        stream, framework = self.stream, self.framework
        rank, size, per_epoch = stream.rank, stream.size, stream.per_epoch
        users = [self.Shifted(c, skip, per_epoch) for c in framework["callbacks"]] if skip else framework["callbacks"]
        return [self.hvd.callbacks.MetricAverageCallback(), *users,
                self.Checkpoint(state, self.run, self.spec, rank, size, self.keras),
                self.Commit(skip, state, self.model, self.spec, per_epoch, self.hvd, rank, size)]

    def loop(self, state):
        """Fit the epochs left from the state's epoch and step (``hvd.elastic.run`` runs it again after a reset)."""
        spec, model, stream = self.spec, self.model, self.stream
        while state.epoch < spec.epochs:
            first, skip = state.epoch, state.batch
            if skip and state.metrics is not None and _resumed_metrics(state, model, stream.rank, stream.size) is None:
                _build_metrics(model, stream)
            end = first + 1 if skip else spec.epochs  # a resumed epoch alone: Keras takes the same steps every epoch
            callbacks = self.callbacks(state, skip)
            model.fit(stream.training(first, skip, end), epochs=end, initial_epoch=first,
                      steps_per_epoch=stream.per_epoch - skip, validation_data=self.validation,
                      validation_steps=self.val_steps, callbacks=callbacks, shuffle=False,
                      verbose=0)  # the reader shuffles
            if model.stop_training:  # EarlyStopping, TerminateOnNaN: the fit ends here
                break
        return state.history


def train(spec: FitSpec, framework: dict):
    """Fit the run's Keras model on this rank's shards; rank 0 returns the history, the others None."""
    import tensorflow as tf

    if not spec.use_gpu:
        tf.config.set_visible_devices([], "GPU")  # before TensorFlow initialises its devices
    import keras

    import sparkhvd.collective.keras as hvd

    hvd.init()
    if spec.random_seed is not None:
        keras.utils.set_random_seed(spec.random_seed)
    run, model, start, history = _load(spec, hvd, framework["custom_objects"])
    model.jit_compile = False  # DistributedOptimizer's averaging runs outside XLA
    rank, size = hvd.rank(), hvd.size()
    scale_lr(model.optimizer, size, keras)
    hvd.DistributedOptimizer(model.optimizer, compression=framework["compression"] or hvd.Compression.none)
    stream = Stream(spec, framework["transformation_fn"], rank, size)
    fit = _Fit(spec, framework, hvd, keras, run, model, stream)  # the validation dataset made here
    # The model, its optimizer, where the fit is (epoch, and steps into it) and the history: committed every
    # batches_per_commit steps and after each epoch with restarts, so a relaunched rank goes on from the last commit.
    state = hvd.elastic.KerasState(model, epoch=start, batch=0, history=history, metrics=None)
    # every rank starts from rank 0's state (or the last commit, after a restart)
    history = hvd.elastic.run(fit.loop)(state)
    return history if rank == 0 else None
