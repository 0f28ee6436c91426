"""Prefetch threads: clean stops, errors raised in the consumer, and the default shard."""

from __future__ import annotations

import gc
import sys
import threading
import time
import types

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from sparkhvd.data import ReadError, make_batch_reader
from sparkhvd.data._checks import _default_shard
from sparkhvd.data.torch import make_torch_loader

pytestmark = pytest.mark.unit


def reader_threads():
    return [t for t in threading.enumerate() if t.name.startswith("sparkhvd-data")]


def test_stop_mid_epoch_leaves_no_thread(dataset, no_leaked_threads):
    reader = make_batch_reader(dataset, num_epochs=None, batch_size=5, workers_count=3)
    next(reader)
    assert reader_threads()
    reader.stop()
    reader.join()
    assert not reader_threads()
    with pytest.raises(RuntimeError, match="This reader was stopped"):  # Petastorm's error, not an empty reader
        list(reader)


@pytest.fixture
def no_cycle_collector():
    """Turn Python's cycle collector off for the test: what must end has to end by reference counting alone."""
    gc.disable()
    yield
    gc.enable()


def join_within(threads, seconds):
    """Join ``threads`` within ``seconds`` in all; return the reader threads still alive."""
    deadline = time.monotonic() + seconds
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    return reader_threads()


def test_dropping_a_reader_ends_its_threads_without_the_cycle_collector(dataset, no_cycle_collector, no_leaked_threads):
    reader = make_batch_reader(dataset, num_epochs=None, batch_size=5, workers_count=3)
    next(reader)
    threads = reader_threads()
    assert threads
    del reader  # no stop(), no with, no gc.collect()
    assert join_within(threads, 2.0) == []


def test_dropping_a_reader_another_object_wraps_ends_its_threads(dataset, no_cycle_collector, no_leaked_threads):
    reader = make_batch_reader(dataset, num_epochs=None, batch_size=5, workers_count=2)
    loader = make_torch_loader(reader, batch_size=None)
    for i, _ in enumerate(loader):
        if i == 1:
            break
    threads = reader_threads()
    assert threads  # the user's Reader is not stopped by leaving the loop
    del loader, reader
    assert join_within(threads, 2.0) == []


def test_leaving_a_torch_loop_with_break_and_dropping_the_loader_ends_its_threads(dataset, no_cycle_collector, no_leaked_threads):
    for _ in range(3):  # as an abandoned loader per epoch would
        loader = make_torch_loader(dataset, batch_size=5, num_epochs=None, workers_count=2)
        for i, _ in enumerate(loader):
            if i == 2:
                threads = reader_threads()
                assert threads
                break
        del loader
        assert join_within(threads, 2.0) == []


def test_a_reader_holds_at_most_workers_count_plus_3_row_groups(dataset, no_leaked_threads):
    workers = 2
    with make_batch_reader(dataset, num_epochs=None, equal_steps=False, workers_count=workers) as reader:
        held = next(reader)  # one row group per batch: this one is held by us
        pending = list(reader._prefetcher._pending)  # read ahead, running or done
        for future in pending:
            future.result()
        assert len(pending) + 1 == workers + 3  # the bound make_batch_reader's docstring states
        assert len(held.id) > 0


def test_leaving_with_early_leaves_no_thread(dataset, no_leaked_threads):
    with make_batch_reader(dataset, num_epochs=None) as reader:
        for i, _ in enumerate(reader):
            if i == 3:
                break


def test_exhausted_reader_leaves_no_thread(dataset, no_leaked_threads):
    reader = make_batch_reader(dataset, num_epochs=3)
    assert len(list(reader)) > 0
    assert not reader_threads()


def test_stop_from_another_thread_ends_iteration_with_petastorms_error(dataset, no_leaked_threads):
    reader = make_batch_reader(dataset, num_epochs=None, batch_size=1, workers_count=2, equal_steps=False)
    count = 0
    stopper = threading.Thread(target=reader.stop)
    with pytest.raises(RuntimeError, match="This reader was stopped"):  # a read waiting when it lands, or the next
        for _ in reader:
            count += 1
            if count == 10:
                stopper.start()
    stopper.join()
    assert count >= 10


def test_file_deleted_after_planning_is_raised_not_swallowed(dataset, no_leaked_threads):
    reader = make_batch_reader(dataset, shuffle_row_groups=False, workers_count=2)
    (dataset / "part-00002.parquet").unlink()
    with pytest.raises(ReadError, match=r"Reading row group 0 of '.*part-00002.parquet' failed in a prefetch thread \(shard 0 of 1, epoch 0\): .*changed, moved or deleted since; restore it and create a new reader") as info:
        with reader:
            list(reader)
    assert isinstance(info.value.__cause__, (OSError, pa.ArrowException))
    assert not reader_threads()


def test_file_rewritten_with_other_rows_is_detected(dataset, no_leaked_threads):
    reader = make_batch_reader(dataset, shuffle_row_groups=False)
    pq.write_table(pa.table({"id": [1], "label": [1], "vec": [[1.0, 2.0, 3.0]]}), dataset / "part-00001.parquet")
    with pytest.raises(ReadError, match=r"Row group 0 of '.*part-00001.parquet' now has 1 rows \(after filters\) but had 5 when the reader was created"):
        with reader:
            list(reader)


def test_corrupted_file_is_raised(dataset, no_leaked_threads):
    reader = make_batch_reader(dataset, shuffle_row_groups=False)
    (dataset / "part-00000.parquet").write_bytes(b"PAR1 garbage")
    with pytest.raises(ReadError, match=r"Reading row group 0 of '.*part-00000.parquet' failed"):
        with reader:
            list(reader)


def test_default_shard_without_and_with_an_initialized_communicator(monkeypatch):
    monkeypatch.delitem(sys.modules, "sparkhvd.collective.torch", raising=False)
    assert _default_shard() == (0, 1)
    hvd = types.ModuleType("sparkhvd.collective.torch")  # stands in for the module another part builds
    hvd.is_initialized = lambda: False
    hvd.rank, hvd.size = (lambda: 2), (lambda: 3)
    monkeypatch.setitem(sys.modules, "sparkhvd.collective.torch", hvd)
    assert _default_shard() == (0, 1)
    hvd.is_initialized = lambda: True
    assert _default_shard() == (2, 3)


def test_reader_defaults_to_the_communicator_shard(dataset, drain, monkeypatch):
    hvd = types.ModuleType("sparkhvd.collective.torch")
    hvd.is_initialized, hvd.rank, hvd.size = (lambda: True), (lambda: 1), (lambda: 4)
    monkeypatch.setitem(sys.modules, "sparkhvd.collective.torch", hvd)
    reader = make_batch_reader(dataset)
    assert (reader.cur_shard, reader.shard_count) == (1, 4)
    assert sum(len(b.id) for b in drain(reader)) == 25
