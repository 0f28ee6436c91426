"""The torch adapter: a DataLoader-like iterable of dicts of tensors over a sharded reader.

``import sparkhvd.data.torch`` imports torch; ``import sparkhvd.data`` does not.
"""

from __future__ import annotations

from typing import Any, Iterator

import numpy as np
import torch

from ._reader import Reader, make_batch_reader

__all__ = ["TorchLoader", "make_torch_loader"]


def to_tensor(column: np.ndarray) -> Any:
    """A NumPy column as a tensor; object columns (strings, ragged lists) and types torch lacks stay NumPy."""
    if column.dtype == object:
        return column
    try:
        # Arrow's zero-copy arrays are read-only; torch wants writable memory, so copy those.
        return torch.from_numpy(column) if column.flags.writeable else torch.tensor(column)
    except TypeError:
        return column


class TorchLoader:
    """Iterable of ``{column: tensor}`` batches from a Reader; a context manager that stops the reader."""

    def __init__(self, reader: Reader):
        self.reader = reader

    def __iter__(self) -> Iterator[dict[str, Any]]:
        names = self.reader.schema.names
        for batch in self.reader:
            yield {name: to_tensor(column) for name, column in zip(names, batch)}

    def stop(self) -> None:
        """Stop the reader and its prefetch threads."""
        self.reader.stop()

    def __enter__(self) -> TorchLoader:
        return self

    def __exit__(self, *exc_info) -> None:
        self.reader.stop()


def make_torch_loader(reader_or_url, batch_size: int | None = 32, **reader_kwargs) -> TorchLoader:
    """A loader yielding dicts of tensors with ``batch_size`` rows per batch.

    ``reader_or_url``: a dataset URL, path or list (then ``reader_kwargs`` go to
    make_batch_reader: ``cur_shard``, ``shard_count``, ``num_epochs``, ``equal_steps``, ...), or
    a Reader built with the same ``batch_size`` (or pass ``batch_size=None`` to keep the
    reader's). Every shard yields the same number of batches per epoch (``equal_steps``).
    """
    if isinstance(reader_or_url, Reader):
        if reader_kwargs:
            raise TypeError(f"make_torch_loader got reader options {sorted(reader_kwargs)} with an existing Reader; pass them to make_batch_reader instead, or pass a URL here.")
        if batch_size is not None and batch_size != reader_or_url.batch_size:
            raise ValueError(f"make_torch_loader(batch_size={batch_size}) was given a Reader built with batch_size={reader_or_url.batch_size}; build the reader with make_batch_reader(..., batch_size={batch_size}), or pass batch_size=None to keep the reader's batches.")
        return TorchLoader(reader_or_url)
    return TorchLoader(make_batch_reader(reader_or_url, batch_size=batch_size, **reader_kwargs))
