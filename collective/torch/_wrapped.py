"""What both of DistributedOptimizer's classes (``_optimizer.py``, ``_adasum_optimizer.py``) share: the
parameters' names and trainable list, and Horovod's ``backward_passes_per_step`` property."""

from __future__ import annotations

import operator


class WrappedOptimizer:
    """Placed, through a mixin, before the user's optimizer class; the mixin sets ``_hvd_names`` and
    ``_hvd_backward_passes`` and defines ``set_backward_passes_per_step``."""

    @property
    def _parameter_names(self) -> dict:
        """Each parameter's name (parameter -> name), as Horovod's optimizer keeps them."""
        return {p: self._hvd_names[id(p)] for group in self.param_groups for p in group["params"]
                if id(p) in self._hvd_names}

    @property
    def backward_passes_per_step(self) -> int:
        return self._hvd_backward_passes

    @backward_passes_per_step.setter
    def backward_passes_per_step(self, passes: int) -> None:
        self.set_backward_passes_per_step(passes)

    def _hvd_trainable(self) -> list:
        return [p for group in self.param_groups for p in group["params"] if p.requires_grad]


def check_passes(passes) -> int:
    """``passes`` as an int (any integral number, as Horovod takes), or a ValueError."""
    try:
        count = operator.index(passes) if not isinstance(passes, float) or not passes.is_integer() else int(passes)
    except TypeError:
        count = 0
    if isinstance(passes, bool) or count < 1:
        raise ValueError(f"backward_passes_per_step must be a whole number of 1 or more, got {passes!r}.")
    return count
