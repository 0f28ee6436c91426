"""Property tests of real sharded reads: random Parquet layouts, every shard read by its own reader."""

from __future__ import annotations

import tempfile
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sparkhvd.data import make_batch_reader

pytestmark = pytest.mark.unit

layouts = st.lists(st.lists(st.integers(1, 30), min_size=1, max_size=6), min_size=1, max_size=5)
shard_counts = st.integers(1, 12)
batch_sizes = st.none() | st.integers(1, 20)
SETTINGS = settings(max_examples=30, deadline=None)


def read_shards(writer, layout, shard_count, **kwargs):
    """Write ``layout``, read every shard; return (all ids, ids per shard, batch sizes per shard)."""
    with tempfile.TemporaryDirectory() as tmp:
        ids = writer(Path(tmp) / "ds", layout)
        shard_count = min(shard_count, len(ids))
        per_shard, batches = [], []
        for k in range(shard_count):
            with make_batch_reader(Path(tmp) / "ds", cur_shard=k, shard_count=shard_count, workers_count=2, **kwargs) as reader:
                got = list(reader)
            per_shard.append([i for b in got for i in b.id.tolist()])
            batches.append([len(b.id) for b in got])
        return ids, per_shard, batches


@SETTINGS
@given(layout=layouts, shard_count=shard_counts, batch_size=batch_sizes, shuffle=st.booleans())
def test_every_row_is_read_exactly_once_per_epoch(writer, layout, shard_count, batch_size, shuffle):
    ids, per_shard, _ = read_shards(writer, layout, shard_count, batch_size=batch_size, equal_steps=False, shuffle_row_groups=shuffle, num_epochs=2)
    assert Counter(i for shard in per_shard for i in shard) == Counter(ids * 2)


@SETTINGS
@given(layout=layouts, shard_count=shard_counts, batch_size=batch_sizes)
def test_shard_sizes_differ_by_at_most_one_row(writer, layout, shard_count, batch_size):
    _, per_shard, batches = read_shards(writer, layout, shard_count, batch_size=batch_size, equal_steps=False)
    sizes = [len(s) for s in per_shard]
    assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1
    if batch_size is not None:
        assert all(b == batch_size for shard in batches for b in shard[:-1])


@SETTINGS
@given(layout=layouts, shard_count=shard_counts, batch_size=batch_sizes)
def test_equal_steps_gives_every_shard_the_same_number_of_batches(writer, layout, shard_count, batch_size):
    ids, per_shard, batches = read_shards(writer, layout, shard_count, batch_size=batch_size, num_epochs=2, seed=3)
    assert len({len(b) for b in batches}) == 1
    read = Counter(i for shard in per_shard for i in shard)
    assert max(read.values()) <= 2 and all(b >= 1 for shard in batches for b in shard)
    if batch_size is None:  # equal_steps with batch_size=None drops nothing
        assert read == Counter(ids * 2)
    else:
        m = len(ids) // len(per_shard)
        assert len(batches[0]) == 2 * -(-m // batch_size)
