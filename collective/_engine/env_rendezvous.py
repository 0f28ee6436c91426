"""``dist.init_process_group()``'s ``env://`` rendezvous through the run's driver store, in HorovodRunner's ranks.

Under torchrun's rules, rank 0's ``init_process_group`` starts a TCPStore at ``MASTER_PORT`` and the other ranks
connect to it, retrying until it listens: a rank that gets there first loses a retry's back-off, and the store
takes unauthenticated connections while the run lasts. In a rank of HorovodRunner, the run's driver store
(``DriverStore``: authenticated frames, up before any rank starts) serves the rendezvous instead, as it does for
``hvd.init()``. Everywhere else, and where the function has pointed ``MASTER_ADDR`` or ``MASTER_PORT`` elsewhere,
torch's own handler runs.

``install()`` runs when the engine is imported: the warm process imports it before it forks a rank
(runner/_warm/server.py), so DDP, FSDP, Lightning, Hugging Face and DeepSpeed ranks forked from it rendezvous
through the driver; a rank started afresh that never imports sparkhvd's collectives uses torch's handler, at
``MASTER_PORT``.
"""

from __future__ import annotations

import importlib
import itertools
from urllib.parse import parse_qs, urlparse

from ..._common import context as _context
from ..._common import settings
from .store import DriverStore

# The module (torch.distributed's attribute of that name is its function rendezvous()).
_rendezvous = importlib.import_module("torch.distributed.rendezvous")
_original = None  # torch's env:// handler, for everything that is not a rank of this run
_stores: list = []  # c10d calls a Python store's methods only while the Python object lives
_inits = itertools.count()  # init_process_group calls in this process: keeps each one's keys apart


def install() -> None:
    """Put ``_env_handler`` in front of torch's ``env://`` handler (once)."""
    global _original
    handlers = getattr(_rendezvous, "_rendezvous_handlers", None)
    if not isinstance(handlers, dict) or "env" not in handlers or handlers["env"] is _env_handler:
        return  # a torch whose registry differs keeps its own
    _original = handlers["env"]
    handlers["env"] = _env_handler


def _env_handler(url: str, **kwargs):
    """torch's rendezvous handler protocol: an iterator of ``(store, rank, world_size)``."""
    ctx = _context.current()
    master = (settings.MASTER_ADDR.raw(), settings.MASTER_PORT.raw())
    if ctx is None or not ctx.torchrun_master or master != ctx.torchrun_master:
        return _original(url, **kwargs)
    query = parse_qs(urlparse(url).query)
    rank = int(query["rank"][0]) if "rank" in query else settings.RANK.get()
    world_size = int(query["world_size"][0]) if "world_size" in query else settings.WORLD_SIZE.get()
    store = DriverStore(ctx.new_client(), prefix=f"sparkhvd/env/{next(_inits)}/")
    if kwargs.get("timeout") is not None:
        store.set_timeout(kwargs["timeout"])
    _stores.append(store)
    return iter([(store, rank, world_size)])
