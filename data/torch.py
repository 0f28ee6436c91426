"""The torch adapter: a DataLoader-like iterable of dicts of tensors over a sharded reader.

``import sparkhvd.data.torch`` imports torch; ``import sparkhvd.data`` does not.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Iterator

import numpy as np
import torch

from ._passes import url_passes
from ._reader import Reader

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


def _tensors(reader: Reader, owned: bool) -> Iterator[dict[str, Any]]:
    """One pass over ``reader`` as dicts of tensors; stops an ``owned`` reader when the pass ends or is left.

    A function, not a method, so that a pass holds no reference to its loader.
    """
    names = reader.schema.names
    try:
        for batch in reader:
            yield {name: to_tensor(column) for name, column in zip(names, batch)}
    finally:
        if owned:  # a loop left with break: the pass's reader is not read again, end its threads now
            reader.stop()


class TorchLoader:
    """Iterable of ``{column: tensor}`` batches; a context manager that stops the reader in use.

    With ``again`` (a loader built from a URL), each iteration reads afresh: the first with
    ``reader``, iteration k with ``again(k)``. Without it, ``reader`` is read once, and a
    second iteration raises RuntimeError rather than silently yielding nothing.
    """

    def __init__(self, reader: Reader, again: Callable[[int], Reader] | None = None):
        self.reader = reader  # the reader of the latest iteration
        self._again = again
        self._iterations = 0
        self._lock = threading.Lock()

    def __iter__(self) -> Iterator[dict[str, Any]]:
        with self._lock:
            k, self._iterations = self._iterations, self._iterations + 1
        if k and self._again is None:
            raise RuntimeError(
                "This TorchLoader wraps a Reader, which can be read once, and is being iterated a second time (as in "
                "'for epoch in range(E): for batch in loader'); pass a dataset URL to make_torch_loader so that each "
                "iteration builds a fresh reader, or make a new reader with make_batch_reader for each pass."
            )
        reader = self.reader if k == 0 else self._again(k)
        with self._lock:
            self.reader = reader
        return _tensors(reader, owned=self._again is not None)

    def stop(self) -> None:
        """Stop the reader in use and its prefetch threads."""
        self.reader.stop()

    def __enter__(self) -> TorchLoader:
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()


def make_torch_loader(reader_or_url, batch_size: int | None = 32, **reader_kwargs) -> TorchLoader:
    """A loader yielding dicts of tensors with ``batch_size`` rows per batch.

    ``reader_or_url``: a dataset URL, path or list (then ``reader_kwargs`` go to
    make_batch_reader: ``cur_shard``, ``shard_count``, ``num_epochs``, ``seed``, ...), and each
    iteration of the loader builds a fresh reader, iteration k with ``seed + k`` (a new order
    each pass, the same on every rank; ``num_epochs`` counts epochs per iteration), so
    ``for epoch in range(E): for batch in loader`` reads E passes; or a Reader built with the
    same ``batch_size`` (or pass ``batch_size=None`` to keep the reader's), which can be
    iterated once (a second iteration raises RuntimeError). Every shard yields the same
    number of batches per epoch (``equal_steps``).

    ``resume_from=(epoch, batch)`` (a URL only) resumes a loader mid-epoch without reading the
    skipped batches: ``epoch`` counts the loader's epochs over its iterations (with the default
    ``num_epochs=1``, epoch k is iteration k), so the first iteration continues the
    uninterrupted loader's iteration ``epoch // num_epochs`` from that batch and later
    iterations follow it with the same seeds; loop ``for epoch in range(resumed_epoch, E)``.
    ``batch`` counts the batches yielded in that epoch, as in make_batch_reader.
    """
    if isinstance(reader_or_url, Reader):
        if reader_kwargs:
            raise TypeError(f"make_torch_loader got reader options {sorted(reader_kwargs)} with an existing Reader; pass them to make_batch_reader instead, or pass a URL here.")
        if batch_size is not None and batch_size != reader_or_url.batch_size:
            raise ValueError(f"make_torch_loader(batch_size={batch_size}) was given a Reader built with batch_size={reader_or_url.batch_size}; build the reader with make_batch_reader(..., batch_size={batch_size}), or pass batch_size=None to keep the reader's batches.")
        return TorchLoader(reader_or_url)
    first, again = url_passes(reader_or_url, batch_size, reader_kwargs)
    return TorchLoader(first, again)
