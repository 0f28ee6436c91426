"""What a rank's process knows about its run, set by the worker bootstrap."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from .client import ServiceClient
from .topology import Placement


@dataclass
class WorkerContext:
    """This process's place in the run and its connection to the driver."""

    placement: Placement
    run_id: str
    address: tuple[str, int]
    secret: bytes = field(repr=False)
    client: ServiceClient
    local_address: str = ""  # where this rank listens for its peers (the network_interface's address)
    torchrun_master: tuple = ()  # (MASTER_ADDR, MASTER_PORT) as the runner set them (collective/_engine/env_rendezvous.py)

    def new_client(self) -> ServiceClient:
        """A separate connection to the driver (the rendezvous store uses its own)."""
        return ServiceClient(self.address, self.secret)


_current: WorkerContext | None = None


def current() -> WorkerContext | None:
    """The run this process belongs to, or None outside HorovodRunner."""
    return _current


_before_exit: list[Callable[[], None]] = []


def at_exit(hook: Callable[[], None]) -> None:
    """Have the rank's worker call ``hook`` once the user's function is over, before it reports and exits
    (the engine registers its drain: frames its peers are still owed leave first). Registered once."""
    if hook not in _before_exit:
        _before_exit.append(hook)


def before_exit() -> None:
    """Call what ``at_exit`` registered, in order (the worker, when the user's function is over)."""
    for hook in list(_before_exit):
        hook()


_group_builder: str | None = None  # "hvd.init()" while sparkhvd's engine owns this process's default process group


def built_default_group(by: str | None) -> None:
    """Note who built this process's default process group (None: nobody now), so that a second
    ``dist.init_process_group()``'s error can say which to call (``runner/_rank/worker.py``)."""
    global _group_builder
    _group_builder = by


def default_group_builder() -> str | None:
    return _group_builder


def _set(ctx: WorkerContext | None) -> None:
    global _current
    _current = ctx
