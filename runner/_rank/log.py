"""``sparkhvd.log_to_driver``: a line from inside a training function, printed on the driver."""

from __future__ import annotations

import sys

from ..._common import context as _context
from ..._common.driver_messages import Log


def log_to_driver(message) -> None:
    """From inside a training function: print ``message`` on the driver as ``[rank] message``.

    Shown even with ``driver_log_verbosity="log_callback_only"``. Outside a run it prints
    locally.
    """
    ctx = _context.current()
    if ctx is None:
        print(message, file=sys.stdout, flush=True)
        return
    ctx.client.tell(Log(rank=ctx.placement.rank, stream="driver", lines=str(message).splitlines()))
