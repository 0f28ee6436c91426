"""The estimators' Store and run directories, and their epochs' batches, on real files (the fast tier):

- a checkpoint counts only once its marker is written and every file it lists is whole, so a fit killed while
  writing one resumes from the one before;
- a run_id is never resumed with another model;
- each fit's model file is its own, named by its content: a later fit of the run writes another and touches none;
- a Store that cannot be written says so before anything launches; fsspec-only URLs (memory://) work;
- an epoch's batches hold every row once and give every rank the same number of steps, also where the reader's
  equal_steps would leave a row out, and a resumed epoch yields what the uninterrupted one did from there.
"""

from __future__ import annotations

import hashlib
import math
import pickle
import uuid

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from sparkhvd.ml import Store
from sparkhvd.ml._batches import epoch_batches, steps
from sparkhvd.ml._checkpoints import MARKER, RunDir, content_name

pytestmark = pytest.mark.unit

FINGERPRINT = {"framework": "torch", "model": "m.Net", "tensors": 2, "parameters": 3, "digest": "abc"}


def _write(out, data: bytes):
    out.write(data)


def test_a_checkpoint_counts_once_its_marker_and_files_are_whole(tmp_path):
    run = RunDir(Store.create(str(tmp_path)), "r")
    assert run.newest() is None
    run.write_checkpoint(1, {"checkpoint.pt": lambda out: _write(out, b"one")})
    url2 = run.write_checkpoint(2, {"checkpoint.pt": lambda out: _write(out, b"two")})
    assert run.newest() == (2, url2)
    # a fit killed while writing epoch 3: its file, no marker
    (tmp_path / "runs" / "r" / "checkpoints" / "epoch-00003").mkdir()
    (tmp_path / "runs" / "r" / "checkpoints" / "epoch-00003" / "checkpoint.pt").write_bytes(b"hal")
    assert run.newest()[0] == 2
    # a file cut short after its marker was written (a copy gone wrong): not whole, not read
    (tmp_path / "runs" / "r" / "checkpoints" / "epoch-00002" / "checkpoint.pt").write_bytes(b"tw")
    assert run.newest()[0] == 1
    # writing epoch 3 again replaces the incomplete directory
    run.write_checkpoint(3, {"checkpoint.pt": lambda out: _write(out, b"three")})
    assert run.newest()[0] == 3
    assert (tmp_path / "runs" / "r" / "checkpoints" / "epoch-00003" / MARKER).exists()


def test_a_run_id_is_never_resumed_with_another_model(tmp_path):
    store = Store.create(str(tmp_path))
    RunDir(store, "price-v3").claim(FINGERPRINT)
    RunDir(store, "price-v3").claim(dict(FINGERPRINT))  # the same model again: fine
    other = {**FINGERPRINT, "tensors": 4, "parameters": 9, "digest": "def"}
    with pytest.raises(ValueError, match=r"run_id='price-v3' in the store .* holds checkpoints of another model "
                                         r"\(a torch m.Net with 2 weight tensors, 3 parameters\), not of this one "
                                         r"\(a torch m.Net with 4 weight tensors, 9 parameters\); pass a new run_id"):
        RunDir(store, "price-v3").claim(other)


def test_each_fits_model_file_is_its_own_named_by_its_content_and_never_replaced(tmp_path):
    digest = hashlib.sha256(b"weights of fit 1").hexdigest()[:16]
    assert content_name("model.pt", b"weights of fit 1") == f"model-{digest}.pt"
    assert content_name("model.keras", b"weights of fit 1") == f"model-{digest}.keras"
    run = RunDir(Store.create(str(tmp_path)), "r")
    first = run.write_model("model.pt", b"weights of fit 1")
    assert first == f"file://{tmp_path}/runs/r/model-{digest}.pt"
    second = run.write_model("model.pt", b"weights of fit 2, trained further")  # a resume of the run
    assert second != first
    assert run.store.read(first) == b"weights of fit 1" and run.store.read(second) == b"weights of fit 2, trained further"
    written = (tmp_path / "runs" / "r" / f"model-{digest}.pt").stat().st_mtime_ns
    assert run.write_model("model.pt", b"weights of fit 1") == first  # the same model again: its file, untouched
    assert (tmp_path / "runs" / "r" / f"model-{digest}.pt").stat().st_mtime_ns == written
    (tmp_path / "runs" / "r" / f"model-{digest}.pt").write_bytes(b"weights")  # cut short by a killed fit: rewritten
    assert run.write_model("model.pt", b"weights of fit 1") == first and run.store.read(first) == b"weights of fit 1"


