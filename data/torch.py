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
        # Arrow's zero-copy arrays are read-only; torch wants writable memory, so copy those (NumPy's copy, then
        # torch's view of it: about 3x faster than torch.tensor(column), bench/reader.py --torch)
        return torch.from_numpy(column if column.flags.writeable else column.copy())
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


def _on_device(batches: Iterator[dict[str, Any]], device: torch.device) -> Iterator[dict[str, Any]]:
    """``batches`` with their tensors on a CUDA ``device``: each batch pinned and copied on a side stream while the
    loop works on the one before, so that the copy overlaps the step (one batch ahead). Other values pass as they are.
    """
    stream = torch.cuda.Stream(device)

    def send(batch):
        with torch.cuda.stream(stream):
            moved = {k: v.pin_memory().to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v
                     for k, v in batch.items()}
            copied = torch.cuda.Event()
            copied.record(stream)
        return moved, copied

    ahead = None
    for batch in batches:
        moved = send(batch)
        if ahead is not None:
            yield _ready(*ahead, device)
        ahead = moved
    if ahead is not None:
        yield _ready(*ahead, device)


def _ready(batch: dict[str, Any], copied, device) -> dict[str, Any]:
    """A batch copied on the side stream, made safe to use on the current stream: it waits for this batch's copy
    (``copied``, an event), not for the next one's queued since, and owns the memory from here on."""
    current = torch.cuda.current_stream(device)
    current.wait_event(copied)
    for value in batch.values():
        if isinstance(value, torch.Tensor):
            value.record_stream(current)
    return batch


def _device(device) -> torch.device | None:
    """``device`` as a torch.device where batches must move to a GPU; None for CPU (nothing to do)."""
    if device is None:
        return None
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device={device!r} is not a torch device ({exc}); pass 'cuda', 'cuda:0', a torch.device, "
                         "or None to keep batches on the CPU.") from None
    if device.type == "cpu":
        return None
    if device.type != "cuda":
        raise ValueError(f"device={str(device)!r}: the loader moves batches to a CUDA device only; pass 'cuda' (or "
                         "None, and move them yourself).")
    if not torch.cuda.is_available():
        raise ValueError(f"device={str(device)!r}, but torch sees no CUDA device here; pass device=None on a CPU "
                         "host, or check CUDA_VISIBLE_DEVICES.")
    return device if device.index is not None else torch.device("cuda", torch.cuda.current_device())


class TorchLoader:
    """Iterable of ``{column: tensor}`` batches; a context manager that stops the reader in use.

    With ``again`` (a loader built from a URL), each iteration reads afresh: the first with
    ``reader``, iteration k with ``again(k)``. Without it, ``reader`` is read once, and a
    second iteration raises RuntimeError rather than silently yielding nothing.
    """

    def __init__(self, reader: Reader, again: Callable[[int], Reader] | None = None, device: torch.device | None = None):
        self.reader = reader  # the reader of the latest iteration
        self._again = again
        self._device = device  # a CUDA device the batches move to, one ahead; None: they stay on the CPU
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
        batches = _tensors(reader, owned=self._again is not None)
        return batches if self._device is None else _on_device(batches, self._device)

    def stop(self) -> None:
        """Stop the reader in use and its prefetch threads."""
        self.reader.stop()

    def __enter__(self) -> TorchLoader:
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()


def make_torch_loader(reader_or_url, batch_size: int | None = 32, *, device=None, **reader_kwargs) -> TorchLoader:
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

    ``device="cuda"`` (or ``"cuda:1"``, a torch.device) yields the tensors on that GPU: each batch
    is pinned and copied on a side stream while the loop works on the one before. ``None`` or
    ``"cpu"`` leaves them on the CPU (nothing is copied).
    """
    device = _device(device)
    if isinstance(reader_or_url, Reader):
        if reader_kwargs:
            raise TypeError(f"make_torch_loader got reader options {sorted(reader_kwargs)} with an existing Reader; pass them to make_batch_reader instead, or pass a URL here.")
        if batch_size is not None and batch_size != reader_or_url.batch_size:
            raise ValueError(f"make_torch_loader(batch_size={batch_size}) was given a Reader built with batch_size={reader_or_url.batch_size}; build the reader with make_batch_reader(..., batch_size={batch_size}), or pass batch_size=None to keep the reader's batches.")
        return TorchLoader(reader_or_url, device=device)
    first, again = url_passes(reader_or_url, batch_size, reader_kwargs)
    return TorchLoader(first, again, device=device)
