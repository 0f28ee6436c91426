"""The rank's own counters (_common/metrics.py): a reader's waits and commits are counted where they happen, and
what the process tells of itself is there; no GPU reading without NVML and a GPU."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from sparkhvd._common import metrics
from sparkhvd.data import make_batch_reader

pytestmark = pytest.mark.unit


def test_the_training_loops_waits_on_a_reader_are_counted(tmp_path):
    pq.write_table(pa.table({"x": list(range(1000))}), tmp_path / "part-0.parquet", row_group_size=100)
    before = metrics.snapshot(0)["data_wait_s"]
    with make_batch_reader(f"file://{tmp_path}", num_epochs=1) as reader:
        rows = sum(len(batch.x) for batch in reader)
    assert rows == 1000 and metrics.snapshot(0)["data_wait_s"] > before


def test_a_snapshot_tells_cpu_memory_and_no_gpu_without_one(monkeypatch):
    monkeypatch.setattr(metrics, "_gpu", [])
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    now = metrics.snapshot(7)
    assert now["collectives"] == 7 and now["cpu_s"] > 0 and now["rss_bytes"] > 1 << 20 and now["gpu"] is None
