"""The backend contract's checks (runner/_backends/api.py), run over every backend by
tests/runner/backends/test_backend_contract.py (local, Spark) and tests/_connect_cases.py (Spark Connect).

Each check asks a real backend what the run's policy asks it, after ``prepare``, without starting a launcher:
the launch itself is what every run test proves.
"""

from __future__ import annotations

import socket

from sparkhvd.runner._backends.api import Backend, Launcher


def check_backend(backend: Backend, np: int) -> dict:
    """Ask ``backend`` for everything the contract promises for ``np`` ranks; return what it answered."""
    assert isinstance(backend, Backend) and backend.name, backend
    bind_host = backend.prepare(np, run_id="contract", verbose=False, gpus=False)
    socket.inet_aton(bind_host)  # an IPv4 address the driver service can bind to
    launcher = backend.launcher(np, gpus=False)
    assert isinstance(launcher, Launcher) and launcher.description
    assert launcher.failure() is None and launcher.lost([]) is None and isinstance(launcher.waiting_for(), str)
    free = backend.free_slots()
    assert isinstance(free, int) and free >= 0
    restart = backend.slots_for_restart(np, None, 0.0)
    assert restart == np  # the slots that prepare found are there again
    assert backend.replace_hosts(frozenset()) is None
    launcher.stop()  # a launcher never started stops cleanly
    return {"name": backend.name, "bind_host": bind_host, "description": launcher.description, "free": free}
