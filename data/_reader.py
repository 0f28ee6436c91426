"""make_batch_reader and its Reader: Petastorm's batch reader API on pyarrow, with row-balanced shards."""

from __future__ import annotations

import os
import threading
import time
import weakref
from concurrent.futures import CancelledError
from dataclasses import dataclass, replace
from itertools import islice
from typing import Iterator, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq

from .._common import metrics as _metrics
from . import _decode
from ._arrow import batch_type, rebatch, table_to_batch
from ._checks import _check_positive, _check_resume, _check_seed, _check_shard
from ._errors import EmptyShardError, ReadError
from ._metadata import Dataset, open_dataset
from ._petastorm_args import Options, take
from ._plan import EpochPlan, ResumePoint, Slice, iter_epochs, merged, plan_epoch, ranges_of, resolve_seed, shard_range
from ._prefetch import Prefetcher

DEFAULT_WORKERS = 4
READ_ATTEMPTS = 5  # a row group's read, tried again after a transient I/O error (Shard.read)
READ_BACKOFF_S = (0.25, 0.5, 1.0, 2.0)  # the waits between the attempts


@dataclass(frozen=True)
class _Shard:
    """What one shard reads: the dataset and the plan's settings. Holds no reference to its Reader.

    The prefetch threads and the batch generator use only this, so that a Reader nobody
    references any longer is freed at once (no reference cycle waits for the garbage
    collector) and its finalizer stops the threads.
    """

    dataset: Dataset
    cur_shard: int
    shard_count: int
    num_epochs: int | None
    seed: int
    shuffle_row_groups: bool
    shuffle_rows: bool
    batch_size: int | None
    equal_steps: bool
    step_rows: int | None
    start: tuple[int, int] = (0, 0)  # (first epoch read, rows of it skipped): where a resumed reader starts
    decode: tuple[tuple[str, object], ...] = ()  # (column, function) pairs of decode=, run in the prefetch threads
    remaining: tuple[tuple[int, int], ...] | None = None  # a ResumePoint's rows left of the start epoch
    global_order: bool = False  # rows dealt in batches, in one order at any shard_count (_plan.interleaved)

    def remaining_in(self, epoch: int) -> tuple[tuple[int, int], ...] | None:
        """The rows of ``epoch`` this reader reads where it started from a ResumePoint in it; None: all of them."""
        return self.remaining if epoch == self.start[0] else None

    def plan(self, epoch: int) -> EpochPlan:
        return plan_epoch(
            self.dataset.pieces, shard_count=self.shard_count, cur_shard=self.cur_shard, epoch=epoch, seed=self.seed,
            shuffle_row_groups=self.shuffle_row_groups, batch_size=self.batch_size, equal_steps=self.equal_steps,
            step_rows=self.step_rows, remaining=self.remaining_in(epoch), global_order=self.global_order,
        )

    def epochs(self) -> Iterator[tuple[int, EpochPlan, int]]:
        """``(epoch, plan, rows of it skipped)`` for every epoch the reader reads, from its start on."""
        start_epoch, skipped = self.start
        for epoch in iter_epochs(self.num_epochs, start_epoch):
            yield epoch, self.plan(epoch), skipped if epoch == start_epoch else 0

    def read(self, task: tuple[int, int, tuple[Slice, ...], int]) -> pa.Table:
        """Slices of one row group, next to each other in the plan, read once (and row-shuffled) in a prefetch thread,
        less the first slice's first ``drop`` rows.

        A read that fails with an I/O error other than a missing file (an object store's 503, a reset connection, a
        server restarting) is tried again, ``READ_ATTEMPTS`` times in all over about ``sum(READ_BACKOFF_S)``
        seconds; then, or at once for a missing file, it raises ReadError with the file, the URL and the cause.
        """
        epoch, position, slices, drop = task
        piece = self.dataset.pieces[slices[0].piece]
        started = time.monotonic()
        for attempt in range(1, READ_ATTEMPTS + 1):
            try:
                table = self._read_piece(piece)
                break
            except Exception as exc:
                transient = isinstance(exc, OSError) and not isinstance(exc, (FileNotFoundError, PermissionError))
                if transient and attempt < READ_ATTEMPTS:
                    time.sleep(READ_BACKOFF_S[attempt - 1])
                    continue
                where = (f"Reading row group {piece.row_group} of {piece.path!r} failed in a prefetch thread (shard "
                         f"{self.cur_shard} of {self.shard_count}, epoch {epoch})")
                if transient:
                    raise ReadError(
                        f"{where}, {attempt} times over {time.monotonic() - started:.1f} s: {type(exc).__name__}: "
                        f"{exc}. Check that the store of {self.dataset.url} is up and reachable from this host and "
                        "that the file is whole, then create a new reader (resume_from= starts it where this one "
                        "stood)."
                    ) from exc
                raise ReadError(
                    f"{where}: {type(exc).__name__}: {exc}. The file was readable when the reader was created, so it "
                    "was changed, moved or deleted since; restore it and create a new reader."
                ) from exc
        if table.num_rows != piece.num_rows:
            raise ReadError(
                f"Row group {piece.row_group} of {piece.path!r} now has {table.num_rows} rows (after filters) but had "
                f"{piece.num_rows} when the reader was created; the file changed under the reader. Do not rewrite a "
                "dataset while it is read; create a new reader."
            )
        table = table.select(self.dataset.schema.names)
        if self.global_order and self.shuffle_rows:  # the row group's rows permuted as the row space has them
            rows = np.random.default_rng([self.seed, epoch, slices[0].piece]).permutation(table.num_rows)
            table = table.take(np.concatenate([rows[s.start + (drop if i == 0 else 0):s.stop]
                                               for i, s in enumerate(slices)]))
        elif self.global_order:  # the slices as they are, without a copy
            table = pa.concat_tables([table.slice(s.start + (drop if i == 0 else 0), s.stop - s.start - (drop if i == 0 else 0))
                                      for i, s in enumerate(slices)])
        else:
            table = pa.concat_tables([self._slice(table, epoch, position + i, s, drop if i == 0 else 0)
                                      for i, s in enumerate(slices)])
        if self.decode:
            table = _decode.apply(table, dict(self.decode), f"row group {piece.row_group} of {piece.path!r}")
        return table

    def _slice(self, table: pa.Table, epoch: int, position: int, piece_slice: Slice, drop: int) -> pa.Table:
        """A slice of a row group's rows, row-shuffled, less its first ``drop`` rows."""
        table = table.slice(piece_slice.start, piece_slice.num_rows)
        if self.shuffle_rows:
            rng = np.random.default_rng([self.seed, epoch, self.cur_shard, position])
            table = table.take(rng.permutation(table.num_rows))
        # Dropped after the shuffle, which permutes the whole slice, so a resumed reader yields what an uninterrupted one did.
        return table.slice(drop) if drop else table

    def _read_piece(self, piece) -> pa.Table:
        """A row group's rows that pass the filters, with its partition columns."""
        columns, partitions = self.dataset.schema.names, self.dataset.partitions
        absent = self.dataset.absent_in(piece.path)
        if self.dataset.filter is None:
            with self.dataset.filesystem.open_input_file(piece.path) as f:
                # The column chunks fetched together (coalesced, concurrent on an object store, where each request
                # costs a round trip)
                parquet = pq.ParquetFile(f, pre_buffer=True)
                table = parquet.read_row_group(piece.row_group,
                                               columns=[c for c in self.dataset.file_columns if c not in absent])
            for name in absent:  # a column added after this file was written: null in its rows
                table = table.append_column(self.dataset.full_schema.field(name),
                                            pa.nulls(table.num_rows, self.dataset.full_schema.field(name).type))
            if partitions is not None:  # the folders' values, one per row
                in_folders = [c for c in columns if c in partitions.names]
                for name, values in zip(in_folders, partitions.columns(piece.path, in_folders, table.num_rows)):
                    table = table.append_column(name, values)
            return table
        if partitions is None:
            fragment = ds.ParquetFileFormat().make_fragment(piece.path, filesystem=self.dataset.filesystem, row_groups=[piece.row_group])
            schema = {"schema": self.dataset.full_schema} if absent else {}  # the scan fills what the file lacks
            return fragment.to_table(columns=columns, filter=self.dataset.filter, batch_size=1 << 30, **schema)
        fragment = ds.ParquetFileFormat().make_fragment(  # the scan fills the partition columns from the folders
            piece.path, filesystem=self.dataset.filesystem, partition_expression=partitions.expression(piece.path),
            row_groups=[piece.row_group])
        return fragment.to_table(schema=self.dataset.full_schema, columns=columns, filter=self.dataset.filter,
                                 batch_size=1 << 30)

    def tasks(self) -> Iterator[tuple[int, int, tuple[Slice, ...], int]]:
        """``(epoch, position in the plan of the first slice, slices, leading rows to drop)``, a task per run of slices
        of one row group (a global_order shard's batches from one row group are read once); slices a resumed reader
        skips are not tasks."""
        for epoch, plan, skipped in self.epochs():
            for position, slices, drop in _reads(plan, skipped):
                yield epoch, position, slices, drop


