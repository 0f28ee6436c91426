"""KerasEstimator's training, on every rank (horovod/spark/keras/remote.py's, on sparkhvd): ``model.fit`` on the shards.

Each rank loads the model from the run's newest complete checkpoint (``checkpoint.keras``, with
its optimizer's state, and ``state.json``: the epochs done and the history), or else from
``initial.keras``, wraps its optimizer in ``hvd.DistributedOptimizer`` (in place: the compiled
loss and metrics stay), and runs ``model.fit`` from the next epoch on a ``tf.data`` stream of its
shard (``_batches.epoch_batches``: every row once per epoch, the same steps on every rank), under
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

import contextlib
import json
import math
import os
import tempfile
import warnings

import numpy as np

from ._batches import epoch_batches, steps
from ._checkpoints import RunDir
from ._spec import FitSpec

INITIAL = "initial.keras"  # the model as the ranks start it: compiled, its optimizer built
CHECKPOINT = "checkpoint.keras"  # in each checkpoint directory: the model, its optimizer's state
STATE = "state.json"  # beside it: the epochs done and the history
MODEL = "model.keras"  # the fitted model: what the executors load
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


def _shapes(data, output_shapes) -> tuple[list, list]:
    """Per feature, per label: the per-row shape the model takes and its output matches."""
    features = [column.shape or (1,) for column in data.features]
    labels = [tuple(out) if math.prod(out) == math.prod(column.shape) else column.shape
              for column, out in zip(data.labels, output_shapes)]  # else class scores for a class index
    return features, labels


def train(spec: FitSpec, framework: dict):
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
    data, rank, size = spec.data, hvd.rank(), hvd.size()
    scale_lr(model.optimizer, size, keras)
    hvd.DistributedOptimizer(model.optimizer, compression=framework["compression"] or hvd.Compression.none)
    transform = framework["transformation_fn"]
    feature_shapes, label_shapes = _shapes(data, spec.output_shapes)

    def arrays(batch: dict) -> tuple:
        if transform is not None:
            batch = transform(batch)
        xs = tuple(np.asarray(batch[c.name], dtype=np.float32).reshape((len(batch[c.name]), *shape))
                   for c, shape in zip(data.features, feature_shapes))
        ys = tuple(np.asarray(batch[c.name], dtype=np.int64 if c.integer else np.float32)
                   .reshape((len(batch[c.name]), *shape)) for c, shape in zip(data.labels, label_shapes))
        out = (xs[0] if len(xs) == 1 else xs, ys[0] if len(ys) == 1 else ys)
        if data.weight is not None:
            out += (np.asarray(batch[data.weight.name], dtype=np.float32).reshape(-1),)
        return out

    def signature() -> tuple:
        xs = tuple(tf.TensorSpec((None, *shape), tf.float32) for shape in feature_shapes)
        ys = tuple(tf.TensorSpec((None, *shape), tf.int64 if c.integer else tf.float32)
                   for c, shape in zip(data.labels, label_shapes))
        out = (xs[0] if len(xs) == 1 else xs, ys[0] if len(ys) == 1 else ys)
        return out + ((tf.TensorSpec((None,), tf.float32),) if data.weight is not None else ())

    def batches(url, rows, epoch, batch_size, shuffle, limit, skip=0):
        with contextlib.closing(epoch_batches(url, rows, rank=rank, ranks=size, epoch=epoch, batch_size=batch_size,
                                              shuffle=shuffle, seed=spec.seed, skip=skip)) as read:
            for step, (_, batch) in enumerate(read):
                if step >= limit:
                    break
                yield arrays(batch)

    per_epoch = steps(data.train_rows, size, spec.batch_size)
    per_epoch = min(per_epoch, spec.train_steps_per_epoch or per_epoch)

    def train_stream(first: int, skip: int, end: int):
        """Epochs ``first`` to ``end`` in one stream, the first from reader batch ``skip`` (with steps_per_epoch, Keras
        goes on with the same iterator)."""
        for epoch in range(first, end):
            yield from batches(data.train_url, data.train_rows, epoch, spec.batch_size, spec.shuffle,
                               per_epoch - skip, skip)
            skip = 0

    def dataset(generator):
        return tf.data.Dataset.from_generator(generator, output_signature=signature()).prefetch(2)

    validation, val_steps = None, None
    if data.val_url is not None and data.val_rows >= size:  # every rank the same validation steps: the averaging
        val_steps = steps(data.val_rows, size, spec.val_batch_size)
        val_steps = min(val_steps, spec.validation_steps_per_epoch or val_steps)
        validation = dataset(lambda: batches(data.val_url, data.val_rows, 0, spec.val_batch_size, False, val_steps))
    elif data.val_url is not None and rank == 0 and spec.verbose:
        print(f"The validation data has {data.val_rows} row(s), fewer than the {size} ranks; training without "
              "validation: hold out more rows (a larger validation fraction) or use fewer processes.", flush=True)

    # The model, its optimizer, where the fit is (epoch, and steps into it) and the history: committed every
    # batches_per_commit steps and after each epoch with restarts, so a relaunched rank goes on from the last commit.
    state = hvd.elastic.KerasState(model, epoch=start, batch=0, history=history, metrics=None)

    class Checkpoint(keras.callbacks.Callback):
        """Each epoch's history entry; on rank 0 the line and the checkpoint. After MetricAverageCallback."""

        def on_epoch_end(self, epoch, logs=None):
            logs = {k: float(np.asarray(v)) for k, v in (logs or {}).items()}
            entry = {"epoch": epoch, "train": {k: v for k, v in logs.items() if not k.startswith("val_")}}
            val = {k[len("val_"):]: v for k, v in logs.items() if k.startswith("val_")}
            if val:
                entry["validation"] = val
            state.history = [*state.history, entry]
            if rank != 0:
                return
            if spec.verbose:
                shown = ", ".join(f"{k} {v:.6g}" for k, v in logs.items())
                print(f"epoch {epoch + 1}/{spec.epochs}: {shown}", flush=True)
            scale_lr(self.model.optimizer, 1 / size, keras)  # the checkpoint keeps the rate as given
            try:
                saved = keras_bytes(self.model)
            finally:
                scale_lr(self.model.optimizer, size, keras)
            written = json.dumps({"epoch": epoch + 1, "history": state.history}).encode()
            run.write_checkpoint(epoch + 1, {CHECKPOINT: lambda out: out.write(saved),
                                             STATE: lambda out: out.write(written)})

    class Commit(keras.callbacks.Callback):
        """Keeps ``state`` at the next step to run; commits it every ``batches_per_commit`` steps and after each epoch
        (with restarts). A fit resumed mid-epoch starts ``skip`` steps in, with the metrics' sums of those steps."""

        def __init__(self, skip: int):
            super().__init__()
            self.skip = skip

        def on_epoch_begin(self, epoch, logs=None):
            mine = resumed_metrics() if self.skip else None
            for variable, value in zip(model.metrics_variables, mine or ()):  # Keras has just reset them
                variable.assign(value)

        def on_train_batch_end(self, batch, logs=None):
            state.batch = self.skip + batch + 1
            if spec.batches_per_commit and state.batch % spec.batches_per_commit == 0 and state.batch < per_epoch:
                # every rank's sums (the committed state is rank 0's): a collective, at the same step on every rank
                state.metrics = hvd.allgather_object([variable.numpy() for variable in model.metrics_variables],
                                                     name="sparkhvd.ml.keras_metrics")
                state.commit()

        def on_epoch_end(self, epoch, logs=None):
            self.skip = 0
            state.epoch, state.batch, state.metrics = epoch + 1, 0, None
            if spec.batches_per_commit:
                state.commit()

    class Shifted(keras.callbacks.Callback):
        """A user's callback in the fit that finishes a resumed epoch: it sees that epoch's steps and step numbers as
        in an uninterrupted fit (``batch + skip`` of ``per_epoch``), so warm-ups and schedules set the same rates."""

        def __init__(self, inner, skip: int):
            super().__init__()
            self.inner, self.skip = inner, skip

        def set_model(self, model):
            super().set_model(model)
            self.inner.set_model(model)

        def set_params(self, params):
            super().set_params(params)
            self.inner.set_params({**params, "steps": per_epoch})

        def on_train_batch_begin(self, batch, logs=None):
            self.inner.on_train_batch_begin(batch + self.skip, logs)

        def on_train_batch_end(self, batch, logs=None):
            self.inner.on_train_batch_end(batch + self.skip, logs)

    for hook in ("on_train_begin", "on_train_end", "on_epoch_begin", "on_epoch_end", "on_test_begin", "on_test_end",
                 "on_test_batch_begin", "on_test_batch_end", "on_predict_begin", "on_predict_end",
                 "on_predict_batch_begin", "on_predict_batch_end"):  # the others as they are
        setattr(Shifted, hook, lambda self, *args, _hook=hook, **kwargs: getattr(self.inner, _hook)(*args, **kwargs))

    def resumed_metrics() -> list | None:
        """This rank's committed metric sums, where the commit has them for this many ranks and these metrics."""
        if state.metrics is None or len(state.metrics) != size or len(state.metrics[rank]) != len(model.metrics_variables):
            return None
        return state.metrics[rank]

    def build_metrics() -> None:
        """Build the compiled loss and metrics, which Keras builds at the first step, so that a resumed epoch can put
        their committed sums back before it. A model whose metrics cannot be built on zeros resumes without them: that
        epoch's metrics then cover the steps after the commit (they are history, not training state)."""
        xs = [np.zeros((1, *shape), np.float32) for shape in feature_shapes]
        ys = [np.zeros((1, *shape), np.int64 if c.integer else np.float32) for c, shape in zip(data.labels, label_shapes)]
        x, y = (xs[0] if len(xs) == 1 else tuple(xs)), (ys[0] if len(ys) == 1 else tuple(ys))
        try:
            predicted = model(x, training=False)
            model.compute_loss(x, y, predicted)
            model.compute_metrics(x, y, predicted)
        except Exception:  # noqa: BLE001 - see above
            pass

    @hvd.elastic.run
    def loop(state):
        while state.epoch < spec.epochs:
            first, skip = state.epoch, state.batch
            if skip and state.metrics is not None and resumed_metrics() is None:
                build_metrics()
            end = first + 1 if skip else spec.epochs  # a resumed epoch alone: Keras takes the same steps every epoch
            users = [Shifted(c, skip) for c in framework["callbacks"]] if skip else framework["callbacks"]
            callbacks = [hvd.callbacks.MetricAverageCallback(), *users, Checkpoint(), Commit(skip)]
            model.fit(dataset(lambda: train_stream(first, skip, end)), epochs=end, initial_epoch=first,
                      steps_per_epoch=per_epoch - skip, validation_data=validation, validation_steps=val_steps,
                      callbacks=callbacks, shuffle=False, verbose=0)  # the reader shuffles
            if model.stop_training:  # EarlyStopping, TerminateOnNaN: the fit ends here
                break
        return state.history

    history = loop(state)  # every rank starts from rank 0's state (or the last commit, after a restart)
    return history if rank == 0 else None

