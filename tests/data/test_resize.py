"""Resuming an epoch at another number of shards (an elastic run resized mid-epoch): ``Reader.resume_point`` and
``make_batch_reader(resume_from=point)``, on real files, at np 4 -> 3 -> 4."""

from __future__ import annotations

from collections import Counter

import pytest

from sparkhvd.data import EmptyShardError, ResumePoint, make_batch_reader

pytestmark = pytest.mark.unit


def _layout(dataset, shards: int, **kwargs) -> list:
    return [make_batch_reader(dataset, cur_shard=k, shard_count=shards, num_epochs=1, seed=7, **kwargs)
            for k in range(shards)]


def _take(readers, batches: int) -> list:
    """Every shard's next ``batches`` batches' ids (a step of the job takes one batch of every shard)."""
    return [i for reader in readers for _ in range(batches) for i in next(reader).id.tolist()]




@pytest.mark.parametrize("batch_size", [None, 6])
def test_an_epoch_resized_from_4_to_3_to_4_shards_reads_every_row_once(wide, batch_size, point_of):
    dataset = wide
    seen = _take(first := _layout(dataset, 4, batch_size=batch_size), 1)
    point = point_of(first, 0, 1)
    assert point.epoch == 0 and point.rows_left == 240 - len(seen)
    seen += _take(second := _layout(dataset, 3, batch_size=batch_size, resume_from=point), 1)
    point = point_of(second, 0, 1)
    last = _layout(dataset, 4, batch_size=batch_size, resume_from=point)
    steps = {len(list(reader)) for reader in last}
    assert len(steps) == 1  # equal steps at the new size
    for reader in _layout(dataset, 4, batch_size=batch_size, resume_from=point):
        with reader:
            seen += [i for batch in reader for i in batch.id.tolist()]
    counts = Counter(seen)
    assert max(counts.values()) == 1  # no row twice
    missing = set(range(240)) - set(counts)
    if batch_size is None:
        assert not missing  # every row, once
    else:  # equal_steps leaves out at most one row per shard of the last layout, as an uninterrupted epoch does
        assert len(missing) <= 3


def test_a_finished_epoch_resumes_at_the_next_whole_one_and_bad_points_are_refused(dataset, point_of):
    readers = _layout(dataset, 4)
    end = readers[0].plan(0).num_batches
    assert point_of(readers, 0, end) == ResumePoint(1, ((0, 100),), 100, 7, True)
    with pytest.raises(ValueError, match=r"This ResumePoint was taken from a reader of 100 rows with seed=7, .* and "
                                         r"this reader has 100 rows with seed=8"):
        make_batch_reader(dataset, seed=8, resume_from=ResumePoint(0, ((0, 10),), 100, 7, True))
    with pytest.raises(EmptyShardError, match=r"The ResumePoint leaves 2 rows of epoch 0, fewer than shard_count=3"):
        make_batch_reader(dataset, seed=7, cur_shard=0, shard_count=3, resume_from=ResumePoint(0, ((5, 7),), 100, 7, True))
    with pytest.raises(ValueError, match=r"resume_point needs a reader with equal_steps=True, and shuffle_rows=False unless global_order=True "
                                         r"\(this one has equal_steps=True, shuffle_rows=True, global_order=False\)"):
        make_batch_reader(dataset, shuffle_rows=True).resume_point(0, 1)
    with pytest.raises(ValueError, match=r"resume_point\(0, 99\): shard 0 of 1 has \d+ batches in epoch 0"):
        make_batch_reader(dataset).resume_point(0, 99)


def test_a_url_loader_refuses_a_resume_point_and_says_what_takes_it(dataset):
    from sparkhvd.data.torch import make_torch_loader

    point = ResumePoint(0, ((0, 50),), 100, 7, True)
    with pytest.raises(ValueError, match=r"A loader over a URL does not take a ResumePoint .* build the reader with "
                                         r"make_batch_reader\(url, ..., resume_from=point\) and pass it to the loader"):
        make_torch_loader(dataset, seed=7, resume_from=point)
    with make_torch_loader(make_batch_reader(dataset, seed=7, resume_from=point, batch_size=10), batch_size=None) as loader:
        assert sum(len(b["id"]) for b in loader) == 50
