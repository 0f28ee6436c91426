"""The torch adapter (import weight and the TensorFlow guard: test_data_imports.py)."""

from __future__ import annotations

import pytest
import torch

from sparkhvd.data import make_batch_reader
from sparkhvd.data.torch import make_torch_loader

pytestmark = pytest.mark.unit


def test_loader_collates_to_tensors_with_equal_steps(dataset):
    loaders = [make_torch_loader(dataset, batch_size=8, cur_shard=k, shard_count=2, seed=1) for k in range(2)]
    shards = []
    for loader in loaders:
        with loader:
            shards.append(list(loader))
    assert len(shards[0]) == len(shards[1]) == 7  # 50 rows per shard: 6 full batches of 8 and one of 2
    batch = shards[0][0]
    assert set(batch) == {"id", "label", "vec"}
    assert batch["id"].dtype == torch.int64 and batch["id"].shape == (8,)
    assert batch["vec"].dtype == torch.float32 and batch["vec"].shape == (8, 3)
    batch["vec"] += 1  # writable
    ids = sorted(int(i) for shard in shards for b in shard for i in b["id"])
    assert ids == list(range(100))


def test_loader_over_an_existing_reader(dataset):
    reader = make_batch_reader(dataset, batch_size=50, schema_fields=["label"])
    with make_torch_loader(reader, batch_size=None) as loader:
        batches = list(loader)
    assert [b["label"].shape for b in batches] == [(50,), (50,)]


def test_loader_rejects_a_reader_with_another_batch_size_or_options(dataset):
    reader = make_batch_reader(dataset, batch_size=10)
    with pytest.raises(ValueError, match=r"make_torch_loader\(batch_size=32\) was given a Reader built with batch_size=10; build the reader with make_batch_reader\(\.\.\., batch_size=32\)"):
        make_torch_loader(reader, batch_size=32)
    with pytest.raises(TypeError, match=r"make_torch_loader got reader options \['num_epochs'\] with an existing Reader"):
        make_torch_loader(reader, batch_size=10, num_epochs=2)
    reader.stop()


def _pass_ids(loader):
    return [int(i) for batch in loader for i in batch["id"]]


def test_each_iteration_of_a_url_loader_reads_afresh_in_a_new_order_the_same_on_every_rank(dataset):
    # for epoch in range(E): for batch in loader  -- every epoch must read its rows, not yield nothing.
    loaders = [make_torch_loader(dataset, batch_size=8, cur_shard=k, shard_count=2, seed=3) for k in range(2)]
    passes = [[_pass_ids(loader) for _ in range(3)] for loader in loaders]
    for k in range(3):
        assert sorted(passes[0][k] + passes[1][k]) == list(range(100))  # each pass: every row once over the ranks
        assert len(passes[0][k]) == len(passes[1][k]) == 50
    assert passes[0][0] != passes[0][1] != passes[0][2]  # a new order each pass
    again = make_torch_loader(dataset, batch_size=8, cur_shard=0, shard_count=2, seed=3)
    assert [_pass_ids(again) for _ in range(3)] == passes[0]  # pass k reads with seed + k, so ranks agree
    first_of_seed_4 = make_torch_loader(dataset, batch_size=8, cur_shard=0, shard_count=2, seed=4)
    assert _pass_ids(first_of_seed_4) == passes[0][1]


def test_num_epochs_counts_epochs_per_iteration_of_a_url_loader(dataset):
    loader = make_torch_loader(dataset, batch_size=10, num_epochs=2, cur_shard=0, shard_count=1)
    for _ in range(2):
        ids = _pass_ids(loader)
        assert len(ids) == 200 and sorted(ids) == sorted(list(range(100)) * 2)


def test_a_loader_over_a_reader_refuses_a_second_iteration(dataset, no_leaked_threads):
    reader = make_batch_reader(dataset, batch_size=10)
    loader = make_torch_loader(reader, batch_size=None)
    assert sorted(_pass_ids(loader)) == list(range(100))
    with pytest.raises(RuntimeError, match=r"This TorchLoader wraps a Reader, which can be read once, and is being iterated a second time .*; pass a dataset URL to make_torch_loader so that each iteration builds a fresh reader, or make a new reader with make_batch_reader for each pass\."):
        iter(loader)


def test_a_bool_column_is_torch_bool_not_petastorms_uint8(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"flag": [True, False, True]}), tmp_path / "part-0.parquet")
    with make_torch_loader(tmp_path, batch_size=3, shuffle_row_groups=False) as loader:
        batch = next(iter(loader))
    assert batch["flag"].tolist() == [True, False, True]
    assert batch["flag"].dtype == torch.bool  # docs/data.md: the choice, and .to(torch.uint8) for Petastorm's


def test_device_cpu_or_none_leaves_batches_as_they_are_and_bad_devices_are_refused(dataset):
    plain = [b["id"] for b in make_torch_loader(dataset, batch_size=16, seed=4)]
    on_cpu = [b["id"] for b in make_torch_loader(dataset, batch_size=16, seed=4, device="cpu")]
    assert all(a.device.type == "cpu" for a in on_cpu) and all(torch.equal(a, b) for a, b in zip(plain, on_cpu))
    with pytest.raises(ValueError, match=r"device='nowhere' is not a torch device .*; pass 'cuda', 'cuda:0'"):
        make_torch_loader(dataset, device="nowhere")
    with pytest.raises(ValueError, match=r"device='meta': the loader moves batches to a CUDA device only"):
        make_torch_loader(dataset, device="meta")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"device='cuda', but torch sees no CUDA device here; pass device=None"):
            make_torch_loader(dataset, device="cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_device_cuda_yields_the_same_batches_on_the_gpu_one_ahead(dataset):
    plain = list(make_torch_loader(dataset, batch_size=16, seed=4))
    with make_torch_loader(dataset, batch_size=16, seed=4, device="cuda") as loader:
        moved = list(loader)
    assert len(moved) == len(plain)
    for cpu, gpu in zip(plain, moved):
        assert gpu["id"].is_cuda and gpu["vec"].is_cuda
        assert torch.equal(gpu["id"].cpu(), cpu["id"]) and torch.equal(gpu["vec"].cpu(), cpu["vec"])
