"""torch.distributed's process groups outlive the user's code in a rank: ``destroy_process_group`` keeps them.

PyTorch's DDP tutorial ends with ``dist.destroy_process_group()`` while the DDP model is still alive, then
returns. torch's destroy only takes the groups out of its registry (for gloo, ``shutdown`` stops no thread);
the group itself lives on in the model's ``Reducer``. When the function returns and the model is freed, the
Reducer drops the last reference and ``~ProcessGroupGloo`` joins its ``pt_gloo_runloop`` threads on the main
thread, which holds the GIL; a runloop thread that is just then freeing a finished work (whose
``ThreadLocalState`` holds a Python object) waits for the GIL, and the rank hangs for good
(docs/performance.md, "The DDP tutorial's ending").

So in a rank, ``torch.distributed.destroy_process_group`` is wrapped: it does what torch's does (the groups
leave the registry: ``dist.is_initialized()`` is False and ``init_process_group`` works again), and this
module keeps a reference to every group it destroyed, so their destructors never run in the user's code.
The rank ends with ``os._exit`` (runner/_rank/exit.py: ``end``), which runs no destructor either. What a kept
group holds (its sockets and idle threads) goes with the process; a function that builds and destroys many
groups keeps each until the rank ends.

``keep_destroyed_groups`` (from runner/_rank/startup.py's ``prepare``) never imports torch: it wraps now where
``torch.distributed`` is loaded (a rank forked from the warm process), and otherwise when it loads.
"""

from __future__ import annotations

import functools
import sys

from .after_import import when_imported

MODULE = "torch.distributed"
_C10D = "torch.distributed.distributed_c10d"

#: Every process group a destroy took out of torch's registry in this process, by id; never released.
kept: dict = {}


def keep_destroyed_groups() -> None:
    """Wrap ``torch.distributed.destroy_process_group`` now if torch.distributed is loaded, else once it is."""
    when_imported(MODULE, _wrap)


def _wrap(dist) -> None:
    """Replace torch's ``destroy_process_group`` (in ``torch.distributed`` and its ``distributed_c10d``) with one
    that keeps the groups it destroys. A torch without it (``USE_DISTRIBUTED=0``) is left as it is."""
    c10d = sys.modules.get(_C10D)
    original = getattr(c10d, "destroy_process_group", None)
    if original is None or getattr(original, "keeps_groups", False):
        return

    @functools.wraps(original)
    def destroy_process_group(group=None):
        _keep(c10d, group)
        return original(group)

    destroy_process_group.keeps_groups = True
    c10d.destroy_process_group = destroy_process_group
    if getattr(dist, "destroy_process_group", None) is original:
        dist.destroy_process_group = destroy_process_group


def _keep(c10d, group) -> None:
    """Hold every group in torch's registry (a destroy of the default group takes all of them) and ``group``."""
    registered = getattr(getattr(c10d, "_world", None), "pg_map", None) or {}
    kind = getattr(c10d, "ProcessGroup", None)
    for pg in (*registered, group):
        if kind is not None and isinstance(pg, kind):
            kept[id(pg)] = pg