def _reads(plan: EpochPlan, skipped: int) -> list[tuple[int, tuple[Slice, ...], int]]:
    """The plan's slices from row ``skipped`` on, in runs of one row group: ``(position of the first, slices, leading
    rows of the first to drop)``."""
    first, drop = plan.start_at(skipped)
    runs: list[tuple[int, list[Slice], int]] = []
    for position in range(first, len(plan.slices)):
        piece_slice = plan.slices[position]
        if runs and runs[-1][1][-1].piece == piece_slice.piece:
            runs[-1][1].append(piece_slice)
        else:
            runs.append((position, [piece_slice], drop if position == first else 0))
    return [(position, tuple(slices), drop) for position, slices, drop in runs]


def _batches(shard: _Shard, tables: Prefetcher) -> Iterator[pa.Table]:
    """The shard's batches as Arrow tables, epoch by epoch, cut from the prefetched ones (a function, not a method: see _Shard)."""
    for _, plan, skipped in shard.epochs():
        try:
            yield from rebatch(islice(tables, len(_reads(plan, skipped))), plan.batch_sizes(skipped))
        except pa.ArrowInvalid as exc:
            if not shard.decode:
                raise
            names = [name for name, _ in shard.decode]
            raise ValueError(f"decode of {names} gave one row group's cells another shape or dtype than the row "
                             f"group's before, and a batch spans both ({' '.join(str(exc).split())[:200]}); return one "
                             "shape and dtype for every cell (resize or cast in decode).") from None


