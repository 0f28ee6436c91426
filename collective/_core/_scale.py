"""Scaling a tensor by a factor in its own dtype, as Horovod's pre/postscale and Average do."""

from __future__ import annotations

import torch


def scale_(tensor: torch.Tensor, factor: float) -> torch.Tensor:
    """Multiply in place, keeping the dtype: integers are scaled in float64 and truncated toward
    zero, as Horovod scales them; 16-bit floats on a GPU by the factor rounded to their own dtype
    (Horovod's CUDA kernels scale in half precision; on CPU it scales them in float32)."""
    if factor != 1.0:
        if tensor.is_floating_point() and tensor.is_cuda and tensor.element_size() == 2:
            tensor.mul_(torch.tensor(factor, dtype=tensor.dtype).item())
        elif tensor.is_floating_point() or tensor.is_complex():
            tensor.mul_(factor)
        else:
            tensor.copy_(tensor.double().mul_(factor).trunc_())
    return tensor


def scaled(tensor: torch.Tensor, factor: float) -> torch.Tensor:
    """``tensor`` times ``factor`` as a new tensor of the same dtype (see ``scale_``)."""
    return scale_(tensor.clone(), factor) if factor != 1.0 else tensor
