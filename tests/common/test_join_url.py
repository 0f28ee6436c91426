"""join_url: where a run's commits go, under a path or a URL whose query configures its filesystem."""

from __future__ import annotations

import pytest

from sparkhvd._common.commits import join_url

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(("base", "parts", "joined"), [
    ("/mnt/runs/", ("r1", "c.pkl"), "/mnt/runs/r1/c.pkl"),
    ("file:///mnt/runs", ("r1",), "file:///mnt/runs/r1"),
    ("hdfs:///ckpt", ("r1",), "hdfs:///ckpt/r1"),  # urllib would write hdfs:/ckpt/r1, a local path
    ("s3://bucket/runs?endpoint_override=127.0.0.1:9000&scheme=http", ("r1", "c.pkl"),
     "s3://bucket/runs/r1/c.pkl?endpoint_override=127.0.0.1:9000&scheme=http"),  # the query stays at the end
    ("memory://runs/", ("/r1/",), "memory://runs/r1"),
])
def test_parts_join_the_path_and_a_query_stays_at_the_end(base, parts, joined):
    assert join_url(base, *parts) == joined