def _resume_start(shard: _Shard, resume_from: tuple[int, int], unit: str = "batch") -> tuple[int, int]:
    """The shard's start ``(epoch, rows of it skipped)`` for ``resume_from=(epoch, position)``; ValueError past the end.

    ``unit`` says what the position counts: the batches yielded (make_batch_reader) or the rows (make_reader).
    """
    epoch, position = resume_from
    same = ("build the reader with the interrupted run's dataset, filters, cur_shard, shard_count, seed, shuffle options"
            + (", batch_size and equal_steps" if unit == "batch" else " and equal_steps"))
    if shard.num_epochs is not None and (epoch > shard.num_epochs or (epoch == shard.num_epochs and position)):
        raise ValueError(
            f"resume_from=({epoch}, {position}) starts in epoch {epoch}, but num_epochs={shard.num_epochs} reads epochs 0 to "
            f"{shard.num_epochs - 1}; num_epochs counts every epoch, not those left, so pass the interrupted run's num_epochs "
            f"and an epoch below {shard.num_epochs} (or ({shard.num_epochs}, 0), which yields nothing: the run had finished)."
        )
    if shard.num_epochs is not None and epoch == shard.num_epochs:
        return epoch, 0
    plan = shard.plan(epoch)
    if unit == "row":
        if position > plan.num_rows:
            raise ValueError(
                f"resume_from=({epoch}, {position}) skips {position} rows of epoch {epoch}, but shard {shard.cur_shard} of "
                f"{shard.shard_count} reads {plan.num_rows} rows in that epoch; pass a row from 0 to {plan.num_rows} "
                f"({plan.num_rows} means the epoch was finished), and {same}."
            )
        return epoch, position
    if position > plan.num_batches:
        size = f"batch_size={shard.batch_size}" if shard.batch_size is not None else "batch_size=None"
        raise ValueError(
            f"resume_from=({epoch}, {position}) skips {position} batches of epoch {epoch}, but shard {shard.cur_shard} of "
            f"{shard.shard_count} has {plan.num_batches} batches ({plan.num_rows} rows, {size}) in that epoch; pass a "
            f"batch from 0 to {plan.num_batches} ({plan.num_batches} means the epoch was finished), and {same}."
        )
    return epoch, plan.rows_before(position)


