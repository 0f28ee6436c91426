"""Fixtures for sparkhvd.data tests: real Parquet datasets written with pyarrow."""

from __future__ import annotations

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


class S3Server:
    """moto's S3 server on 127.0.0.1 (a real S3-protocol HTTP server, in this process), and a bucket on it."""

    bucket = "sparkhvd-test"

    def __init__(self):
        import logging

        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # no line per request
        self._server_type = ThreadedMotoServer
        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self._server.start()
        self.host, self.port = self._server.get_host_and_port()
        self.endpoint = f"{self.host}:{self.port}"
        self.filesystem().create_dir(self.bucket)

    def filesystem(self, **options):
        """pyarrow's S3 filesystem on the server; ``options`` as S3FileSystem takes them."""
        import pyarrow.fs as pafs

        return pafs.S3FileSystem(endpoint_override=self.endpoint, scheme="http", region="us-east-1",
                                 allow_bucket_creation=True, **options)

    def url(self, key: str) -> str:
        """An ``s3://`` URL of ``key`` in the bucket, with the endpoint in its query (credentials from the environment)."""
        return f"s3://{self.bucket}/{key}?endpoint_override={self.endpoint}&scheme=http&region=us-east-1"

    def stop(self) -> None:
        self._server.stop()

    def start_again(self) -> None:
        """A new server on the same port; moto keeps the objects in this process, so they are all there."""
        self._server = self._server_type(ip_address="127.0.0.1", port=self.port, verbose=False)
        self._server.start()


@pytest.fixture(scope="module")
def s3():
    """A moto S3 server for the module, with credentials in the usual environment variables (never in a URL)."""
    pytest.importorskip("moto.server", reason="moto[server] is not installed (pip install -e '.[test]' installs it)")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("AWS_ACCESS_KEY_ID", "sparkhvd-test-key")
        env.setenv("AWS_SECRET_ACCESS_KEY", "sparkhvd-test-secret")
        env.setenv("AWS_DEFAULT_REGION", "us-east-1")
        server = S3Server()
        try:
            yield server
        finally:
            server.stop()
