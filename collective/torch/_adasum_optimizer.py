"""``DistributedOptimizer(op=hvd.Adasum)``: Horovod's ``_DistributedAdasumOptimizer`` (horovod/torch/optimizer.py).

The local step comes first and the change it made is what the ranks combine: when a parameter's
gradient has accumulated ``backward_passes_per_step`` times, its hook copies the parameter
(``start``), runs the wrapped optimizer's step on that parameter alone (with this rank's own
optimizer state, e.g. momentum built from this rank's gradients), turns the parameter into the
change (``p - start``; the parameter holds it until ``step()``, as in Horovod) and submits its
Adasum, named after the parameter. ``step()`` does the same for the parameters whose hooks did
not fire (fewer backward passes, or no gradient: their change is what the optimizer makes of
it, usually zero), waits for every reduction, and sets each parameter to
``start + Adasum(changes)``. Gradients are summed over the backward passes, never averaged.
"""

from __future__ import annotations

import contextlib
import weakref

import torch

from ..._common import metrics as _metrics
from .._core._allreduce import allreduce_async_
from .._core._barrier import check
from .._core._handles import synchronize
from .._core._reduction import Adasum
from ._wrapped import WrappedOptimizer, check_passes


class _AdasumMixin(WrappedOptimizer):
    """Placed before the user's optimizer class: each ``step()`` applies the Adasum of the ranks' local steps."""

    def _hvd_adasum_setup(self, names: dict, compression, passes: int, process_set, serial: int) -> None:
        self._hvd_names = names
        self._hvd_compression = compression
        self._hvd_backward_passes = passes
        self._hvd_label = f"optimizer {serial}"  # names its reductions, so that two optimizers' never pair up
        self._hvd_starts: dict = {}  # id(p) -> the parameter before its local step (Horovod's _starting_models)
        self._hvd_counts: dict = {}  # id(p) -> gradients accumulated since the last step()
        self._hvd_handles: dict = {}  # id(p) -> (p, handle, compression context): its change in flight
        trainable = self._hvd_trainable()
        check(f"DistributedOptimizer {serial}", trainable, process_set, extra="op=Adasum")  # the same model everywhere
        ref = weakref.ref(self)  # the hooks must not keep a dropped optimizer alive

        def hook(p, ref=ref):
            opt = ref()
            if opt is not None:
                opt._hvd_on_grad(p)

        for p in trainable:
            if p.grad is None:  # as Horovod: a parameter without a gradient still takes its (zero) step
                p.grad = torch.zeros_like(p)
            p.register_post_accumulate_grad_hook(hook)

    def _hvd_on_grad(self, p: torch.Tensor) -> None:
        count = self._hvd_counts.get(id(p), 0) + 1
        if count > self._hvd_backward_passes:
            raise RuntimeError(f"gradients were computed {count} times before optimizer.step(), more than "
                               f"backward_passes_per_step={self._hvd_backward_passes}; pass backward_passes_per_step="
                               f"{count} to DistributedOptimizer to accumulate them locally.")
        self._hvd_counts[id(p)] = count
        if count == self._hvd_backward_passes:
            self._hvd_start(p)

    def _hvd_start(self, p: torch.Tensor) -> None:
        """The local step on ``p`` alone, then the Adasum of its change (in flight until ``step()``)."""
        start = self._hvd_starts.get(id(p))
        if start is None:
            start = self._hvd_starts[id(p)] = torch.empty_like(p, requires_grad=False)
        with torch.no_grad():
            start.copy_(p)
        stashed = [group["params"] for group in self.param_groups]
        setattr(self, _metrics.INNER_STEP, True)  # not a step of its own (RunResult.metrics' optimizer steps)
        try:
            for group in self.param_groups:  # only want to step on p (Horovod's words)
                group["params"] = [p] if any(p is v for v in group["params"]) else []
            super().step()
        finally:
            setattr(self, _metrics.INNER_STEP, False)
            for group, params in zip(self.param_groups, stashed):
                group["params"] = params
        with torch.no_grad():
            p.sub_(start)
        wire, ctx = self._hvd_compression.compress(p.detach())
        name = f"{self._hvd_label}: {self._hvd_names.get(id(p), 'param')}"
        self._hvd_handles[id(p)] = (p, allreduce_async_(wire, name=name, op=Adasum,
                                                        _what="DistributedOptimizer(op=Adasum)"), ctx)

    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for p in self._hvd_trainable():
            if id(p) not in self._hvd_handles:
                self._hvd_start(p)
        handles, self._hvd_handles = self._hvd_handles, {}
        self._hvd_counts = {}
        failure = None
        for key, (p, handle, ctx) in handles.items():  # every one, even after a failure: each frees its name
            try:
                delta = self._hvd_compression.decompress(synchronize(handle), ctx)
            except Exception as exc:  # noqa: BLE001 - the first is raised once all are waited
                failure = failure or exc
                continue
            start = self._hvd_starts[key]
            with torch.no_grad():
                start.add_(delta)
                p.copy_(start)
        if failure is not None:
            raise failure
        _metrics.optimizer_step()  # one step (torch's hooks ran per parameter, not for it: step.hooked below)
        return loss

    step.hooked = True  # torch.optim.Optimizer must not wrap it again: the base step runs its hooks per parameter

    def synchronize(self) -> None:
        """Nothing to do: ``step()`` applies the reduced changes (as Horovod's Adasum optimizer)."""

    @contextlib.contextmanager
    def skip_synchronize(self):
        raise AssertionError("optimizer.skip_synchronize() is not supported with op=hvd.Adasum (as in Horovod): "
                             "each parameter's change is reduced after its local step, so there are no reduced "
                             "gradients to clip before step(); drop the skip_synchronize() block, or use "
                             "op=hvd.Average.")
        yield  # never reached: makes this a generator, as contextmanager needs

    def zero_grad(self, set_to_none: bool = True):
        if self._hvd_counts or self._hvd_handles:
            raise RuntimeError("optimizer.zero_grad() was called after loss.backward() but before optimizer.step(), "
                               "while parameter changes were being reduced; call zero_grad() before the backward "
                               "pass (with backward_passes_per_step=N, after the N-th step).")
        return super().zero_grad(set_to_none=set_to_none)

    def set_backward_passes_per_step(self, passes: int) -> None:
        """Change how many backward passes accumulate locally before each local step (Horovod's method)."""
        passes = check_passes(passes)
        if self._hvd_counts or self._hvd_handles:
            raise RuntimeError("set_backward_passes_per_step() was called while parameter changes were being "
                               "reduced; call it right after optimizer.step().")
        self._hvd_backward_passes = passes