def _resume_point_start(shard: _Shard, point: ResumePoint) -> dict:
    """The ``_Shard`` fields of a reader resumed from ``point``; ValueError where it is another job's."""
    shuffled = shard.global_order and shard.shuffle_rows
    same = (point.rows, point.seed, point.shuffle_row_groups) == (shard.dataset.num_rows, shard.seed,
                                                                  shard.shuffle_row_groups)
    if not same:
        raise ValueError(
            f"This ResumePoint was taken from a reader of {point.rows} rows with seed={point.seed}, "
            f"shuffle_row_groups={point.shuffle_row_groups}, and this reader has {shard.dataset.num_rows} rows with "
            f"seed={shard.seed}, shuffle_row_groups={shard.shuffle_row_groups}; build it with the interrupted run's "
            "dataset, filters, seed and shuffle_row_groups (shard_count, batch_size and schema_fields may change).")
    if point.shuffled_rows != shuffled:
        taken = "global_order=True and shuffle_rows=True" if point.shuffled_rows else "rows in file order"
        raise ValueError(
            f"This ResumePoint was taken from a reader with {taken}, and this reader has global_order="
            f"{shard.global_order}, shuffle_rows={shard.shuffle_rows}: their row spaces order rows differently. Build "
            "it with the interrupted run's global_order and shuffle_rows.")
    if shard.num_epochs is not None and point.epoch >= shard.num_epochs:
        return {"start": (shard.num_epochs, 0)}
    if point.rows_left < shard.shard_count:
        raise EmptyShardError(
            f"The ResumePoint leaves {point.rows_left} rows of epoch {point.epoch}, fewer than shard_count="
            f"{shard.shard_count}, so some shards would have none; resume with at most {point.rows_left} shards, or "
            f"from the next epoch (resume_from=({point.epoch + 1}, 0)).")
    return {"start": (point.epoch, 0), "remaining": point.remaining}


