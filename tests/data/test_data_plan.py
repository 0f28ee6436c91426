"""Property tests of the pure shard plan (sparkhvd.data._plan): no I/O."""

from __future__ import annotations

import math
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sparkhvd.data._plan import Piece, epoch_order, plan_epoch, rows_to_read, shard_range, slices_in_range

pytestmark = pytest.mark.unit

piece_sizes = st.lists(st.integers(0, 40), min_size=1, max_size=30)


def pieces_of(sizes):
    return [Piece(f"f{i // 6}", i % 6, n) for i, n in enumerate(sizes)]


def plans(pieces, shard_count, **kw):
    base = dict(epoch=0, seed=0, shuffle_row_groups=True, batch_size=None, equal_steps=False)
    base.update(kw)
    return [plan_epoch(pieces, shard_count=shard_count, cur_shard=k, **base) for k in range(shard_count)]


def covered_rows(pieces, plan):
    return [(s.piece, r) for s in plan.slices for r in range(s.start, s.stop)]


@settings(max_examples=200, deadline=None)
@given(sizes=piece_sizes, shard_count=st.integers(1, 50), epoch=st.integers(0, 5), shuffle=st.booleans())
def test_every_row_in_exactly_one_shard(sizes, shard_count, epoch, shuffle):
    pieces = pieces_of(sizes)
    total = sum(sizes)
    if total < shard_count:
        with pytest.raises(ValueError, match="cannot fill"):
            plans(pieces, shard_count)
        return
    ps = plans(pieces, shard_count, epoch=epoch, shuffle_row_groups=shuffle)
    seen = Counter(row for p in ps for row in covered_rows(pieces, p))
    assert seen == Counter((i, r) for i, n in enumerate(sizes) for r in range(n))
    sizes_per_shard = [p.num_rows for p in ps]
    assert max(sizes_per_shard) - min(sizes_per_shard) <= 1
    assert min(sizes_per_shard) >= 1


@settings(max_examples=200, deadline=None)
@given(sizes=piece_sizes, shard_count=st.integers(1, 50), batch_size=st.none() | st.integers(1, 30))
def test_equal_steps_gives_every_shard_the_same_batch_count(sizes, shard_count, batch_size):
    pieces = pieces_of(sizes)
    total = sum(sizes)
    if total < shard_count:
        return
    ps = plans(pieces, shard_count, batch_size=batch_size, equal_steps=True)
    assert len({p.num_batches for p in ps}) == 1
    m = total // shard_count
    for p in ps:
        batch_sizes = list(p.batch_sizes())
        assert sum(batch_sizes) == p.num_rows and min(batch_sizes) >= 1
        if batch_size is None:  # nothing dropped
            assert p.num_rows in (m, m + 1)
        else:
            assert p.num_batches == math.ceil(m / batch_size)
            assert all(b == batch_size for b in batch_sizes[:-1])
    dropped = total - sum(p.num_rows for p in ps)
    if batch_size is None or m % batch_size:
        assert dropped == 0
    else:
        assert dropped == total % shard_count


@settings(max_examples=100, deadline=None)
@given(sizes=piece_sizes, shard_count=st.integers(1, 20), batch_size=st.integers(1, 30))
def test_batches_without_equal_steps_read_every_row(sizes, shard_count, batch_size):
    pieces = pieces_of(sizes)
    if sum(sizes) < shard_count:
        return
    for p in plans(pieces, shard_count, batch_size=batch_size):
        batch_sizes = list(p.batch_sizes())
        assert sum(batch_sizes) == p.num_rows
        assert all(b == batch_size for b in batch_sizes[:-1]) and 1 <= batch_sizes[-1] <= batch_size


def test_shard_range_examples():
    assert [shard_range(10, 3, k) for k in range(3)] == [(0, 4), (4, 7), (7, 10)]
    assert [shard_range(3, 3, k) for k in range(3)] == [(0, 1), (1, 2), (2, 3)]


def test_rows_to_read_drops_only_a_row_that_would_add_a_step():
    assert rows_to_read(11, 10, 5) == 10  # m=10 is a multiple of 5: the 11th row would be a 3rd step
    assert rows_to_read(11, 10, 4) == 11  # ceil(10/4) == ceil(11/4) == 3
    assert rows_to_read(10, 10, 5) == 10
    assert rows_to_read(11, 10, None) == 11


def test_order_is_deterministic_per_seed_and_epoch_and_differs_between_epochs():
    assert epoch_order(20, shuffle=True, seed=7, epoch=1) == epoch_order(20, shuffle=True, seed=7, epoch=1)
    assert epoch_order(20, shuffle=True, seed=7, epoch=1) != epoch_order(20, shuffle=True, seed=7, epoch=2)
    assert epoch_order(20, shuffle=True, seed=7, epoch=1) != epoch_order(20, shuffle=True, seed=8, epoch=1)
    assert epoch_order(5, shuffle=False, seed=7, epoch=3) == [0, 1, 2, 3, 4]


def test_a_row_group_straddling_a_cut_is_split_by_rows():
    pieces = pieces_of([10])
    assert slices_in_range(pieces, [0], 3, 7)[0].start == 3
    assert [p.slices for p in plans(pieces, 3, shuffle_row_groups=False)] == [
        tuple(slices_in_range(pieces, [0], lo, hi)) for lo, hi in [(0, 4), (4, 7), (7, 10)]
    ]
