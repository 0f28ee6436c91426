"""``DistributedOptimizer``: any torch optimizer, with gradients averaged across ranks."""

from __future__ import annotations

import collections
import contextlib
import functools
import itertools
import warnings
import weakref

import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from .._core._adasum import hosts_per_reduction
from .._core._allgather import sparse_allreduce_async
from .._core._allreduce import allreduce_async_
from .._core._barrier import check
from .._core._basics import size as _job_size
from .._core._buffers import fusion_threshold
from .._core._ops import now
from .._core._process_sets import ProcessSet, global_process_set
from .._core._reduction import Adasum, Average, ReduceOp, Sum, resolve_op
from .._core._scale import scale_
from ._adasum_optimizer import _AdasumMixin
from ._compression import Compression
from ._fusion import GradientBuckets, finish_allreduce, launch_allreduce, write_back
from ._wrapped import WrappedOptimizer
from ._wrapped import check_passes as _check_passes

_serials: dict = collections.defaultdict(itertools.count)  # link_id -> numbers for the set's optimizers


class _DistributedMixin(WrappedOptimizer):
    """Placed before the user's optimizer class: reduces gradients before each ``step()``."""

    def _hvd_setup(self, names, op, gradient_predivide_factor, backward_passes_per_step,
                   compression, sparse_as_dense, process_set):
        self._hvd_names = names
        self._hvd_op = op
        self._hvd_predivide = float(gradient_predivide_factor)
        self._hvd_backward_passes = int(backward_passes_per_step)
        self._hvd_synchronized = False
        self._hvd_skip = False
        self._hvd_compression = compression
        self._hvd_sparse_as_dense = bool(sparse_as_dense)
        self._hvd_process_set = process_set
        self._hvd_buckets = None
        if not isinstance(process_set, ProcessSet):
            raise ValueError(f"process_set must be a ProcessSet, got {type(process_set).__name__}.")
        process_set._check()
        self._hvd_member = process_set.included()
        if not self._hvd_member:  # as in Horovod: a rank outside the set trains on its own gradients
            return
        self._hvd_serial = next(_serials[process_set.link_id])  # alike on every member, whatever other sets do
        size = process_set.size()
        trainable = [p for group in self.param_groups for p in group["params"] if p.requires_grad]
        check(f"DistributedOptimizer {self._hvd_serial}", trainable, process_set,  # the same model everywhere
              extra=f"op={op.name}")
        if size > 1 and trainable:
            average = op == Average
            self._hvd_buckets = GradientBuckets(
                trainable, threshold=fusion_threshold(), passes=self._hvd_backward_passes,
                reduce_launch=functools.partial(launch_allreduce, op_is_average=average,
                                                predivide=self._hvd_predivide, compression=compression,
                                                process_set=process_set),
                reduce_finish=functools.partial(finish_allreduce, op_is_average=average,
                                                predivide=self._hvd_predivide, size=size, compression=compression),
                reduce_sparse=None if sparse_as_dense else self._hvd_reduce_sparse,
                label=f"optimizer {self._hvd_serial}")

    def set_backward_passes_per_step(self, passes: int) -> None:
        """Change how many backward passes accumulate locally before each reduction (Horovod's method)."""
        passes = _check_passes(passes)
        if self._hvd_buckets is not None:
            if self._hvd_buckets.in_flight():
                raise RuntimeError("set_backward_passes_per_step() was called while gradients were being reduced; "
                                   "call it right after optimizer.step().")
            self._hvd_buckets._passes = passes
        self._hvd_backward_passes = passes

    def synchronize(self) -> None:
        """Finish reducing every gradient now (``step()`` then skips it, e.g. after gradient clipping)."""
        if not self._hvd_member:
            self._hvd_synchronized = True
            return
        buckets = self._hvd_buckets
        if buckets is None:
            self._reduce_reference(self._hvd_trainable())
        else:
            buckets.finish()
            late = [p for p in self._hvd_trainable() if id(p) not in buckets._where]
            if late:  # parameters made trainable after wrapping: the reference path
                self._reduce_reference(late)
        self._hvd_synchronized = True

    def zero_grad(self, set_to_none: bool = True):
        if self._hvd_buckets is not None and self._hvd_buckets.in_flight():
            raise RuntimeError("optimizer.zero_grad() was called after loss.backward() but before optimizer.step() "
                               "or optimizer.synchronize(), while gradients were being reduced; call zero_grad() "
                               "before the backward pass (with backward_passes_per_step=N, after the N-th step).")
        return super().zero_grad(set_to_none=set_to_none)

    def _hvd_reduce_sparse(self, grad: torch.Tensor):
        """Start reducing a sparse gradient as Horovod does (gathered indices and values)."""
        return sparse_allreduce_async(grad, op=self._hvd_op, process_set=self._hvd_process_set)

    def _reduce_reference(self, params: list) -> None:
        """The readable reference: at step time, one fused allreduce per dtype and device; sparse
        gradients gathered (or, with ``sparse_as_dense``, reduced dense and made sparse again)."""
        for p in params:
            if p.grad is None:  # every rank must take part in every reduction
                p.grad = torch.zeros_like(p)
        size = self._hvd_process_set.size()
        if size == 1:
            return
        buckets: dict = {}
        for p in params:
            if p.grad.is_sparse and not self._hvd_sparse_as_dense:
                p.grad = self._hvd_reduce_sparse(p.grad).wait()
            else:
                buckets.setdefault((p.grad.dtype, p.grad.device), []).append(p)
        for members in buckets.values():
            grads = [p.grad.to_dense() if p.grad.is_sparse else p.grad for p in members]
            _reduce_bucket(grads, self._hvd_op, self._hvd_predivide, size, self._hvd_compression,
                           self._hvd_process_set)
            for p, g in zip(members, grads):
                if p.grad.is_sparse:
                    write_back(p, g)

    @contextlib.contextmanager
    def skip_synchronize(self):
        """Inside this block ``step()`` does not reduce (call ``synchronize()`` yourself first)."""
        self._hvd_skip = True
        try:
            yield
        finally:
            self._hvd_skip = False

    def step(self, closure=None):
        if self._hvd_synchronized and not self._hvd_skip:
            warnings.warn("optimizer.step() called without optimizer.skip_synchronize() context after "
                          "optimizer.synchronize(). This can cause training slowdown. You may want to consider "
                          "using optimizer.skip_synchronize() context if you use optimizer.synchronize() in "
                          "your code.")  # Horovod's words: its test matches them
        if not self._hvd_skip and not self._hvd_synchronized:
            self.synchronize()
        self._hvd_synchronized = False
        return super().step(closure)

    # torch.optim.Optimizer wraps a class's step() with its hook runner unless it is marked;
    # the base class's own step() already runs the hooks once.
    step.hooked = True