class Reader:
    """Iterator over the batches of one shard; also a context manager. Build it with make_batch_reader.

    Dropping the last reference to a reader stops its prefetch threads (without waiting for
    a running read) as soon as Python frees it; ``stop()`` or ``with`` stop them and wait.
    """

    def __init__(
        self,
        dataset: Dataset,
        *,
        cur_shard: int,
        shard_count: int,
        num_epochs: int | None,
        shuffle_row_groups: bool,
        shuffle_rows: bool,
        seed: int,
        batch_size: int | None,
        equal_steps: bool,
        workers_count: int,
        step_rows: int | None = None,
        resume_from: tuple[int, int] | None = None,
        resume_unit: str = "batch",
        decode: dict | None = None,
        global_order: bool = False,
    ):
        self.dataset = dataset
        self.cur_shard, self.shard_count = cur_shard, shard_count
        self.num_epochs, self.seed = num_epochs, seed
        self.shuffle_row_groups, self.shuffle_rows = shuffle_row_groups, shuffle_rows
        self.batch_size, self.equal_steps = batch_size, equal_steps
        self.workers_count = workers_count
        self.global_order = global_order
        self.batch_type = batch_type(dataset.schema.names)
        self.resume_from = resume_from
        self._shard = _Shard(dataset, cur_shard, shard_count, num_epochs, seed, shuffle_row_groups, shuffle_rows,
                             batch_size, equal_steps, step_rows, global_order=global_order)
        if isinstance(resume_from, ResumePoint):
            self._shard = replace(self._shard, **_resume_point_start(self._shard, resume_from))
        elif resume_from is not None:
            self._shard = replace(self._shard, start=_resume_start(self._shard, resume_from, resume_unit))
        if decode:
            self._shard = replace(self._shard, decode=tuple(decode.items()))
        self._prefetcher: Prefetcher | None = None
        self._batches: Iterator[pa.Table] | None = None
        self._stopped = False
        self._ended = False  # the last epoch was read, or reading failed: next() then raises StopIteration again
        self._lock = threading.Lock()
        self._next_lock = threading.Lock()  # one next() at a time: threads may share a reader, as in Petastorm

    def resume_point(self, epoch: int, batch: int) -> ResumePoint:
        """Where the whole job stands once every shard has yielded ``batch`` batches of epoch ``epoch``: a
        ResumePoint, the same on every rank, from which ``make_batch_reader(..., resume_from=point)`` resumes at
        any ``shard_count`` (a resized elastic run) reading each row of the epoch not yet read exactly once.

        Needs ``equal_steps=True`` (every shard at the same batch) and, unless ``global_order``, ``shuffle_rows=False``
        (a shuffled slice's first rows are not a range of the row space; a global_order reader's row space is shuffled
        itself). With ``global_order`` the rows read are the row space's first ``batch * shard_count * batch_size``.
        """
        if (self.shuffle_rows and not self.global_order) or not self.equal_steps:
            raise ValueError(
                f"resume_point needs a reader with equal_steps=True, and shuffle_rows=False unless global_order=True "
                f"(this one has equal_steps={self.equal_steps}, shuffle_rows={self.shuffle_rows}, "
                f"global_order={self.global_order}): it tells the rows every shard has read from the batch count alone. "
                "Build the reader so, or resume at the same shard_count with resume_from=(epoch, batch).")
        shard = self._shard
        remaining = shard.remaining_in(epoch)
        if remaining is None:
            remaining = ((0, self.dataset.num_rows),)
        rows_left = sum(b - a for a, b in remaining)
        left, finished = [], True
        for k in range(self.shard_count):
            plan = replace(shard, cur_shard=k).plan(epoch)
            if not 0 <= batch <= plan.num_batches:
                raise ValueError(f"resume_point({epoch}, {batch}): shard {k} of {self.shard_count} has "
                                 f"{plan.num_batches} batches in epoch {epoch}; pass a batch from 0 to "
                                 f"{plan.num_batches}.")
            finished = finished and batch == plan.num_batches
            if not self.global_order:
                lo, hi = shard_range(rows_left, self.shard_count, k)
                left.extend(ranges_of(remaining, lo + plan.rows_before(batch), hi))
        if self.global_order:  # the steps so far read the row space's first rows (_plan.interleaved)
            left = ranges_of(remaining, batch * self.shard_count * self.batch_size, rows_left)
        rows, shuffled = self.dataset.num_rows, self.global_order and self.shuffle_rows
        if finished or not left:  # the epoch is done (equal_steps' left-out rows with it): the next one, whole
            return ResumePoint(epoch + 1, ((0, rows),), rows, self.seed, self.shuffle_row_groups, shuffled)
        return ResumePoint(epoch, merged(left), rows, self.seed, self.shuffle_row_groups, shuffled)

    @property
    def schema(self) -> pa.Schema:
        """The Arrow schema of the columns this reader yields, in order."""
        return self.dataset.schema

    def plan(self, epoch: int) -> EpochPlan:
        """This shard's plan for ``epoch``: its row-group slices and batch sizes."""
        return self._shard.plan(epoch)

    def _start(self) -> Iterator[pa.Table] | None:
        """The batch generator, starting the prefetch threads on the first call; None once stopped."""
        with self._lock:
            if self._stopped:
                return None
            if self._batches is None:
                # The pipeline references only self._shard, never self: see _Shard.
                self._prefetcher = Prefetcher(self._shard.read, self._shard.tasks(), workers=self.workers_count, depth=self.workers_count + 2)
                # When the reader is freed (on any thread, the garbage collector's included): stop without waiting.
                weakref.finalize(self, self._prefetcher.close, False)
                self._batches = _batches(self._shard, self._prefetcher)
            return self._batches

    def __iter__(self) -> Reader:
        return self

    def __next__(self) -> tuple:
        table = self._next_table(raise_if_stopped=True)
        try:
            return table_to_batch(table, self.batch_type)
        except BaseException:
            self._ended = True  # ended by the error, not by a stop(): next() is then the end, not Petastorm's error
            self.stop()
            raise

    def _arrow_batches(self) -> Iterator[pa.Table]:
        """The batches as Arrow tables, for adapters that need what NumPy hides (a float column's nulls)."""
        while True:
            try:
                table = self._next_table()
            except StopIteration:
                return
            yield table

    def _next_table(self, raise_if_stopped: bool = False) -> pa.Table:
        with self._next_lock:
            batches = self._start()
            if batches is None:
                if raise_if_stopped:
                    self._check_not_stopped()
                raise StopIteration
            started = time.perf_counter()
            try:
                return next(batches)
            except CancelledError:
                if self._stopped:  # stop() from another thread cancelled the read we waited for
                    if raise_if_stopped:
                        self._check_not_stopped()
                    raise StopIteration from None
                self._ended = True
                self.stop()
                raise
            except BaseException:  # StopIteration (the last epoch is read) included: end the threads
                self._ended = True
                self.stop()
                raise
            finally:
                if _metrics.ON:  # the training loop's wait: RunResult.metrics
                    _metrics.loader_waited(time.perf_counter() - started)

    def _check_not_stopped(self) -> None:
        """Raise Petastorm's RuntimeError where the reader was stopped (``stop()``, or its ``with`` block left)
        before its last epoch was read."""
        if self._stopped and not self._ended:
            raise RuntimeError(
                "This reader was stopped (stop() was called, or its 'with' block was left) and is read again; a stopped "
                "reader yields nothing more. Read inside the 'with' block, or build a new reader (resume_from= starts it "
                "where this one stood)."
            )

    def stop(self) -> None:
        """Stop reading: cancel prefetches not started, wait for running ones; no thread is left running."""
        with self._lock:
            self._stopped = True
            prefetcher = self._prefetcher
        if prefetcher is not None:
            prefetcher.close()

    def join(self) -> None:
        """Wait for the reader's threads to end (Petastorm's API; stop() already waits)."""
        self.stop()

    def __enter__(self) -> Reader:
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()
        self.join()


