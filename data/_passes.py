"""How a loader over a dataset URL reads: one reader per iteration, and where a resumed loader starts.

Shared by the torch and tf.data adapters (and so by the converter's loaders). Iteration k of
a loader reads ``num_epochs`` epochs with ``seed + k``: a new order each pass, the same on
every rank. A loader counts its epochs over its iterations: iteration k holds the loader's
epochs ``k * num_epochs`` to ``(k + 1) * num_epochs - 1`` (with ``num_epochs=1``, epoch k is
iteration k; with ``num_epochs=None`` the first iteration never ends and holds them all).
So ``resume_from=(epoch, batch)`` makes the loader's first iteration the uninterrupted
loader's iteration ``k0 = epoch // num_epochs``, started at reader epoch
``epoch % num_epochs``, batch ``batch``, and its iteration j that loader's iteration k0 + j.
"""

from __future__ import annotations

from typing import Callable

from ._checks import _check_positive, _check_resume, _check_seed
from ._plan import ResumePoint, resolve_seed
from ._reader import Reader, make_batch_reader


def url_passes(url, batch_size: int | None, reader_kwargs: dict) -> tuple[Reader, Callable[[int], Reader]]:
    """The reader of a URL loader's first iteration (built now, so argument errors raise at once), and of its iteration k."""
    kwargs = dict(reader_kwargs)
    seed = resolve_seed(_check_seed(kwargs.pop("seed", None)))
    resume_from = _check_resume(kwargs.pop("resume_from", None))
    if isinstance(resume_from, ResumePoint):
        raise ValueError("A loader over a URL does not take a ResumePoint (its iterations read with seeds of their "
                         "own, which a point taken from one reader does not fit); build the reader with "
                         "make_batch_reader(url, ..., resume_from=point) and pass it to the loader.")
    num_epochs = _check_positive("num_epochs", kwargs.get("num_epochs", 1), True, "pass None to read forever, or a positive number of epochs.")
    skipped, start = 0, None  # iterations of the uninterrupted loader skipped; where the first one starts
    if resume_from is not None:
        epoch, batch = resume_from
        skipped, epoch = divmod(epoch, num_epochs) if num_epochs is not None else (0, epoch)
        start = (epoch, batch)

    def reader(k: int) -> Reader:
        return make_batch_reader(url, batch_size=batch_size, seed=seed + skipped + k, resume_from=start if k == 0 else None, **kwargs)

    try:
        first = reader(0)
    except ValueError as exc:
        if resume_from is None or start == resume_from:
            raise
        # The reader's message names its own position; say how the loader's maps to it.
        raise ValueError(
            f"The loader's resume_from={resume_from} is epoch {start[0]} of its iteration {skipped} (num_epochs={num_epochs} "
            f"per iteration), batch {start[1]}: {exc}"
        ) from None
    return first, reader
