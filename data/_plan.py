"""The shard plan: which rows each shard reads in an epoch, and how they are cut into batches.

Pure functions, no I/O (metadata is read in ``_metadata.py``). The rule:

1. The dataset is a list of *pieces*, one per non-empty row group, each with the number of
   rows it holds after ``filters``.
2. Each epoch orders the pieces (a permutation seeded by ``(seed, epoch)`` when
   ``shuffle_row_groups``, file order otherwise) and lays them end to end in one global row
   space ``[0, total_rows)``.
3. That row space is cut into ``shard_count`` contiguous ranges whose sizes differ by at most
   one row: shard ``k`` gets ``total_rows // shard_count`` rows, plus one when
   ``k < total_rows % shard_count``. A piece that straddles a cut is split by row range, so
   every row lands in exactly one shard, and ``shard_count`` may exceed the number of row
   groups (but not the number of rows).

Every shard of a job computes the same plan from the same metadata and seed, with no
communication; that is why the seed must be the same on every rank (``seed=None`` means 0).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator, Sequence

import numpy as np


@dataclass(frozen=True)
class Piece:
    """One row group of one file, with its row count after filters."""

    path: str
    row_group: int
    num_rows: int


@dataclass(frozen=True)
class Slice:
    """Rows ``[start, stop)`` of ``pieces[piece]`` (row numbers after filters)."""

    piece: int
    start: int
    stop: int

    @property
    def num_rows(self) -> int:
        """The number of rows in the slice."""
        return self.stop - self.start


@dataclass(frozen=True)
class ResumePoint:
    """Where an epoch stands, at any number of shards: the rows of epoch ``epoch`` not yet read, as ``[start, stop)``
    ranges of its row space (``Reader.resume_point``), and what the row space depends on: the dataset's rows after
    filters, the seed and ``shuffle_row_groups``. Plain data: it pickles into an elastic state's commit."""

    epoch: int
    remaining: tuple[tuple[int, int], ...]
    rows: int
    seed: int
    shuffle_row_groups: bool

    @property
    def rows_left(self) -> int:
        """The rows of the epoch still to read."""
        return sum(b - a for a, b in self.remaining)


def resolve_seed(seed: int | None) -> int:
    """The seed every shard uses: ``seed``, or 0 when it is None (see the module docstring)."""
    return 0 if seed is None else seed


def epoch_order(num_pieces: int, *, shuffle: bool, seed: int, epoch: int) -> list[int]:
    """The order of the pieces in ``epoch``: a permutation seeded by ``(seed, epoch)``, or file order."""
    if not shuffle:
        return list(range(num_pieces))
    return np.random.default_rng([seed, epoch]).permutation(num_pieces).tolist()


def shard_range(total_rows: int, shard_count: int, cur_shard: int) -> tuple[int, int]:
    """The global rows ``[lo, hi)`` of shard ``cur_shard``; sizes differ by at most one row."""
    base, extra = divmod(total_rows, shard_count)
    lo = cur_shard * base + min(cur_shard, extra)
    return lo, lo + base + (1 if cur_shard < extra else 0)


def rows_to_read(shard_rows: int, min_shard_rows: int, step_rows: int | None) -> int:
    """How many of its ``shard_rows`` a shard reads so that every shard takes the same number of steps.

    ``step_rows`` is the fixed batch size (None: no fixed size, every row is read). Shards
    hold ``m = min_shard_rows`` or ``m + 1`` rows; all of them take ``ceil(m / step_rows)``
    steps, so a shard with ``m + 1`` rows leaves out its last row exactly when ``m`` is a
    multiple of ``step_rows`` (that row would start a step the other shards do not take).
    """
    if step_rows is None:
        return shard_rows
    return min(shard_rows, math.ceil(min_shard_rows / step_rows) * step_rows)


def slices_in_range(pieces: Sequence[Piece], order: Sequence[int], lo: int, hi: int) -> list[Slice]:
    """The piece slices that cover global rows ``[lo, hi)`` when pieces are laid out in ``order``."""
    out: list[Slice] = []
    offset = 0
    for index in order:
        n = pieces[index].num_rows
        start, stop = max(lo, offset), min(hi, offset + n)
        if start < stop:
            out.append(Slice(index, start - offset, stop - offset))
        offset += n
        if offset >= hi:
            break
    return out


def even_split(rows: int, parts: int) -> tuple[tuple[int, int], ...]:
    """``rows`` split into ``parts`` sizes that differ by at most one, larger ones first, as (size, count) runs."""
    base, extra = divmod(rows, parts)
    return tuple(run for run in ((base + 1, extra), (base, parts - extra)) if run[1])