def _build(
    dataset_url_or_urls, *, cur_shard, shard_count, num_epochs, shuffle_row_groups, shuffle_rows, seed,
    schema_fields, filters, batch_size, equal_steps, workers_count, step_rows=None, resume_from=None,
    resume_unit="batch", petastorm: Options = Options(), partitions=None, described_as: str | None = None,
    decode=None, fill_missing: bool = False, global_order: bool = False,
) -> Reader:
    cur_shard, shard_count = _check_shard(cur_shard, shard_count)
    num_epochs = _check_positive("num_epochs", num_epochs, True, "pass None to read forever, or a positive number of epochs.")
    batch_size = _check_positive("batch_size", batch_size, True, "pass None to yield row groups as read, or a positive batch size.")
    workers_count = _check_positive("workers_count", workers_count, False, f"pass a positive number of threads (default {DEFAULT_WORKERS}).")
    seed = _check_seed(seed)
    resume_from = _check_resume(resume_from, resume_unit)
    if global_order and batch_size is None:
        raise ValueError("global_order=True deals the rows to the shards in batches, so it needs a batch_size; pass "
                         "batch_size= (the rows each shard yields per step), or global_order=False.")
    if petastorm.single_thread:  # reader_pool_type='dummy'
        workers_count = 1
    dataset = open_dataset(dataset_url_or_urls, schema_fields=schema_fields, filters=filters, workers=workers_count,
                           storage_options=petastorm.storage_options, filesystem=petastorm.filesystem,
                           partitions=partitions, described_as=described_as, fill_missing=fill_missing)
    total = dataset.num_rows
    if total < shard_count:
        after = f" after filters {dataset.filter}" if dataset.filter is not None else ""
        fix = f"use at most {total} shards, or a larger dataset" if total else "point the reader at a dataset with rows"
        if after:
            fix += " or looser filters"
        raise EmptyShardError(
            f"The dataset {dataset.url} has {total} rows{after} across {len(dataset.files)} file(s), fewer than "
            f"shard_count={shard_count}, so shards {total} to {shard_count - 1} (this reader is shard {cur_shard}) "
            f"would be empty; {fix}."
        )
    return Reader(
        dataset, cur_shard=cur_shard, shard_count=shard_count, num_epochs=num_epochs,
        shuffle_row_groups=bool(shuffle_row_groups), shuffle_rows=bool(shuffle_rows), seed=resolve_seed(seed),
        batch_size=batch_size, equal_steps=bool(equal_steps), workers_count=workers_count, step_rows=step_rows,
        resume_from=resume_from, resume_unit=resume_unit, decode=_decode.check(decode, dataset.schema.names),
        global_order=bool(global_order),
    )