def _reduce_bucket(grads: list, op: ReduceOp, predivide: float, size: int, compression, process_set) -> None:
    """One allreduce for a list of same-dtype gradients, through a flat buffer."""
    flat, ctx = compression.compress(_flatten_dense_tensors(grads))
    if op == Average:
        scale_(flat, 1.0 / predivide)
    now(allreduce_async_, flat, op=Sum, process_set=process_set, _what="DistributedOptimizer bucket")
    if op == Average:
        scale_(flat, predivide / size)
    flat = compression.decompress(flat, ctx)
    for grad, reduced in zip(grads, _unflatten_dense_tensors(flat, grads)):
        grad.copy_(reduced)


def DistributedOptimizer(optimizer: torch.optim.Optimizer, named_parameters=None, compression=Compression.none,
                         backward_passes_per_step: int = 1, op=Average, gradient_predivide_factor: float = 1.0,
                         num_groups: int = 0, groups=None, sparse_as_dense: bool = False,
                         process_set=global_process_set):
    """Wrap ``optimizer`` so that ``step()`` first averages gradients across ranks (``op=Sum``: sums them).

    Gradients are reduced while backward runs: hooks fill buckets of up to
    ``$HOROVOD_FUSION_THRESHOLD`` bytes (64 MB), launched in a fixed order on every rank.
    Returns ``optimizer`` itself, its class now a subclass of its own class with the
    distributed ``step`` (Horovod returns a new object; one object keeps LR schedulers and
    ``load_state_dict`` consistent). ``step()`` (or ``synchronize()``) waits for the reductions;
    with ``backward_passes_per_step=N`` a bucket is reduced after each parameter's N-th
    gradient, so call ``step()`` after every N backward passes.
    ``compression`` casts the fused buffers for the wire; ``num_groups``/``groups`` are
    accepted for compatibility (buckets are per dtype and device).

    ``op=Adasum`` (with more than one rank): Horovod's Adasum optimizer, which reduces each
    parameter's change after a local step instead of the gradients (``_adasum_optimizer.py``).
    """
    op, backward_passes_per_step = _check_arguments(optimizer, op, gradient_predivide_factor,
                                                    backward_passes_per_step)
    compression = compression or Compression.none
    names = _parameter_names(optimizer, named_parameters)
    _check_step_not_patched(optimizer)
    # op=Adasum: Horovod's Adasum optimizer with more than one rank (alone, as in Horovod, the plain one); what
    # Horovod refuses is refused before the optimizer changes class
    adasum = op == Adasum and (_job_size() > 1 or process_set is not global_process_set)
    if adasum:
        hosts_per_reduction([p for group in optimizer.param_groups for p in group["params"] if p.requires_grad],
                            process_set, "DistributedOptimizer")
    _subclass(optimizer, _AdasumMixin if adasum else _DistributedMixin)
    if adasum:
        optimizer._hvd_adasum_setup(names, compression, backward_passes_per_step, process_set,
                                    next(_serials[process_set.link_id]))
    else:
        optimizer._hvd_setup(names, op, gradient_predivide_factor, backward_passes_per_step,
                             compression, sparse_as_dense, process_set)
    return optimizer


