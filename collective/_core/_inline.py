"""The small-tensor fast path: a CPU reduction small enough rides in the control frames.

Each member sends its bytes with its request; the coordinator reduces them in set order and
sends every member the same result, so every rank gets the same bits and no gloo collective
runs at all. It is for tensors small enough that a gloo allreduce's own cost dominates
(``bench/allreduce.py`` measures both; docs/performance.md has the numbers).
"""

from __future__ import annotations

import numpy as np
import torch

from .._engine.messages import Layout

_BUDGET = 1 << 20  # bytes the coordinator receives for one op, over all its members
_DTYPES = {torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8, torch.int32,
           torch.int64}
_COMBINE = {"Average": torch.add, "Sum": torch.add, "Min": torch.minimum, "Max": torch.maximum,
            "Product": torch.mul}  # by the op's name, as the request carries it
# dtypes whose tensors numpy views as torch does: the calling thread's path (``Engine.pair_now``) reads and writes
# them through numpy, in fewer steps per call than torch's views
NUMPY_OF = {torch.float32: np.float32, torch.float64: np.float64, torch.int8: np.int8, torch.uint8: np.uint8,
            torch.int32: np.int32, torch.int64: np.int64}
# and reduces them as torch does (IEEE, wrapping integers), at a fraction of torch's cost per call on small ones
# (4 KB at np=2: 70 us an op against 95); from about a megabyte numpy's fresh result costs more than torch's
# (1 MB: 1.6 ms against 0.93), hence torch above _NUMPY_BYTES. Every rank reduces an op with this one function.
_NUMPY_BYTES = 64 << 10
_NUMPY = {str(t).replace("torch.", ""): n for t, n in NUMPY_OF.items()}
_NUMPY_COMBINE = {"Average": np.add, "Sum": np.add, "Min": np.minimum, "Max": np.maximum, "Product": np.multiply}


def capacity(size: int) -> int:
    """The most bytes one member's tensor may have to ride inline in a set of ``size``."""
    return _BUDGET // max(1, size - 1) // 64 * 64


def fits(tensor: torch.Tensor, size: int, nbytes: int | None = None) -> bool:
    """Whether a reduction of ``tensor`` (or of ``nbytes`` of its dtype and device) rides inline (decided
    alike on ranks whose signatures agree)."""
    nbytes = tensor.numel() * tensor.element_size() if nbytes is None else nbytes
    return size > 1 and tensor.device.type == "cpu" and tensor.dtype in _DTYPES and 0 < nbytes <= capacity(size)


def wire_bytes(flat: torch.Tensor) -> memoryview:
    """A contiguous 1-D tensor's bytes, without a copy."""
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")


def reduce(layout: Layout, payloads: list) -> memoryview:
    """The coordinator's reduction of an inline op (``layout``: its dtype and op): the members' payloads (in set
    order) -> the result's bytes."""
    np_dtype = _NUMPY.get(layout.dtype)
    if np_dtype is not None and len(payloads[0]) <= _NUMPY_BYTES:
        combine = _NUMPY_COMBINE[layout.op]
        arrays = [np.frombuffer(p, dtype=np_dtype) for p in payloads]
        with np.errstate(all="ignore"):  # an overflow to inf is no warning, as in torch
            result = combine(arrays[0], arrays[1]) if len(arrays) > 1 else arrays[0].copy()
            for a in arrays[2:]:
                combine(result, a, out=result)
        return memoryview(result).cast("B")
    dtype = getattr(torch, layout.dtype)
    combine = _COMBINE[layout.op]
    tensors = [torch.frombuffer(p, dtype=dtype) for p in payloads]  # none requires grad: no autograd here
    result = combine(tensors[0], tensors[1]) if len(tensors) > 1 else tensors[0].clone()
    for t in tensors[2:]:
        combine(result, t, out=result)
    return wire_bytes(result)


def read(result, dtype: torch.dtype) -> torch.Tensor:
    """The reduced tensor (flat) from the answer's bytes, without a copy."""
    return torch.frombuffer(result, dtype=dtype)
