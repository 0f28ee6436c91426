"""``global_order=True``: the job reads an epoch's rows in one order at any number of shards (Mosaic Streaming's
"elastic determinism"), and a resized run continues that order mid-epoch; on real files, at np 1 to 5 and 4 -> 3 -> 4."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sparkhvd.data import make_batch_reader
from sparkhvd.data._plan import Piece, interleaved, plan_epoch

pytestmark = pytest.mark.unit

ORDERS = [dict(shuffle_rows=True), dict(shuffle_rows=False, shuffle_row_groups=False), dict(equal_steps=False)]



def _layout(dataset, shards: int, **kwargs) -> list:
    options = dict(seed=5, batch_size=7, global_order=True, num_epochs=1) | kwargs
    return [make_batch_reader(dataset, cur_shard=k, shard_count=shards, **options) for k in range(shards)]


def _job(readers, steps: int | None = None) -> list[int]:
    """The ids the job reads, step by step and in each step shard by shard (a shard out of batches skips the step)."""
    batches = [[batch.id.tolist() for batch in _next(reader, steps)] for reader in readers]
    return [i for step in range(max(map(len, batches))) for shard in batches if step < len(shard) for i in shard[step]]


def _next(reader, steps: int | None) -> list:
    if steps is None:
        with reader:
            return list(reader)
    return [next(reader) for _ in range(steps)]


@pytest.mark.parametrize("options", ORDERS, ids=["shuffled", "file-order", "unequal-steps"])
def test_the_job_reads_an_epoch_in_one_order_at_every_number_of_shards(wide, options):
    one = _job(_layout(wide, 1, **options))
    assert sorted(one) == list(range(240))  # every row once
    for shards in (2, 3, 4, 5):
        readers = _layout(wide, shards, **options)
        steps = {reader.plan(0).num_batches for reader in readers}
        job = _job(readers)
        assert job == one[:len(job)]  # the same order; equal steps leave out at most shards - 1 rows at the end
        assert len(one) - len(job) < shards
        if options.get("equal_steps", True):
            assert len(steps) == 1
    if options.get("shuffle_rows"):
        assert one != sorted(one)


def test_the_order_depends_on_the_seed_and_the_epoch(wide):
    first, = _layout(wide, 1, shuffle_rows=True, num_epochs=2)
    with first:
        ids = [i for batch in first for i in batch.id.tolist()]
    assert ids[:240] != ids[240:] and sorted(ids[:240]) == sorted(ids[240:])
    assert _job(_layout(wide, 1, shuffle_rows=True)) != _job(_layout(wide, 1, shuffle_rows=True, seed=6))


def test_a_run_resized_from_4_to_3_to_4_shards_mid_epoch_reads_the_rows_in_the_uninterrupted_order(wide, point_of):
    uninterrupted = _job(_layout(wide, 4, shuffle_rows=True))
    first = _layout(wide, 4, shuffle_rows=True)
    seen = _job(first, steps=2)
    point = point_of(first, 0, 2)
    assert point.rows_left == 240 - len(seen) == 240 - 2 * 4 * 7 and point.shuffled_rows
    second = _layout(wide, 3, shuffle_rows=True, resume_from=point)
    seen += _job(second, steps=3)
    seen += _job(_layout(wide, 4, shuffle_rows=True, resume_from=point_of(second, 0, 3)))
    assert seen == uninterrupted[:len(seen)]  # no row twice, none skipped, in the one order
    assert len(uninterrupted) - len(seen) < 4 and len(set(seen)) == len(seen)



def test_resume_from_a_batch_at_the_same_shard_count_yields_what_the_uninterrupted_reader_did(wide):
    whole = [b.id.tolist() for b in _layout(wide, 3, shuffle_rows=True)[1]]
    resumed = _layout(wide, 3, shuffle_rows=True, resume_from=(0, 4))[1]
    assert [b.id.tolist() for b in resumed] == whole[4:]


def test_a_shard_reads_each_row_group_once_per_epoch(wide):
    reader = _layout(wide, 2, batch_size=3)[1]  # steps of 6 rows: row groups of 10 to 30 hold several
    tasks = list(reader._shard.tasks())
    assert len(tasks) == len({slices[0].piece for _, _, slices, _ in tasks}) <= 12
    assert sum(len(slices) for _, _, slices, _ in tasks) > len(tasks)  # several batches of a row group in one read


def test_interleaved_deals_full_steps_then_splits_the_last():
    # 30 rows, 3 shards, batches of 4: two steps of 12 rows, then 6 rows
    assert interleaved(30, 3, 1, 4, equal_steps=True) == [(4, 8), (16, 20), (26, 28)]
    assert [interleaved(30, 3, k, 4, equal_steps=False)[-1] for k in range(3)] == [(24, 28), (28, 30), (20, 24)]
    assert interleaved(26, 3, 2, 4, equal_steps=True) == [(8, 12), (20, 24)]  # 2 rows left, fewer than the shards


def test_the_resize_keeps_the_order_only_with_the_same_row_space(wide, point_of):
    point = point_of(_layout(wide, 2, shuffle_rows=True), 0, 1)
    with pytest.raises(ValueError, match=r"This ResumePoint was taken from a reader with global_order=True and "
                                         r"shuffle_rows=True, and this reader has global_order=False, "
                                         r"shuffle_rows=True: their row spaces order rows differently"):
        make_batch_reader(wide, seed=5, shuffle_rows=True, resume_from=point)
    # without shuffle_rows the row space is the default reader's, so either layout may resume from it
    point = point_of(_layout(wide, 2), 0, 1)
    with make_batch_reader(wide, seed=5, resume_from=point) as reader:
        assert sum(len(b.id) for b in reader) == point.rows_left


def test_global_order_needs_a_batch_size(wide):
    with pytest.raises(ValueError, match=r"global_order=True deals the rows to the shards in batches, so it needs a "
                                         r"batch_size; pass batch_size="):
        make_batch_reader(wide, global_order=True)


def test_the_torch_loader_reads_in_the_global_order(wide):
    pytest.importorskip("torch")
    from sparkhvd.data.torch import make_torch_loader

    expected = [b.id.tolist() for b in _layout(wide, 2)[1]]
    with make_torch_loader(wide, batch_size=7, cur_shard=1, shard_count=2, seed=5, global_order=True) as loader:
        assert [b["id"].tolist() for b in loader] == expected


def _job_rows(pieces, shard_count: int, **options) -> list[tuple[int, int]]:
    """The (piece, row) pairs the job's plans read, step by step and in each step shard by shard."""
    batches = []
    for k in range(shard_count):
        plan = plan_epoch(pieces, shard_count=shard_count, cur_shard=k, **options)
        rows = [(s.piece, r) for s in plan.slices for r in range(s.start, s.stop)]
        sizes, start = list(plan.batch_sizes()), 0
        batches.append([rows[start:(start := start + n)] for n in sizes])
        assert start == len(rows)
    return [row for step in range(max(map(len, batches))) for shard in batches if step < len(shard) for row in shard[step]]


