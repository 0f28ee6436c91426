"""The argument checks of make_batch_reader and the loaders: each error says what was given and what to pass."""

from __future__ import annotations

import operator
import sys
from typing import Sequence

from ._errors import ArgumentTypeError
from ._plan import ResumePoint


def _default_shard() -> tuple[int, int]:
    """``(rank, size)`` of the initialized ``sparkhvd.collective.torch`` communicator, else ``(0, 1)``.

    Looks the module up in ``sys.modules`` only, so it never imports torch itself.
    """
    hvd = sys.modules.get("sparkhvd.collective.torch")
    is_initialized = getattr(hvd, "is_initialized", None)
    if is_initialized is None or not is_initialized():
        return 0, 1
    return int(hvd.rank()), int(hvd.size())


def _as_int(name: str, value, fix: str) -> int:
    if isinstance(value, bool):
        raise ArgumentTypeError(f"{name} must be an int, got the bool {value!r}; {fix}")
    try:
        return operator.index(value)
    except TypeError:
        raise ArgumentTypeError(f"{name} must be an int, got {type(value).__name__} {value!r}; {fix}") from None


def _check_shard(cur_shard, shard_count) -> tuple[int, int]:
    if cur_shard is None and shard_count is None:
        return _default_shard()
    if cur_shard is None or shard_count is None:
        raise ValueError(f"Pass both cur_shard and shard_count or neither (got cur_shard={cur_shard!r}, shard_count={shard_count!r}); e.g. cur_shard=hvd.rank(), shard_count=hvd.size().")
    fix = "pass e.g. cur_shard=hvd.rank(), shard_count=hvd.size()."
    cur_shard, shard_count = _as_int("cur_shard", cur_shard, fix), _as_int("shard_count", shard_count, fix)
    if shard_count < 1:
        raise ValueError(f"shard_count must be at least 1, got {shard_count}; {fix}")
    if not 0 <= cur_shard < shard_count:
        raise ValueError(f"cur_shard must satisfy 0 <= cur_shard < shard_count, got cur_shard={cur_shard}, shard_count={shard_count}; {fix}")
    return cur_shard, shard_count


def _check_seed(seed) -> int | None:
    if seed is not None and (_as_int("seed", seed, "pass a non-negative int.") < 0):
        raise ValueError(f"seed must be a non-negative int or None, got {seed}; pass e.g. seed=42 (the same on every rank).")
    return seed


def _check_positive(name: str, value, allow_none: bool, fix: str) -> int | None:
    if value is None and allow_none:
        return None
    value = _as_int(name, value, fix)
    if value < 1:
        raise ValueError(f"{name} must be at least 1, got {value}; {fix}")
    return value


def _check_resume(resume_from, unit: str = "batch") -> tuple[int, int] | None:
    """``resume_from`` as an ``(epoch, batch)`` (or ``(epoch, row)``) pair of non-negative ints, or None; its bounds are checked against the plan."""
    if resume_from is None:
        return None
    if isinstance(resume_from, ResumePoint):
        if unit != "batch":
            raise ValueError("make_reader does not take a ResumePoint (make_batch_reader's resume_from at another "
                             "number of shards); pass resume_from=(epoch, row), or read with make_batch_reader.")
        return resume_from
    fix = (f"pass the (epoch, {unit}) that the interrupted run had reached, e.g. resume_from=(2, 37), or None to start at "
           "the beginning.")
    if isinstance(resume_from, (str, bytes)) or not isinstance(resume_from, Sequence) or len(resume_from) != 2:
        raise ArgumentTypeError(f"resume_from must be a pair (epoch, {unit}) of ints, got {type(resume_from).__name__} {resume_from!r}; {fix}")
    epoch, position = (_as_int(f"resume_from's {name}", value, fix) for name, value in zip(("epoch", unit), resume_from))
    if epoch < 0 or position < 0:
        raise ValueError(f"resume_from=({epoch}, {position}) has a negative {'epoch' if epoch < 0 else unit}; epochs and "
                         f"{unit}{'es' if unit == 'batch' else 's'} count from 0, so {fix}")
    return epoch, position
