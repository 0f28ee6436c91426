"""The readers on ``s3://``, against moto's S3 server on 127.0.0.1 (tests/data/conftest.py's ``s3``): real HTTP, real
Parquet files, pyarrow's S3 filesystem and fsspec's. Skipped where moto does not install."""

from __future__ import annotations

import datetime
import threading
import time
from collections import Counter

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from sparkhvd.data import DatasetNotFoundError, ReadError, make_batch_reader
from sparkhvd.data.torch import make_torch_loader

pytestmark = pytest.mark.unit


def _put(s3, key: str, files: int, rows: int = 10, folder=lambda f: "") -> None:
    fs = s3.filesystem()
    for f in range(files):
        ids = np.arange(f * rows, (f + 1) * rows, dtype=np.int64)
        pq.write_table(pa.table({"id": ids, "x": ids * 0.5}), f"{s3.bucket}/{key}/{folder(f)}part-{f:03d}.parquet",
                       filesystem=fs)


def _ids(reader) -> Counter:
    with reader:
        return Counter(i for batch in reader for i in batch.id.tolist())


def test_a_sharded_reader_and_the_torch_loader_read_an_s3_url(s3):
    _put(s3, "plain", files=5)
    shards = [_ids(make_batch_reader(s3.url("plain"), cur_shard=k, shard_count=3, seed=2)) for k in range(3)]
    assert sum(shards, Counter()) == Counter(range(50))
    assert sorted(sum(s.values()) for s in shards) == [16, 17, 17]  # balanced to a row
    with make_torch_loader(s3.url("plain"), batch_size=7, filters=[("id", "<", 20)]) as loader:
        assert sorted(int(i) for batch in loader for i in batch["id"]) == list(range(20))


def test_a_partitioned_dataset_on_s3_reads_its_folders_as_columns(s3):
    _put(s3, "partitioned", files=4, folder=lambda f: f"day=2024-01-0{f % 2 + 1}/")
    with make_batch_reader(s3.url("partitioned"), filters=[("day", "=", datetime.date(2024, 1, 2))],
                           shuffle_row_groups=False) as reader:
        rows = [(i, str(d)) for batch in reader for i, d in zip(batch.id.tolist(), batch.day)]
    assert sorted(rows) == [(i, "2024-01-02") for i in list(range(10, 20)) + list(range(30, 40))]


def test_an_fsspec_or_pyarrow_filesystem_object_reads_the_bucket(s3):
    _put(s3, "objects", files=2)
    assert _ids(make_batch_reader(f"{s3.bucket}/objects", filesystem=s3.filesystem())) == Counter(range(20))


def test_credentials_in_a_url_never_reach_a_message(s3):
    secret = "NOT-TO-BE-SHOWN-9f2c"
    url = s3.url("nowhere").replace("s3://", f"s3://sparkhvd-test-key:{secret}@")  # pyarrow's form: key:secret@bucket
    with pytest.raises(DatasetNotFoundError, match=r"'s3://sparkhvd-test-key:\*\*\*@sparkhvd-test/nowhere\?") as info:
        make_batch_reader(url)
    assert secret not in str(info.value)
    with pytest.raises(ValueError, match=r"pyarrow could not open the URL .*secret_key=\*\*\*.*: Unexpected query "
                                         r"parameter in S3 URI: 'secret_key'") as info:
        make_batch_reader(s3.url("nowhere") + f"&secret_key={secret}")
    assert secret not in str(info.value)


@pytest.mark.timeout(120)
def test_a_store_that_goes_away_mid_epoch_is_retried_then_named_with_its_cause(s3):
    from pyarrow.fs import AwsStandardS3RetryStrategy

    _put(s3, "flaky", files=12, rows=4)
    fs = s3.filesystem(connect_timeout=0.5, request_timeout=0.5, retry_strategy=AwsStandardS3RetryStrategy(1))

    # The server stops after the first batch and is back 1 s later: the reads retry, and every row comes.
    reader = make_batch_reader(f"{s3.bucket}/flaky", filesystem=fs, workers_count=1, shuffle_row_groups=False,
                               equal_steps=False)
    with reader:
        seen = Counter(next(reader).id.tolist())
        s3.stop()
        back = threading.Timer(1.0, s3.start_again)
        back.start()
        try:
            seen.update(i for batch in reader for i in batch.id.tolist())
        finally:
            back.join()
    assert seen == Counter(range(48))

    # The server stops for good: the read is tried 5 times over about 3.75 s, then the error names the URL and cause.
    reader = make_batch_reader(f"{s3.bucket}/flaky", filesystem=fs, workers_count=1, shuffle_row_groups=False)
    try:
        with reader:
            next(reader)
            s3.stop()
            started = time.monotonic()
            with pytest.raises(ReadError, match=r"Reading row group 0 of 'sparkhvd-test/flaky/part-\d+.parquet' failed "
                                                r"in a prefetch thread \(shard 0 of 1, epoch 0\), 5 times over "
                                                r"[\d.]+ s: OSError: .*Check that the store of 'sparkhvd-test/"
                                                r"flaky' is up and reachable from this host") as info:
                list(reader)
            assert time.monotonic() - started < 60
            assert isinstance(info.value.__cause__, OSError)
    finally:
        s3.start_again()


def test_hadoops_s3a_urls_read_as_s3(s3):
    _put(s3, "hadoop", files=1)
    assert _ids(make_batch_reader(s3.url("hadoop").replace("s3://", "s3a://"))) == Counter(range(10))
