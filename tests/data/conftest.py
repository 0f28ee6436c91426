"""Fixtures for sparkhvd.data tests: real Parquet datasets written with pyarrow."""

from __future__ import annotations

import pickle
import threading
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest


def write_dataset(root: Path, layout: list[list[int]], *, width: int = 3) -> list[int]:
    """Write one file per entry of ``layout``, one row group per size in it; return every row id.

    Columns: ``id`` (int64, unique over the dataset), ``label`` (id % 10), ``vec``
    (``width`` float32 values per row, as list<float>: [id, id + 0.5, ...]).
    """
    root.mkdir(parents=True, exist_ok=True)
    next_id = 0
    ids: list[int] = []
    schema = pa.schema([("id", pa.int64()), ("label", pa.int64()), ("vec", pa.list_(pa.float32()))])
    for f, sizes in enumerate(layout):
        with pq.ParquetWriter(root / f"part-{f:05d}.parquet", schema) as writer:
            for size in sizes:
                rows = np.arange(next_id, next_id + size, dtype=np.int64)
                vec = [[float(i) + k / 2 for k in range(width)] for i in rows]
                writer.write_table(pa.table({"id": rows, "label": rows % 10, "vec": vec}, schema=schema), row_group_size=max(size, 1))
                ids.extend(rows.tolist())
                next_id += size
    return ids


@pytest.fixture
def dataset(tmp_path):
    """A 3-file dataset with unequal row groups: 100 rows, ids 0..99."""
    write_dataset(tmp_path / "ds", [[10, 25], [5, 30, 7], [23]])
    return tmp_path / "ds"


@pytest.fixture
def no_leaked_threads():
    """Fail the test if a reader thread is still alive at its end."""
    yield
    alive = [t.name for t in threading.enumerate() if t.name.startswith("sparkhvd-data")]
    assert not alive, f"reader threads left running: {alive}"


@pytest.fixture(scope="session")
def writer():
    """write_dataset, for tests (hypothesis ones included) that write datasets of their own."""
    return write_dataset


def read_all(reader) -> list:
    """Every batch of a reader, read inside ``with``."""
    with reader:
        return list(reader)


@pytest.fixture(scope="session")
def drain():
    """read_all, as a fixture."""
    return read_all



@pytest.fixture
def wide(tmp_path):
    """240 rows (ids 0..239) in 12 row groups of 10 to 30 rows over 4 files."""
    write_dataset(tmp_path / "wide", [[15, 25, 20], [30, 10, 20], [18, 22], [20, 20, 25, 15]])
    return tmp_path / "wide"


def job_point(readers, epoch: int, batch: int):
    """The job's ResumePoint once every shard's reader has yielded ``batch`` batches of ``epoch`` (the same on every
    rank, checked), with the readers stopped."""
    points = {pickle.dumps(r.resume_point(epoch, batch)) for r in readers}
    assert len(points) == 1
    for r in readers:
        r.stop()
    return pickle.loads(points.pop())


@pytest.fixture(scope="session")
def point_of():
    """job_point, as a fixture."""
    return job_point
