"""Petastorm's reader arguments that sparkhvd's signature lacks, written as Petastorm's docs pass them.

Each is used, accepted (noted once where its value asks for something that does not apply), or refused with a
sentence; docs/data.md lists them. Real Parquet files throughout.
"""

from __future__ import annotations

import warnings
from collections import Counter

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest

from sparkhvd.data import _petastorm_args, make_batch_reader, make_reader
from sparkhvd.data._petastorm_args import PetastormArgumentWarning

pytestmark = pytest.mark.unit

PETASTORM_DEFAULTS = dict(reader_pool_type="thread", workers_count=10, shuffle_row_drop_partitions=1, predicate=None,
                          rowgroup_selector=None, shard_seed=None, cache_type="null", cache_location=None,
                          cache_size_limit=None, cache_row_size_estimate=None, cache_extra_settings=None,
                          hdfs_driver="libhdfs3", transform_spec=None, storage_options=None, zmq_copy_buffers=True,
                          filesystem=None)


@pytest.fixture
def fresh_notes(monkeypatch):
    """The once-per-process notes, as in a fresh process."""
    monkeypatch.setattr(_petastorm_args, "_noted", set())


def _ids(reader) -> Counter:
    with reader:
        return Counter(i for item in reader for i in np.atleast_1d(item.id).tolist())  # a batch's ids, or a row's


def test_petastorms_signature_with_its_defaults_reads_every_row(dataset):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the defaults ask for nothing: no note
        assert _ids(make_batch_reader(dataset, **PETASTORM_DEFAULTS)) == Counter(range(100))
        assert _ids(make_reader(dataset, results_queue_size=50, pyarrow_serialize=False,
                                **PETASTORM_DEFAULTS)) == Counter(range(100))


def test_what_does_not_apply_is_noted_once_per_process(dataset, fresh_notes):
    with pytest.warns(PetastormArgumentWarning, match=r"reader_pool_type='process': sparkhvd reads row groups in "
                                                      r"workers_count threads"):
        assert _ids(make_batch_reader(dataset, reader_pool_type="process")) == Counter(range(100))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        make_batch_reader(dataset, reader_pool_type="process").stop()  # noted already
    for kwargs, match in [(dict(shard_seed=3), r"shard_seed=3: shards are cut by rows from the order seed= gives"),
                          (dict(results_queue_size=8), r"results_queue_size=8: the reader holds workers_count \+ 2"),
                          (dict(hdfs_driver="libhdfs"), r"hdfs_driver='libhdfs': hdfs:// URLs go through pyarrow's")]:
        with pytest.warns(PetastormArgumentWarning, match=match):
            make_reader(dataset, **kwargs).stop()


def test_a_dummy_pool_reads_in_one_thread(dataset):
    reader = make_batch_reader(dataset, reader_pool_type="dummy", workers_count=10)
    assert reader.workers_count == 1
    assert _ids(reader) == Counter(range(100))


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    (dict(predicate=object()), ValueError, r"predicate=<object object at .*> is not supported by sparkhvd's reader \(it "
                                           r"changes which rows are read, .*\); pass filters=, a pyarrow expression"),
    (dict(rowgroup_selector="index"), ValueError, r"rowgroup_selector='index' is not supported .*; pass filters= on"),
    (dict(transform_spec="spec"), ValueError, r"transform_spec='spec' is not supported .*; transform the batches in"),
    (dict(shuffle_row_drop_partitions=2), ValueError, r"shuffle_row_drop_partitions=2 is not supported .*; pass "
                                                      r"shuffle_rows=True"),
    (dict(cache_type="local-disk"), ValueError, r"cache_type='local-disk' is not supported by sparkhvd's reader \(it "
                                                r"keeps no cache of its own: every epoch reads the dataset\)"),
    (dict(cache_type="disk"), ValueError, r"cache_type='disk' is not one of Petastorm's None, 'null' and 'local-disk'"),
    (dict(reader_pool_type="pool"), ValueError, r"reader_pool_type='pool' is not one of Petastorm's 'thread', "
                                                r"'process' and 'dummy'"),
    (dict(results_queue_size=8), TypeError, r"make_batch_reader\(\) got an unexpected keyword argument "
                                            r"'results_queue_size'; its arguments are its own"),
    (dict(storage_options="anon"), TypeError, r"storage_options must be a dict of fsspec options, got str 'anon'"),
    (dict(filesystem=3), ValueError, r"filesystem must be a pyarrow.fs.FileSystem or an fsspec filesystem, got int 3"),
])
def test_what_would_change_the_rows_read_is_refused_in_a_sentence(dataset, kwargs, error, match):
    with pytest.raises(error, match=match):
        make_batch_reader(dataset, **kwargs)


def test_filesystem_takes_a_pyarrow_or_an_fsspec_filesystem(dataset):
    subtree = pafs.SubTreeFileSystem(str(dataset.parent), pafs.LocalFileSystem())
    assert _ids(make_batch_reader(dataset.name, filesystem=subtree)) == Counter(range(100))  # relative to the subtree
    assert _ids(make_batch_reader(f"file://{dataset}", filesystem=fsspec.filesystem("file"))) == Counter(range(100))


def test_storage_options_reach_fsspec(tmp_path):
    memory = fsspec.filesystem("memory")
    with memory.open("/sparkhvd-test/part-0.parquet", "wb") as f:
        pq.write_table(pa.table({"id": list(range(7))}), f)
    try:
        assert _ids(make_batch_reader("memory://sparkhvd-test", storage_options={})) == Counter(range(7))
        pq.write_table(pa.table({"id": [1, 2]}), tmp_path / "p.parquet")
        reader = make_batch_reader(f"file://{tmp_path}", storage_options={"auto_mkdir": True})
        handler = reader.dataset.filesystem.handler
        assert isinstance(handler, pafs.FSSpecHandler) and handler.fs.auto_mkdir is True
        assert _ids(reader) == Counter([1, 2])
    finally:
        memory.rm("/sparkhvd-test", recursive=True)
