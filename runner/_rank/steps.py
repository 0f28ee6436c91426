"""Count the rank's torch optimizer steps for ``RunResult.metrics`` (``_common/metrics.py``), once torch is imported.

torch's global step hook (``torch.optim.optimizer.register_optimizer_step_post_hook``) runs after every
``Optimizer.step``: a plain optimizer under DDP or FSDP, sparkhvd's ``DistributedOptimizer`` (one step each, its
inner optimizer's included), Lightning's and Hugging Face's loops alike. A rank that never imports torch pays nothing.
"""

from __future__ import annotations

from ..._common import metrics as _metrics
from ..._common import settings
from .after_import import when_imported


def count_optimizer_steps() -> None:
    """Count (or, with SPARKHVD_METRICS=0, count nothing at all) from this rank's own environment."""
    _metrics.ON = settings.METRICS.get()
    _metrics.SYSTEM = _metrics.ON and settings.MLFLOW_SYSTEM_METRICS.get()
    if _metrics.ON:
        when_imported("torch", _register)


def _register(torch) -> None:
    try:
        from torch.optim.optimizer import register_optimizer_step_post_hook
    except ImportError:  # a torch without the global hook: steps are then commits or collectives
        return
    global hook
    hook = register_optimizer_step_post_hook(lambda opt, args, kwargs: _metrics.optimizer_step(opt))


hook = None  # torch's handle of the registered hook (bench/metrics_overhead.py removes it to time steps without)
