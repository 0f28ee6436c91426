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

With ``global_order`` the row space is dealt instead of cut, in batches of ``batch_size``
rows: step ``s`` of shard ``k`` reads rows ``[(s * shard_count + k) * batch_size, ... +
batch_size)``, so the job's steps, taken in order and each in shard order, read the row space
from its start to its end whatever ``shard_count`` is (Mosaic Streaming's "elastic
determinism"). ``shuffle_rows`` then permutes each row group's rows by ``(seed, epoch, row
group)`` before they are dealt, which keeps the row space the same at any ``shard_count`` too.
The last step's rows, fewer than ``shard_count * batch_size``, are split as ``equal_steps``
says (see ``interleaved``).

Every shard of a job computes the same plan from the same metadata and seed, with no
communication; that is why the seed must be the same on every rank (``seed=None`` means 0).
"""

from __future__ import annotations

import math
from bisect import bisect_right
from dataclasses import dataclass
from itertools import accumulate
from typing import Iterable, Iterator, Sequence

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
    filters, the seed, ``shuffle_row_groups``, and ``shuffled_rows`` (the row groups' rows permuted in the row space
    itself: a ``global_order`` reader's ``shuffle_rows``). Plain data: it pickles into an elastic state's commit."""

    epoch: int
    remaining: tuple[tuple[int, int], ...]
    rows: int
    seed: int
    shuffle_row_groups: bool
    shuffled_rows: bool = False

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
    return slices_of_ranges(pieces, order, [(lo, hi)])


def slices_of_ranges(pieces: Sequence[Piece], order: Sequence[int], ranges: Iterable[tuple[int, int]]) -> list[Slice]:
    """The piece slices that cover the global rows of ``ranges``, in order, when pieces are laid out in ``order``."""
    ends = list(accumulate(pieces[index].num_rows for index in order))
    out: list[Slice] = []
    for lo, hi in ranges:
        position = bisect_right(ends, lo)
        while lo < hi and position < len(ends):
            end = ends[position]
            stop = min(hi, end)
            if stop > lo:  # an empty piece covers nothing
                offset = end - pieces[order[position]].num_rows
                out.append(Slice(order[position], lo - offset, stop - offset))
                lo = stop
            position += 1
    return out


def interleaved(rows: int, shard_count: int, cur_shard: int, batch_size: int, equal_steps: bool) -> list[tuple[int, int]]:
    """The batches of shard ``cur_shard`` as ``[start, stop)`` ranges of ``rows`` rows dealt in turn (``global_order``).

    Step ``s`` of every shard reads the row space's rows ``[s * shard_count * batch_size, (s + 1) * shard_count *
    batch_size)``, shard ``k`` the ``k``-th ``batch_size`` of them. The last step's rows, fewer than that: with
    ``equal_steps`` split into ``shard_count`` parts whose sizes differ by at most one (left out when there are fewer
    rows than shards, at most ``shard_count - 1`` rows, so every shard takes the same steps); without, dealt in
    batches of ``batch_size`` as far as they go (the shards after them take a step fewer).
    """
    step_rows = shard_count * batch_size
    full, tail = divmod(rows, step_rows)
    out = [(s * step_rows + cur_shard * batch_size, s * step_rows + (cur_shard + 1) * batch_size) for s in range(full)]
    base = full * step_rows
    if equal_steps and tail >= shard_count:
        lo, hi = shard_range(tail, shard_count, cur_shard)
        out.append((base + lo, base + hi))
    elif not equal_steps and tail > cur_shard * batch_size:
        out.append((base + cur_shard * batch_size, base + min(tail, (cur_shard + 1) * batch_size)))
    return out


def size_runs_of(sizes: Iterable[int]) -> tuple[tuple[int, int], ...]:
    """``sizes`` as (size, count) runs of equal neighbours."""
    runs: list[list[int]] = []
    for size in sizes:
        if runs and runs[-1][0] == size:
            runs[-1][1] += 1
        else:
            runs.append([size, 1])
    return tuple((size, count) for size, count in runs)


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
    global_order: bool = False,
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

    ``global_order`` (needs ``batch_size``): the rows are dealt in batches instead of cut into
    ranges (``interleaved``), so the job's order over the row space does not depend on ``shard_count``.
    """
    total = sum(p.num_rows for p in pieces)
    rows_left = total if remaining is None else sum(b - a for a, b in remaining)
    if rows_left < shard_count:
        raise ValueError(f"{rows_left} rows cannot fill {shard_count} shards.")
    order = epoch_order(len(pieces), shuffle=shuffle_row_groups, seed=seed, epoch=epoch)
    if global_order:
        if batch_size is None:
            raise ValueError("global_order needs a batch_size.")
        batches = interleaved(rows_left, shard_count, cur_shard, batch_size, equal_steps)
        spans = batches if remaining is None else (r for a, b in batches for r in ranges_of(remaining, a, b))
        return EpochPlan(tuple(slices_of_ranges(pieces, order, spans)), size_runs_of(b - a for a, b in batches))
    min_rows = rows_left // shard_count
    lo, hi = shard_range(rows_left, shard_count, cur_shard)
    if step_rows is None:
        step_rows = batch_size
    if equal_steps:
        hi = lo + rows_to_read(hi - lo, min_rows, step_rows)
    spans = [(lo, hi)] if remaining is None else ranges_of(remaining, lo, hi)
    slices = tuple(slices_of_ranges(pieces, order, spans))
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