def test_a_store_that_cannot_be_written_says_so(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    store = Store.create(str(blocker / "hvd"))
    with pytest.raises(OSError, match=r"The store '.*a-file/hvd' cannot be written \(.*\); pass a Store on a path that "
                                      r"the driver and every executor can write"):
        store.check_writable()


def test_store_paths_and_an_fsspec_only_filesystem():
    prefix = f"memory://sparkhvd-test-{uuid.uuid4().hex}"
    store = Store.create(prefix)
    store.check_writable()
    run = RunDir(store, "r")
    run.claim(FINGERPRINT)
    url = run.write_checkpoint(1, {"a.bin": lambda out: _write(out, b"x" * 10)})
    assert run.newest() == (1, url)
    assert store.read(f"{url}/a.bin") == b"x" * 10
    assert store.get_run_path("r") == f"{prefix}/runs/r"
    assert store.get_checkpoint_path("r") == f"{prefix}/runs/r/checkpoints"
    assert store.get_logs_path("r") == f"{prefix}/runs/r/logs"
    assert store.get_data_path() == f"{prefix}/intermediate_train_data"
    store.delete(prefix)
    assert Store.create("/x/y").url == "file:///x/y"
    assert type(Store.create("dbfs:/tmp/hvd")).__name__ == "DBFSLocalStore"
    assert Store.create("dbfs:/tmp/hvd").prefix_path == "/dbfs/tmp/hvd"
    with pytest.raises(ValueError, match=r"Store needs a path or URL every worker can reach, got ''"):
        Store.create("")


def _dataset(tmp_path, rows: int, row_group: int) -> str:
    table = pa.table({"x": np.arange(rows, dtype=np.int64)})
    pq.write_table(table, tmp_path / "part-0.parquet", row_group_size=row_group)
    return str(tmp_path)


@pytest.mark.parametrize("rows, ranks, batch", [(20, 3, 3), (21, 2, 5), (17, 4, 2), (9, 2, 4), (10, 3, 10)])
def test_every_row_once_and_the_same_steps_on_every_rank(tmp_path, rows, ranks, batch):
    url = _dataset(tmp_path, rows, row_group=4)
    seen, counts = [], []
    for rank in range(ranks):
        got = list(epoch_batches(url, rows, rank=rank, ranks=ranks, epoch=1, batch_size=batch, shuffle=True, seed=5))
        counts.append(len(got))
        seen += [int(v) for _, b in got for v in b["x"]]
    assert sorted(seen) == list(range(rows))
    assert counts == [steps(rows, ranks, batch)] * ranks == [math.ceil((rows // ranks) / batch)] * ranks


def test_a_resumed_epoch_yields_what_the_uninterrupted_one_did_from_there(tmp_path):
    url = _dataset(tmp_path, 23, row_group=4)
    whole = list(epoch_batches(url, 23, rank=1, ranks=2, epoch=2, batch_size=3, shuffle=True, seed=9))
    consumed = sum(c for c, _ in whole[:2])
    resumed = list(epoch_batches(url, 23, rank=1, ranks=2, epoch=2, batch_size=3, shuffle=True, seed=9, skip=consumed))
    assert [b["x"].tolist() for _, b in resumed] == [b["x"].tolist() for _, b in whole[2:]]


def test_a_store_on_an_s3_compatible_endpoint_keeps_checkpoints_there(s3):
    """Store.create on s3:// with the endpoint in the URL's query (moto's S3 server on 127.0.0.1)."""
    store = Store.create(s3.url("hvd"))
    assert store.url == f"s3://{s3.bucket}/hvd"  # the store's URLs: the prefix without its query
    store.check_writable()
    run = RunDir(store, "r")
    url = run.write_checkpoint(1, {"checkpoint.pt": lambda out: _write(out, b"one")})
    assert run.newest() == (1, url) and url.startswith(f"s3://{s3.bucket}/hvd/runs/r/checkpoints/")
    assert s3.filesystem().get_file_info(f"{s3.bucket}/hvd/runs/r/checkpoints/epoch-00001/{MARKER}").is_file
    again = pickle.loads(pickle.dumps(store))  # as executors get it
    assert again.read(f"{url}/checkpoint.pt") == b"one"