def make_batch_reader(
    dataset_url_or_urls: str | os.PathLike | Sequence[str | os.PathLike],
    *,
    cur_shard: int | None = None,
    shard_count: int | None = None,
    num_epochs: int | None = 1,
    shuffle_row_groups: bool = True,
    shuffle_rows: bool = False,
    seed: int | None = None,
    schema_fields: Sequence[str] | None = None,
    filters=None,
    batch_size: int | None = None,
    equal_steps: bool = True,
    workers_count: int = DEFAULT_WORKERS,
    resume_from: tuple[int, int] | None = None,
    decode: dict | None = None,
    global_order: bool = False,
    **petastorm_args,
) -> Reader:
    """A reader of one shard of a Parquet dataset, yielding namedtuples of NumPy arrays (one per column).

    ``dataset_url_or_urls``: a directory of Parquet files (searched recursively; names starting
    with ``_`` or ``.`` are skipped), a single file, or a list of them; local paths and
    ``file://`` URLs, and other filesystems through ``pyarrow.fs.FileSystem.from_uri``
    (``s3://`` tested against an S3-protocol server, ``gs://``, ``hdfs://``); see docs/data.md.

    Sharding: ``cur_shard``/``shard_count`` default to ``hvd.rank()``/``hvd.size()`` of an
    initialized ``sparkhvd.collective.torch``, else ``(0, 1)``. Each epoch the row groups are
    laid end to end (shuffled by ``(seed, epoch)`` when ``shuffle_row_groups``) and the rows cut
    into ``shard_count`` contiguous ranges whose sizes differ by at most one row, so every row
    is in exactly one shard. More shards than rows raises ``EmptyShardError``.

    ``global_order=True`` (needs ``batch_size``) deals the rows instead, in batches: step ``s``
    of shard ``k`` reads the epoch's rows from ``(s * shard_count + k) * batch_size``, so the
    job's steps read the epoch in one order at any ``shard_count`` (an elastic run resized,
    or a rerun at another size, sees the rows in the same sequence), and ``shuffle_rows``
    permutes each row group's rows by ``(seed, epoch, row group)``, the same in every shard.
    The cost: a shard reads each row group that holds one of its batches, so with row groups
    of more than ``shard_count * batch_size`` rows every shard reads every row group (about
    ``shard_count`` times the reads of the default, less with ``schema_fields``). The last
    step's rows, fewer than ``shard_count * batch_size``: with ``equal_steps`` one batch per
    shard, sizes differing by at most one (left out when they are fewer than the shards);
    without, dealt in batches of ``batch_size`` as far as they go.

    ``seed``: every rank must pass the same seed, or shards overlap and miss rows; ``None``
    means 0, so ranks agree without communicating (pass another value to change the order).
    Orders are deterministic for a given ``(seed, epoch)`` and differ between epochs.
    ``shuffle_rows`` shuffles rows within each row-group slice the shard reads.

    ``num_epochs``: how many passes; ``None`` reads forever. ``schema_fields``: the columns to
    read, in the order yielded (default all). ``filters``: a ``pyarrow.dataset`` expression or a
    DNF list as in ``pyarrow.parquet`` (``[('label', '=', 3)]``); they are evaluated once when
    the reader is built (reading only the filter's columns) so the plan balances the rows that
    pass. ``workers_count``: threads that prefetch row groups; the reader holds at most
    ``workers_count + 3`` row groups in memory (``workers_count + 2`` read ahead and the one
    being cut into batches), plus those a batch spans when batches are larger than row groups.

    Batches and ``equal_steps`` (let ``m = rows_after_filters // shard_count``; shards hold
    ``m`` or ``m + 1`` rows each epoch):

    - ``batch_size=None, equal_steps=False``: one batch per row-group slice, as read; every
      row exactly once per epoch; batch counts may differ between shards.
    - ``batch_size=None, equal_steps=True`` (default): every row exactly once per epoch; each
      shard splits its rows into ``ceil(m / g)`` batches whose sizes differ by at most one,
      the same count on every shard, where ``g = ceil(rows_after_filters / row groups)`` is
      the mean row-group size (batches may span row groups).
    - ``batch_size=b, equal_steps=False``: batches of ``b`` rows, the last of each epoch short;
      every row exactly once per epoch.
    - ``batch_size=b, equal_steps=True``: every shard yields ``ceil(m / b)`` batches per epoch,
      all of ``b`` rows but the last. When ``m`` is a multiple of ``b``, the shards holding
      ``m + 1`` rows leave out their last row that epoch (one row per such shard, at most
      ``shard_count - 1`` rows per epoch in all); otherwise every row is read.

    Batches never cross an epoch boundary. Columns: numbers as 1-D arrays (zero-copy, read-only
    when there are no nulls), strings as object arrays, ``fixed_size_list`` columns and
    ``list`` columns whose rows in the batch all have one length as 2-D ``(n, length)``
    arrays, ragged lists as object arrays of 1-D arrays.

    ``resume_from=(epoch, batch)``: start where an uninterrupted reader with the same arguments
    stood after yielding ``batch`` batches of epoch ``epoch`` (both counted from 0, on this
    shard, as yielded: batches of ``batch_size`` rows, or of the plan's sizes when it is None),
    such as the position an elastic run's last commit recorded. The reader then yields exactly
    what that reader would have yielded from there on: the same rows, batches and order, up to
    the same last epoch (``num_epochs`` counts every epoch, not those left), so each row is
    still read once per epoch. Orders depend only on ``seed``, the epoch and the shard, so they
    are reproducible with any seed (``None`` is 0), but every argument that shapes the plan
    must be the interrupted run's: the dataset, ``filters``, ``cur_shard``, ``shard_count``,
    ``seed``, ``shuffle_row_groups``, ``shuffle_rows``, ``batch_size`` and ``equal_steps``
    (``schema_fields`` and ``workers_count`` may change). ``batch`` runs from 0 to the epoch's
    batch count (``reader.plan(epoch).num_batches``), which means the epoch was finished, as
    ``(epoch + 1, 0)`` does; ``(num_epochs, 0)`` yields nothing, and a position past these
    raises ``ValueError``. Row groups whose rows all fall in skipped batches are never read
    (only footers are, when the reader is built); the one the first batch starts in is read
    whole (Parquet reads whole row groups, and ``shuffle_rows`` permutes them whole) and its
    skipped rows dropped. See docs/data.md for a commit loop and the loaders' epoch count.

    Use it as an iterator, preferably in ``with``: ``with make_batch_reader(url) as reader:
    for batch in reader: ...``. ``stop()`` ends the prefetch threads; an error in one is
    raised in the consuming thread. A reader is read once; dropping the last reference to it
    also ends its threads. After ``stop()`` (or the ``with`` block), ``next()`` raises
    RuntimeError, as Petastorm's does; a reader read to its end raises StopIteration. Threads
    may share one reader: each batch goes to one of them.

    ``decode={column: fn}``: ``fn(cell)`` turns each cell of the column (``bytes`` for a binary
    column) into a NumPy array, in the prefetch threads, ahead of the loop (an image decoder, for
    example); the cells of a row group must decode to one shape and dtype, and a batch's column
    is then one ``(rows, *shape)`` array (docs/data.md). Binary columns without it are ``bytes``.

    ``petastorm_args``: Petastorm's other arguments. ``storage_options`` (fsspec's options for the
    URL) and ``filesystem`` (a pyarrow or fsspec filesystem the paths are on) are used;
    ``reader_pool_type='dummy'`` reads in one thread; ``'thread'``/``'process'``,
    ``shard_seed``, ``hdfs_driver``, ``zmq_copy_buffers`` and the cache settings of
    ``cache_type='null'`` are accepted (noted once where they would ask for something);
    ``predicate``, ``rowgroup_selector``, ``transform_spec``, ``shuffle_row_drop_partitions > 1``
    and ``cache_type='local-disk'`` are refused with ValueError. docs/data.md lists each one.
    """
    return _build(
        dataset_url_or_urls, cur_shard=cur_shard, shard_count=shard_count, num_epochs=num_epochs,
        shuffle_row_groups=shuffle_row_groups, shuffle_rows=shuffle_rows, seed=seed, schema_fields=schema_fields,
        filters=filters, batch_size=batch_size, equal_steps=equal_steps, workers_count=workers_count,
        resume_from=resume_from, petastorm=take("make_batch_reader", petastorm_args), decode=decode,
        global_order=global_order,
    )
