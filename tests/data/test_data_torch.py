"""The torch adapter (import weight and the TensorFlow guard: test_data_imports.py)."""

from __future__ import annotations

import pytest
import torch

from sparkhvd.data import make_batch_reader
from sparkhvd.data.torch import make_torch_loader


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
