"""One rank's batches of one epoch: every row once, and the same number of steps on every rank.

The reader's ``equal_steps`` leaves out one row of a shard holding a row more than others when
the smaller shards' rows are a multiple of the batch size (data/_reader.py). An estimator must
see every row, so it reads with ``equal_steps=False`` and merges that shard's one extra batch
(of one row) into its last: every rank takes ``ceil((rows // ranks) / batch_size)`` steps.
"""

from __future__ import annotations

import math
from typing import Iterator

import numpy as np

from ..data import make_batch_reader


def steps(rows: int, ranks: int, batch_size: int) -> int:
    """The steps every rank takes in an epoch of ``rows`` rows."""
    return math.ceil((rows // ranks) / batch_size)


def epoch_batches(url: str, rows: int, *, rank: int, ranks: int, epoch: int, batch_size: int, shuffle: bool, seed: int,
                  skip: int = 0, equal_steps: bool = True, decode: dict | None = None) -> Iterator[tuple[int, dict]]:
    """``(reader batches consumed, {column: array})`` for each step of ``epoch`` on this rank, from reader batch ``skip``.

    The order depends only on ``seed``, the epoch and the rank, so a run resumed from
    ``(epoch, skip)`` reads exactly what the uninterrupted run read from there. Without
    ``equal_steps`` (validation), every batch as read. ``decode`` (the estimator's) decodes binary columns in the
    reader's threads: such a column is then a ``(rows, *shape)`` array.
    """
    reader = make_batch_reader(url, cur_shard=rank, shard_count=ranks, num_epochs=epoch + 1, shuffle_row_groups=shuffle,
                               shuffle_rows=shuffle, seed=seed, batch_size=batch_size, equal_steps=False,
                               resume_from=(epoch, skip), workers_count=2, decode=decode)
    with reader:
        count = reader.plan(epoch).num_batches
        merge = equal_steps and count == steps(rows, ranks, batch_size) + 1
        names = reader.schema.names
        held = None
        for index, batch in enumerate(reader, start=skip):
            columns = dict(zip(names, batch))
            if merge and index == count - 2:
                held = columns
                continue
            if held is not None:
                yield 2, {name: np.concatenate([held[name], columns[name]]) for name in names}
                held = None
            else:
                yield 1, columns
