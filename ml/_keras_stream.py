"""A KerasEstimator rank's ``tf.data`` streams of its shard (for ``_keras_train.py``): features and labels as the model
takes them, every row once per epoch and the same steps on every rank (``_batches.epoch_batches``)."""

from __future__ import annotations

import contextlib
import math

import numpy as np

from ._batches import epoch_batches, steps
from ._spec import FitSpec


def shapes(data, output_shapes) -> tuple[list, list]:
    """Per feature, per label: the per-row shape the model takes and its output matches."""
    features = [column.shape or (1,) for column in data.features]
    labels = [tuple(out) if math.prod(out) == math.prod(column.shape) else column.shape
              for column, out in zip(data.labels, output_shapes)]  # else class scores for a class index
    return features, labels


class Stream:
    """This rank's training and validation batches as ``tf.data`` datasets of ``(x, y[, sample weight])``."""

    def __init__(self, spec: FitSpec, transform, rank: int, size: int):
        self.spec, self.data, self.transform, self.rank, self.size = spec, spec.data, transform, rank, size
        self.feature_shapes, self.label_shapes = shapes(spec.data, spec.output_shapes)
        per_epoch = steps(self.data.train_rows, size, spec.batch_size)
        self.per_epoch = min(per_epoch, spec.train_steps_per_epoch or per_epoch)  # the training steps of an epoch

    def arrays(self, batch: dict) -> tuple:
        """A reader batch (after the transformation) as NumPy arrays in the model's shapes."""
        data = self.data
        if self.transform is not None:
            batch = self.transform(batch)
        xs = tuple(np.asarray(batch[c.name], dtype=np.float32).reshape((len(batch[c.name]), *shape))
                   for c, shape in zip(data.features, self.feature_shapes))
        ys = tuple(np.asarray(batch[c.name], dtype=np.int64 if c.integer else np.float32)
                   .reshape((len(batch[c.name]), *shape)) for c, shape in zip(data.labels, self.label_shapes))
        out = (xs[0] if len(xs) == 1 else xs, ys[0] if len(ys) == 1 else ys)
        if data.weight is not None:
            out += (np.asarray(batch[data.weight.name], dtype=np.float32).reshape(-1),)
        return out

    def signature(self) -> tuple:
        """The ``tf.TensorSpec``s of what ``arrays`` yields."""
        import tensorflow as tf

        xs = tuple(tf.TensorSpec((None, *shape), tf.float32) for shape in self.feature_shapes)
        ys = tuple(tf.TensorSpec((None, *shape), tf.int64 if c.integer else tf.float32)
                   for c, shape in zip(self.data.labels, self.label_shapes))
        out = (xs[0] if len(xs) == 1 else xs, ys[0] if len(ys) == 1 else ys)
        return out + ((tf.TensorSpec((None,), tf.float32),) if self.data.weight is not None else ())

    def batches(self, url, rows, epoch, batch_size, shuffle, limit, skip=0):
        """This rank's first ``limit`` batches of ``epoch``, from reader batch ``skip``, as ``arrays``."""
        with contextlib.closing(epoch_batches(url, rows, rank=self.rank, ranks=self.size, epoch=epoch,
                                              batch_size=batch_size, shuffle=shuffle, seed=self.spec.seed,
                                              skip=skip, decode=self.data.decode)) as read:
            for step, (_, batch) in enumerate(read):
                if step >= limit:
                    break
                yield self.arrays(batch)

    def train_stream(self, first: int, skip: int, end: int):
        """Epochs ``first`` to ``end`` in one stream, the first from reader batch ``skip`` (with steps_per_epoch, Keras
        goes on with the same iterator)."""
        data, spec = self.data, self.spec
        for epoch in range(first, end):
            yield from self.batches(data.train_url, data.train_rows, epoch, spec.batch_size, spec.shuffle,
                                    self.per_epoch - skip, skip)
            skip = 0

    def dataset(self, generator):
        """``generator``'s batches as a prefetching ``tf.data.Dataset``."""
        import tensorflow as tf

        return tf.data.Dataset.from_generator(generator, output_signature=self.signature()).prefetch(2)

    def training(self, first: int, skip: int, end: int):
        """The dataset of ``train_stream(first, skip, end)``."""
        return self.dataset(lambda: self.train_stream(first, skip, end))

    def validation(self) -> tuple:
        """The validation dataset and its steps, or ``(None, None)``: without validation data, or with fewer rows
        than ranks (said on rank 0 when verbose)."""
        data, spec, size = self.data, self.spec, self.size
        validation, val_steps = None, None
        if data.val_url is not None and data.val_rows >= size:  # every rank the same validation steps: the averaging
            val_steps = steps(data.val_rows, size, spec.val_batch_size)
            val_steps = min(val_steps, spec.validation_steps_per_epoch or val_steps)
            validation = self.dataset(lambda: self.batches(data.val_url, data.val_rows, 0, spec.val_batch_size, False,
                                                           val_steps))
        elif data.val_url is not None and self.rank == 0 and spec.verbose:
            print(f"The validation data has {data.val_rows} row(s), fewer than the {size} ranks; training without "
                  "validation: hold out more rows (a larger validation fraction) or use fewer processes.", flush=True)
        return validation, val_steps