@dataclass(frozen=True)
class EpochPlan:
    """What one shard reads in one epoch, and the sizes of the batches it yields."""

    slices: tuple[Slice, ...]
    size_runs: tuple[tuple[int, int], ...] | None  # (size, count) runs; None: one batch per slice

    @property
    def num_rows(self) -> int:
        """The rows the shard reads this epoch."""
        return sum(s.num_rows for s in self.slices)

    @property
    def num_batches(self) -> int:
        """The batches the shard yields this epoch."""
        if self.size_runs is None:
            return len(self.slices)
        return sum(count for _, count in self.size_runs)

    def batch_sizes(self, skip_rows: int = 0) -> Iterator[int]:
        """The sizes of the batches the shard yields this epoch, in order, from its row ``skip_rows`` on.

        Batches wholly before ``skip_rows`` are left out; a batch that ``skip_rows`` cuts is
        shortened to its rows from there (a resumed reader starts on a batch boundary, so none is).
        """
        if self.size_runs is None:
            sizes: Iterator[int] = (s.num_rows for s in self.slices)
        else:
            sizes = (size for size, count in self.size_runs for _ in range(count))
        end = 0
        for size in sizes:
            end += size
            if end > skip_rows:
                yield min(size, end - skip_rows)

    def rows_before(self, batch: int) -> int:
        """The rows in the epoch's first ``batch`` batches (all of them when ``batch`` is past the last)."""
        if self.size_runs is None:
            return sum(s.num_rows for s in self.slices[:batch])
        rows = 0
        for size, count in self.size_runs:
            taken = min(count, batch)
            rows, batch = rows + taken * size, batch - taken
        return rows

    def start_at(self, skip_rows: int) -> tuple[int, int]:
        """Where reading the epoch from its row ``skip_rows`` starts: ``(slice index, leading rows of that slice to drop)``.

        Slices wholly before ``skip_rows`` are never read; ``(len(slices), 0)`` when none is left.
        """
        for index, piece_slice in enumerate(self.slices):
            if skip_rows < piece_slice.num_rows:
                return index, skip_rows
            skip_rows -= piece_slice.num_rows
        return len(self.slices), 0


def plan_epoch(
    pieces: Sequence[Piece],
    *,
    shard_count: int,
    cur_shard: int,
    epoch: int,
    seed: int,
    shuffle_row_groups: bool,
    batch_size: int | None,
    equal_steps: bool,
    step_rows: int | None = None,
    remaining: Sequence[tuple[int, int]] | None = None,
) -> EpochPlan:
    """The plan of shard ``cur_shard`` for ``epoch`` (see the module docstring and make_batch_reader).

    Batch sizes: ``batch_size`` set: full batches of ``batch_size``, the last one short.
    ``batch_size=None`` with ``equal_steps``: the shard's rows split into
    ``ceil(min_shard_rows / mean_piece_rows)`` near-equal batches, the same count on every
    shard. ``batch_size=None`` without ``equal_steps``: one batch per slice, as read.
    ``step_rows`` overrides the unit of the equal-steps truncation (the row reader passes 1).
    Raises ``ValueError`` when a shard would be empty; callers check that first with a
    message that names the dataset.

    ``remaining``: the rows of the epoch still to read, as ``[start, stop)`` ranges of its row
    space in order (a ``ResumePoint``'s, after a resize): they are laid end to end and cut into
    the shards instead of the whole row space.
    """
    total = sum(p.num_rows for p in pieces)
    rows_left = total if remaining is None else sum(b - a for a, b in remaining)
    if rows_left < shard_count:
        raise ValueError(f"{rows_left} rows cannot fill {shard_count} shards.")
    min_rows = rows_left // shard_count
    lo, hi = shard_range(rows_left, shard_count, cur_shard)
    if step_rows is None:
        step_rows = batch_size
    if equal_steps:
        hi = lo + rows_to_read(hi - lo, min_rows, step_rows)
    order = epoch_order(len(pieces), shuffle=shuffle_row_groups, seed=seed, epoch=epoch)
    if remaining is None:
        slices = tuple(slices_in_range(pieces, order, lo, hi))
    else:
        slices = tuple(piece_slice for a, b in ranges_of(remaining, lo, hi)
                       for piece_slice in slices_in_range(pieces, order, a, b))
    rows = hi - lo
    if batch_size is not None:
        full, rest = divmod(rows, batch_size)
        runs = tuple(run for run in ((batch_size, full), (rest, 1 if rest else 0)) if run[1])
    elif equal_steps:
        nonempty = sum(1 for p in pieces if p.num_rows)
        mean_piece_rows = math.ceil(total / nonempty)
        runs = even_split(rows, math.ceil(min_rows / mean_piece_rows))
    else:
        runs = None
    return EpochPlan(slices, runs)


def ranges_of(remaining: Sequence[tuple[int, int]], lo: int, hi: int) -> list[tuple[int, int]]:
    """Rows ``[lo, hi)`` of ``remaining`` laid end to end, as ranges of the epoch's row space, in order."""
    out, offset = [], 0
    for a, b in remaining:
        start, stop = max(lo, offset), min(hi, offset + b - a)
        if start < stop:
            out.append((a + start - offset, a + stop - offset))
        offset += b - a
        if offset >= hi:
            break
    return out


def merged(ranges: Sequence[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    """``ranges`` sorted, with those that touch or overlap joined, and empty ones left out."""
    out: list[list[int]] = []
    for a, b in sorted(r for r in ranges if r[1] > r[0]):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return tuple((a, b) for a, b in out)


def iter_epochs(num_epochs: int | None, start: int = 0) -> Iterator[int]:
    """Epoch numbers ``start``, ``start + 1``, ... up to ``num_epochs - 1``, or forever when it is None."""
    epoch = start
    while num_epochs is None or epoch < num_epochs:
        yield epoch
        epoch += 1
