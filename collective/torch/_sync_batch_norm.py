"""``SyncBatchNorm``: batch normalization with statistics over every rank's batch.

torch's own ``nn.SyncBatchNorm`` only runs on CUDA; this one uses plain tensor ops, so it
runs on CPU (gloo) and GPU (NCCL) alike. Training mode normalizes with the mean and variance
of the union of all ranks' batches (two small allreduces: the sum, then the squared
deviations); backward reduces the two per-channel sums it needs. Weight and bias gradients
stay local, for DistributedOptimizer to average, which makes a step equal to BatchNorm on the
concatenated batch. Evaluation mode, and a job of one, is plain BatchNorm.
"""

from __future__ import annotations

import torch
from torch.nn.modules.batchnorm import _BatchNorm

from .._core._allreduce import allreduce_async_
from .._core._ops import now
from .._core._process_sets import global_process_set
from .._core._reduction import Sum
from .._engine import communicator as _engine


def _sum_all(t: torch.Tensor) -> torch.Tensor:
    """The sum over every rank, in place (a joined rank adds zeros: a count of 0)."""
    return now(allreduce_async_, t, op=Sum, process_set=global_process_set, _what="SyncBatchNorm")


class _SyncBatchNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, eps, momentum):
        dims = [0] + list(range(2, x.dim()))
        shape = [1, -1] + [1] * (x.dim() - 2)
        acc = torch.float64 if x.dtype == torch.float64 else torch.float32
        xa = x.to(acc)
        count = torch.tensor([x.numel() // x.shape[1]], dtype=acc, device=x.device)
        head = _sum_all(torch.cat([xa.sum(dims), count]))
        total = head[-1]
        if total.item() < 2:
            raise ValueError(f"SyncBatchNorm needs more than one value per channel across all ranks in training, "
                             f"got {int(total.item())} in total; use larger batches, or eval mode to normalize "
                             "with the running statistics.")
        mean = head[:-1] / total
        var = _sum_all(((xa - mean.view(shape)) ** 2).sum(dims)) / total
        invstd = torch.rsqrt(var + eps)
        if running_mean is not None:
            with torch.no_grad():
                running_mean.mul_(1 - momentum).add_(mean.to(running_mean.dtype), alpha=momentum)
                unbiased = var * total / (total - 1)
                running_var.mul_(1 - momentum).add_(unbiased.to(running_var.dtype), alpha=momentum)
        xhat = (xa - mean.view(shape)) * invstd.view(shape)
        ctx.save_for_backward(xhat, invstd, weight)
        ctx.total = total
        y = xhat
        if weight is not None:
            y = y * weight.to(acc).view(shape) + bias.to(acc).view(shape)
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        xhat, invstd, weight = ctx.saved_tensors
        dims = [0] + list(range(2, xhat.dim()))
        shape = [1, -1] + [1] * (xhat.dim() - 2)
        g = grad.to(xhat.dtype)
        local_sum_g = g.sum(dims)
        local_sum_gx = (g * xhat).sum(dims)
        sums = _sum_all(torch.cat([local_sum_g, local_sum_gx]))
        c = local_sum_g.numel()
        mean_g, mean_gx = sums[:c] / ctx.total, sums[c:] / ctx.total
        scale = invstd if weight is None else invstd * weight.to(xhat.dtype)
        dx = scale.view(shape) * (g - mean_g.view(shape) - xhat * mean_gx.view(shape))
        grad_weight = local_sum_gx.to(weight.dtype) if weight is not None else None
        grad_bias = local_sum_g.to(weight.dtype) if weight is not None else None
        return dx.to(grad.dtype), grad_weight, grad_bias, None, None, None, None


class SyncBatchNorm(_BatchNorm):
    """Batch normalization over the union of every rank's batch (Horovod's ``hvd.SyncBatchNorm``).

    Takes ``BatchNorm1d/2d/3d``'s arguments and any input of two or more dimensions.
    """

    def _check_input_dim(self, x):
        if x.dim() < 2:
            raise ValueError(f"SyncBatchNorm expects an input of at least 2 dimensions (N, C, ...), got {x.dim()}.")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(x)
        batch_stats = self.training or not self.track_running_stats  # as torch.nn.SyncBatchNorm
        if not batch_stats or not _engine.is_initialized() or _engine.topology().size == 1:
            return super().forward(x)
        momentum = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:  # a cumulative moving average
                momentum = 1.0 / float(self.num_batches_tracked)
        running = self.training and self.track_running_stats
        return _SyncBatchNormFn.apply(x, self.weight, self.bias, self.running_mean if running else None,
                                      self.running_var if running else None, self.eps, momentum)
