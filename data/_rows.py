"""make_reader: one namedtuple per row, on top of the batch reader and its plan."""

from __future__ import annotations

import threading
from typing import Sequence

from ._petastorm_args import take
from ._reader import DEFAULT_WORKERS, Reader, _build


class RowReader:
    """Iterator over single rows (namedtuples of scalars) on top of a batch Reader."""

    def __init__(self, reader: Reader):
        self.reader = reader
        self._rows = (reader.batch_type(*row) for batch in reader for row in zip(*batch))
        self._lock = threading.Lock()  # threads may share a reader, as in Petastorm

    def __iter__(self) -> RowReader:
        return self

    def __next__(self) -> tuple:
        with self._lock:
            self.reader._check_not_stopped()  # not the rest of a batch read before stop()
            return next(self._rows)

    def stop(self) -> None:
        """Stop the underlying batch reader."""
        self.reader.stop()

    def join(self) -> None:
        """Wait for the underlying reader's threads."""
        self.reader.join()

    def __enter__(self) -> RowReader:
        return self

    def __exit__(self, *exc_info) -> None:
        self.reader.stop()


def make_reader(
    dataset_url_or_urls,
    *,
    cur_shard: int | None = None,
    shard_count: int | None = None,
    num_epochs: int | None = 1,
    shuffle_row_groups: bool = True,
    shuffle_rows: bool = False,
    seed: int | None = None,
    schema_fields: Sequence[str] | None = None,
    filters=None,
    equal_steps: bool = True,
    workers_count: int = DEFAULT_WORKERS,
    resume_from: tuple[int, int] | None = None,
    decode: dict | None = None,
    **petastorm_args,
) -> RowReader:
    """A row-at-a-time reader: the same arguments and plan as make_batch_reader, one namedtuple per row.

    With ``equal_steps=True`` every shard yields exactly ``m = rows // shard_count`` rows per
    epoch (the shards holding ``m + 1`` leave out their last row); with ``equal_steps=False``
    every row is read exactly once per epoch.

    ``resume_from=(epoch, row)``: start where an uninterrupted reader with the same arguments
    stood after yielding ``row`` rows of epoch ``epoch`` (both counted from 0, on this shard),
    and yield exactly what it would have yielded from there; the rules are make_batch_reader's
    with rows for batches (``row`` runs from 0 to the epoch's row count,
    ``reader.reader.plan(epoch).num_rows``). Row groups wholly before the position are not read.

    ``decode``: as make_batch_reader's (a row's decoded cell is its array). ``petastorm_args``: as
    make_batch_reader's, and Petastorm's ``results_queue_size`` (noted once:
    the reader holds ``workers_count + 2`` row groups ahead) and ``pyarrow_serialize`` (no effect,
    as in Petastorm).
    """
    reader = _build(
        dataset_url_or_urls, cur_shard=cur_shard, shard_count=shard_count, num_epochs=num_epochs,
        shuffle_row_groups=shuffle_row_groups, shuffle_rows=shuffle_rows, seed=seed, schema_fields=schema_fields,
        filters=filters, batch_size=None, equal_steps=equal_steps, workers_count=workers_count, step_rows=1,
        resume_from=resume_from, resume_unit="row", petastorm=take("make_reader", petastorm_args), decode=decode,
    )
    return RowReader(reader)