def _check_arguments(optimizer, op, gradient_predivide_factor: float, backward_passes_per_step: int):
    """``(op, backward_passes_per_step)`` resolved; ValueError for what ``DistributedOptimizer`` cannot wrap or
    reduce with."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(f"DistributedOptimizer wraps a torch.optim.Optimizer, got {type(optimizer).__name__}.")
    op = resolve_op(op, None)
    if op not in (Average, Sum, Adasum):
        raise ValueError(f"DistributedOptimizer reduces gradients with op=hvd.Average, hvd.Sum or hvd.Adasum, got "
                         f"{op.name}.")
    if gradient_predivide_factor != 1.0 and op != Average:
        raise ValueError("gradient_predivide_factor only applies with op=hvd.Average.")
    backward_passes_per_step = _check_passes(backward_passes_per_step)
    if isinstance(optimizer, (_DistributedMixin, _AdasumMixin)):
        raise ValueError("this optimizer is already a DistributedOptimizer; wrap the original optimizer once.")
    return op, backward_passes_per_step


def _check_step_not_patched(optimizer) -> None:
    """ValueError if the optimizer object carries its own ``step`` (not an LR scheduler's wrapper of the class's)."""
    patched = optimizer.__dict__.get("step")
    if patched is not None and not getattr(patched, "_wrapped_by_lr_sched", False):
        raise ValueError(f"this {type(optimizer).__name__} has its own step attribute ({patched!r}), which would "
                         "bypass gradient averaging; wrap the optimizer with DistributedOptimizer before patching it.")


def _subclass(optimizer, mixin: type) -> None:
    """Make ``optimizer``'s class a subclass of its own class with ``mixin`` first."""
    base = type(optimizer)
    cls = type(base.__name__, (mixin, base), {})
    optimizer.__class__ = cls  # one object: schedulers, load_state_dict and references all see it
    _repoint_scheduler_step(optimizer, cls)


def _parameter_names(optimizer, named_parameters) -> dict:
    """id(parameter) -> name, checked against the optimizer's parameters."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if named_parameters is None:
        return {id(p): f"param.{i}" for i, p in enumerate(params)}
    named = list(named_parameters)
    if any(not (isinstance(x, tuple) and len(x) == 2) for x in named):
        raise ValueError("named_parameters must be (name, parameter) pairs, as model.named_parameters() gives.")
    names = [n for n, _ in named]
    dups = sorted({n for n in names if names.count(n) > 1})
    if dups:
        raise ValueError(f"named_parameters has duplicate names {dups}; each parameter needs its own name.")
    known = {id(p) for _, p in named}
    unnamed = sum(1 for p in params if id(p) not in known)
    if unnamed:
        raise ValueError(f"named_parameters was given, but {unnamed} of the optimizer's {len(params)} "
                         "parameters are not in it; pass model.named_parameters() of the model whose "
                         "parameters the optimizer updates.")
    return {id(p): n for n, p in named}


def _repoint_scheduler_step(optimizer, cls) -> None:
    """An LR scheduler made before wrapping put a step() on the instance that calls the base
    class's step directly; make it call the distributed one."""
    if "step" not in optimizer.__dict__:
        return
    ref = weakref.ref(optimizer)

    def step(*args, **kwargs):
        opt = ref()
        opt._opt_called = True  # what torch's scheduler wrapper records
        return cls.step(opt, *args, **kwargs)

    step._wrapped_by_lr_sched = True
    optimizer.step = step
