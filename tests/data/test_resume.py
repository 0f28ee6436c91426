"""resume_from=(epoch, batch): a rebuilt reader or loader continues an interrupted one without reading the skipped batches.

The oracle is an uninterrupted reader with the same arguments: the resumed one must yield
exactly its batches from the position on. Skipped row groups are proven unread by deleting
their files after the reader is planned (a read of them raises ReadError).
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sparkhvd.data import ReadError, SparkDatasetConverter, make_batch_reader, make_reader
from sparkhvd.data._plan import Piece, plan_epoch
from sparkhvd.data.torch import make_torch_loader

pytestmark = pytest.mark.unit


def _ids(batch) -> list[int]:
    return batch.id.tolist()


def _by_epoch(dataset, **kwargs) -> list[list[list[int]]]:
    """An uninterrupted reader's batches (as id lists), split into its epochs by the reader's own plan."""
    with make_batch_reader(dataset, **kwargs) as reader:
        flat = [_ids(b) for b in reader]
        counts = [reader.plan(epoch).num_batches for epoch in range(kwargs["num_epochs"])]
    assert sum(counts) == len(flat)
    it = iter(flat)
    return [list(itertools.islice(it, n)) for n in counts]


def _resumed(dataset, position, **kwargs) -> list[list[int]]:
    with make_batch_reader(dataset, resume_from=position, **kwargs) as reader:
        return [_ids(b) for b in reader]


CONFIGS = {
    "in-order": dict(shuffle_row_groups=False),
    "shuffled": dict(shuffle_row_groups=True, shuffle_rows=True, seed=7),
    "shuffled-seed-none": dict(shuffle_row_groups=True, shuffle_rows=True),
    "in-order-unequal-steps": dict(shuffle_row_groups=False, equal_steps=False),
    "shuffled-unequal-steps": dict(shuffle_rows=True, seed=3, equal_steps=False),
}
BATCHES = {"b7": dict(batch_size=7), "plan-sizes": dict(batch_size=None), "b16": dict(batch_size=16)}


@pytest.mark.parametrize("shard", [(0, 1), (0, 2), (1, 2)], ids=["1-shard", "shard-0-of-2", "shard-1-of-2"])
@pytest.mark.parametrize("batches", BATCHES.values(), ids=BATCHES.keys())
@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
def test_resumed_reader_yields_the_tail_of_the_uninterrupted_reader(dataset, shard, batches, config, no_leaked_threads):
    # 100 rows in row groups of 10, 25, 5, 30, 7, 23: no batch size here divides a shard's rows.
    kwargs = dict(cur_shard=shard[0], shard_count=shard[1], num_epochs=3, workers_count=2, **batches, **config)
    epochs = _by_epoch(dataset, **kwargs)
    if config.get("shuffle_row_groups", True):
        assert epochs[0] != epochs[1]  # epochs differ, so starting in the wrong epoch would show
    last = len(epochs[2])
    # Every batch of epoch 1 (its count itself: the epoch was finished), and the edges of the others.
    positions = [(0, 0), (0, 1)] + [(1, batch) for batch in range(len(epochs[1]) + 1)] + [(2, last - 1), (2, last), (3, 0)]
    for epoch, batch in positions:
        expected = [b for e in range(epoch, 3) for b in epochs[e][batch if e == epoch else 0:]]
        assert _resumed(dataset, (epoch, batch), **kwargs) == expected, (epoch, batch)


def test_resume_with_num_epochs_none_reads_forever_from_the_position(dataset):
    kwargs = dict(cur_shard=1, shard_count=2, batch_size=7, shuffle_rows=True, seed=11, num_epochs=None)
    with make_batch_reader(dataset, **kwargs) as reader:
        per_epoch = reader.plan(0).num_batches  # 50 rows: 8 batches every epoch
        uninterrupted = [_ids(next(reader)) for _ in range(5 * per_epoch)]
    with make_batch_reader(dataset, resume_from=(2, 5), **kwargs) as reader:
        resumed = [_ids(next(reader)) for _ in range(2 * per_epoch + 3)]
    assert resumed == uninterrupted[2 * per_epoch + 5:]


def test_skipped_row_groups_are_never_read(tmp_path, writer):
    # One row group of 10 rows per file, so deleting a file removes exactly one row group.
    root = tmp_path / "ds"
    writer(root, [[10]] * 10)
    kwargs = dict(cur_shard=1, shard_count=2, batch_size=6, shuffle_row_groups=True, shuffle_rows=True, seed=3, num_epochs=2)
    epochs = _by_epoch(root, **kwargs)
    position = (1, 6)  # 36 of the shard's 50 rows of epoch 1 were consumed
    skipped_ids = {i for b in epochs[1][:6] for i in b}
    needed_ids = {i for b in epochs[1][6:] for i in b}
    files = sorted(root.glob("*.parquet"))
    rows_of = {f: set(range(10 * k, 10 * k + 10)) for k, f in enumerate(files)}  # write_dataset numbers rows in file order
    unread = [f for f in files if rows_of[f] <= skipped_ids]
    assert len(unread) >= 2, "the layout must have row groups wholly inside the skipped batches"
    # The first batch starts inside a row group (36 is not a multiple of 10): that one is read, and is not deleted.
    assert any(rows_of[f] & skipped_ids and rows_of[f] & needed_ids for f in files)

    resumed = make_batch_reader(root, resume_from=position, **kwargs)
    from_start_of_epoch = make_batch_reader(root, resume_from=(1, 0), **kwargs)  # the control: it needs those files
    for f in unread:
        f.unlink()
    with resumed:
        assert [_ids(b) for b in resumed] == epochs[1][6:]
    with pytest.raises(ReadError, match=r"Reading row group 0 of '.*part-0000\d\.parquet' failed in a prefetch thread \(shard 1 of 2, epoch 1\)"):
        with from_start_of_epoch:
            list(from_start_of_epoch)


def test_schema_fields_and_workers_count_may_change_on_resume(dataset):
    kwargs = dict(cur_shard=0, shard_count=2, batch_size=9, seed=5, shuffle_rows=True, num_epochs=2)
    epochs = _by_epoch(dataset, workers_count=4, **kwargs)
    with make_batch_reader(dataset, resume_from=(0, 2), schema_fields=["id"], workers_count=1, **kwargs) as reader:
        batches = list(reader)
    assert batches[0]._fields == ("id",)
    assert [_ids(b) for b in batches] == epochs[0][2:] + epochs[1]


@pytest.mark.parametrize("equal_steps", [True, False])
def test_the_row_reader_resumes_at_a_row(dataset, equal_steps):
    kwargs = dict(cur_shard=0, shard_count=3, num_epochs=2, seed=4, shuffle_rows=True, equal_steps=equal_steps)
    with make_reader(dataset, **kwargs) as reader:
        rows = [row.id for row in reader]
        per_epoch = reader.reader.plan(0).num_rows
    assert len(rows) == 2 * per_epoch == (66 if equal_steps else 68)  # 100 rows: shard 0 of 3 holds 34 and reads 33 with equal steps
    for epoch, row in [(0, 0), (0, 11), (0, 12), (1, per_epoch - 1), (1, per_epoch), (2, 0)]:
        with make_reader(dataset, resume_from=(epoch, row), **kwargs) as reader:
            assert [r.id for r in reader] == rows[epoch * per_epoch + row:], (epoch, row)
    with pytest.raises(ValueError, match=rf"resume_from=\(1, {per_epoch + 1}\) skips {per_epoch + 1} rows of epoch 1, but shard 0 of 3 reads {per_epoch} rows in that epoch; pass a row from 0 to {per_epoch}"):
        make_reader(dataset, resume_from=(1, per_epoch + 1), **kwargs)
    with pytest.raises(ValueError, match=r"resume_from=\(0, -1\) has a negative row; epochs and rows count from 0, so pass the \(epoch, row\)"):
        make_reader(dataset, resume_from=(0, -1), **kwargs)


def _loader_passes(loader, passes: int) -> list[list[list[int]]]:
    return [[batch["id"].tolist() for batch in loader] for _ in range(passes)]


@pytest.mark.parametrize(("num_epochs", "position", "start"), [
    (1, (2, 3), lambda p, n: p[2][3:]),          # loader epoch 2 is iteration 2
    (1, (0, 0), lambda p, n: p[0]),
    (2, (1, 2), lambda p, n: p[0][n + 2:]),      # iteration 0, its second epoch
    (2, (2, 7), lambda p, n: p[1][7:]),          # iteration 1, its first epoch, finished
])
def test_torch_loader_resumes_at_its_epoch_and_later_iterations_follow(dataset, num_epochs, position, start):
    kwargs = dict(batch_size=7, cur_shard=1, shard_count=2, seed=3, shuffle_rows=True, num_epochs=num_epochs)
    per_epoch = 8  # 50 rows in batches of 7
    with make_torch_loader(dataset, **kwargs) as loader:
        passes = _loader_passes(loader, 4)
    assert [len(p) for p in passes] == [per_epoch * num_epochs] * 4
    first_iteration = position[0] // num_epochs
    with make_torch_loader(dataset, resume_from=position, **kwargs) as loader:
        resumed = _loader_passes(loader, 2)
    assert resumed[0] == start(passes, per_epoch)
    assert resumed[1] == passes[first_iteration + 1]


def test_converter_loader_passes_resume_from_through(dataset):
    converter = SparkDatasetConverter(Path(dataset).as_uri(), 100)  # over an existing directory: no Spark needed
    kwargs = dict(batch_size=8, num_epochs=2, cur_shard=0, shard_count=2, seed=1)
    with converter.make_torch_dataloader(**kwargs) as loader:
        (uninterrupted,) = _loader_passes(loader, 1)
    with converter.make_torch_dataloader(resume_from=(1, 4), **kwargs) as loader:
        (resumed,) = _loader_passes(loader, 1)
    assert resumed == uninterrupted[7 + 4:]  # 50 rows in batches of 8: 7 per epoch


@pytest.mark.parametrize(("resume_from", "error", "match"), [
    ("2,37", TypeError, r"resume_from must be a pair \(epoch, batch\) of ints, got str '2,37'; pass the \(epoch, batch\) that the interrupted run had reached, e\.g\. resume_from=\(2, 37\)"),
    ((1,), TypeError, r"resume_from must be a pair \(epoch, batch\) of ints, got tuple \(1,\); pass the \(epoch, batch\)"),
    ((1.0, 2), TypeError, r"resume_from's epoch must be an int, got float 1\.0; pass the \(epoch, batch\)"),
    ((0, True), TypeError, r"resume_from's batch must be an int, got the bool True; pass the \(epoch, batch\)"),
    ((-1, 0), ValueError, r"resume_from=\(-1, 0\) has a negative epoch; epochs and batches count from 0, so pass the \(epoch, batch\)"),
    ((0, -3), ValueError, r"resume_from=\(0, -3\) has a negative batch; epochs and batches count from 0"),
    ((3, 1), ValueError, r"resume_from=\(3, 1\) starts in epoch 3, but num_epochs=3 reads epochs 0 to 2; num_epochs counts every epoch, not those left, so pass the interrupted run's num_epochs and an epoch below 3 \(or \(3, 0\), which yields nothing: the run had finished\)\."),
    ((5, 0), ValueError, r"resume_from=\(5, 0\) starts in epoch 5, but num_epochs=3 reads epochs 0 to 2"),
    ((1, 9), ValueError, r"resume_from=\(1, 9\) skips 9 batches of epoch 1, but shard 1 of 2 has 8 batches \(50 rows, batch_size=7\) in that epoch; pass a batch from 0 to 8 \(8 means the epoch was finished\), and build the reader with the interrupted run's dataset, filters, cur_shard, shard_count, seed, shuffle options, batch_size and equal_steps\."),
])
def test_bad_resume_positions(dataset, resume_from, error, match):
    kwargs = dict(cur_shard=1, shard_count=2, batch_size=7, num_epochs=3, resume_from=resume_from)
    with pytest.raises(error, match=match):
        make_batch_reader(dataset, **kwargs)
    if resume_from not in {(3, 1), (5, 0)}:  # valid for a loader, which counts epochs over its iterations (next test)
        with pytest.raises(error, match=match):  # the loaders check as they build their first reader
            make_torch_loader(dataset, **kwargs)


def test_a_loader_position_past_the_epoch_says_where_it_maps(dataset):
    with pytest.raises(ValueError, match=r"The loader's resume_from=\(7, 9\) is epoch 1 of its iteration 2 \(num_epochs=3 per iteration\), batch 9: resume_from=\(1, 9\) skips 9 batches of epoch 1, but shard 1 of 2 has 8 batches"):
        make_torch_loader(dataset, cur_shard=1, shard_count=2, batch_size=7, num_epochs=3, resume_from=(7, 9))


def test_a_batch_past_the_end_with_plan_sized_batches_names_batch_size_none(dataset):
    with pytest.raises(ValueError, match=r"resume_from=\(0, 7\) skips 7 batches of epoch 0, but shard 0 of 1 has 6 batches \(100 rows, batch_size=None\)"):
        make_batch_reader(dataset, shuffle_row_groups=False, equal_steps=False, resume_from=(0, 7))


def test_a_loader_over_a_reader_takes_resume_from_on_the_reader(dataset):
    reader = make_batch_reader(dataset, batch_size=10, resume_from=(0, 4))
    with pytest.raises(TypeError, match=r"make_torch_loader got reader options \['resume_from'\] with an existing Reader; pass them to make_batch_reader instead"):
        make_torch_loader(reader, batch_size=10, resume_from=(0, 4))
    with make_torch_loader(reader, batch_size=None) as loader:
        assert sum(len(b["id"]) for b in loader) == 60


def test_the_documented_commit_loop_sees_each_batch_once_across_a_restart(dataset):
    # docs/data.md's loop, with a dict for the elastic state and a failure after 13 batches (the last commit after 11).
    kwargs = dict(batch_size=7, num_epochs=3, seed=42, shuffle_rows=True, cur_shard=0, shard_count=2)
    uninterrupted = [b for epoch in _by_epoch(dataset, **kwargs) for b in epoch]
    committed = {"epoch": 0, "batch": 0}
    seen: list[list[int]] = []

    def train(state: dict, fail_after: int | None) -> None:
        state = dict(state)
        with make_batch_reader(dataset, resume_from=(state["epoch"], state["batch"]), **kwargs) as reader:
            for epoch in range(state["epoch"], 3):
                for _ in range(reader.plan(epoch).num_batches - state["batch"]):
                    if fail_after is not None and len(seen) == fail_after:
                        raise RuntimeError("the rank is lost")
                    seen.append(_ids(next(reader)))
                    state["batch"] += 1
                    if state["batch"] % 3 == 0:
                        committed.update(state)
                state["epoch"], state["batch"] = epoch + 1, 0
                committed.update(state)

    with pytest.raises(RuntimeError, match="the rank is lost"):
        train(committed, fail_after=13)  # 8 batches per epoch: the commit at epoch 1, batch 3 is the last
    assert committed == {"epoch": 1, "batch": 3}
    del seen[8 + 3:]  # what was trained after the last commit is rolled back with the model
    train(committed, fail_after=None)
    assert seen == uninterrupted


@settings(max_examples=100, deadline=None)
@given(sizes=st.lists(st.integers(0, 30), min_size=1, max_size=10), shard_count=st.integers(1, 6), batch_size=st.none() | st.integers(1, 20),
       equal_steps=st.booleans(), data=st.data())
def test_plan_skip_arithmetic(sizes, shard_count, batch_size, equal_steps, data):
    # The pure part: for every batch position, the slices started from and the batch sizes left add up to the rows left.
    pieces = [Piece(f"f{i}", 0, n) for i, n in enumerate(sizes)]
    shard_count = min(shard_count, max(sum(sizes), 1))
    if sum(sizes) < shard_count:
        return
    plan = plan_epoch(pieces, shard_count=shard_count, cur_shard=data.draw(st.integers(0, shard_count - 1)), epoch=1, seed=4,
                      shuffle_row_groups=True, batch_size=batch_size, equal_steps=equal_steps)
    sizes_all = list(plan.batch_sizes())
    for batch in range(plan.num_batches + 1):
        skipped = plan.rows_before(batch)
        assert skipped == sum(sizes_all[:batch])
        assert list(plan.batch_sizes(skipped)) == sizes_all[batch:]
        first, drop = plan.start_at(skipped)
        assert 0 <= drop < (plan.slices[first].num_rows if first < len(plan.slices) else 1)
        assert sum(s.num_rows for s in plan.slices[first:]) - drop == plan.num_rows - skipped