@settings(max_examples=100, deadline=None)
@given(sizes=st.lists(st.integers(0, 30), min_size=1, max_size=8), shard_count=st.integers(1, 6),
       batch_size=st.integers(1, 12), equal_steps=st.booleans(), cut=st.integers(0, 200))
def test_plans_deal_the_row_space_in_one_order(sizes, shard_count, batch_size, equal_steps, cut):
    # The pure part, with and without a ResumePoint's rows left: any shard count reads a prefix of the one order.
    pieces = [Piece(f"f{i}", 0, n) for i, n in enumerate(sizes)]
    total = sum(sizes)
    remaining = ((min(cut, total), total),)
    for left in (None, remaining):
        rows_left = total if left is None else total - min(cut, total)
        if rows_left < shard_count:
            continue
        options = dict(epoch=2, seed=9, shuffle_row_groups=True, batch_size=batch_size, equal_steps=equal_steps,
                       remaining=left, global_order=True)
        one = _job_rows(pieces, 1, **options)
        job = _job_rows(pieces, shard_count, **options)
        assert len(one) == rows_left and len(set(one)) == rows_left
        assert job == one[:len(job)] and rows_left - len(job) < (shard_count if equal_steps else 1)


def test_a_delta_table_reads_in_one_order_at_every_number_of_shards(tmp_path):
    deltalake = pytest.importorskip("deltalake", reason="deltalake (the delta extra) is not installed")
    import pyarrow as pa

    from sparkhvd.data import make_delta_reader

    path = str(tmp_path / "table")
    for start in (0, 30, 60):  # three versions, three files
        ids = pa.array(range(start, start + 30), pa.int64())
        deltalake.write_deltalake(path, pa.table({"id": ids, "part": pa.compute.bit_wise_and(ids, 1)}),
                                  mode="append", partition_by=["part"])

    def job(shards):
        return _job([make_delta_reader(path, cur_shard=k, shard_count=shards, seed=2, batch_size=4, shuffle_rows=True,
                                       global_order=True) for k in range(shards)])

    one = job(1)
    assert sorted(one) == list(range(90))
    for shards in (2, 3):
        rows = job(shards)
        assert rows == one[:len(rows)] and len(one) - len(rows) < shards
