"""The rank's heartbeat: every few seconds, a one-way PROGRESS frame to the driver.

It tells the driver that the rank is alive and what it is doing: starting, running the user's
function, or finishing; the collectives it is waiting in and for how long, and how many waits
it has finished (``_common/progress.py``). The driver turns these into the stall report
and notices a rank it no longer hears from (``_policy/stall_report.py``). Each frame also carries the stall
settings this rank's environment sets, which take precedence over the driver's.

It runs on its own connection, so a large result or function upload on the worker's main
connection never delays it. A Python thread: a native call that holds the GIL for longer
than the heartbeat timeout makes the rank look lost (the timeout's message says so).
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Callable

from ..._common import metrics as _metrics
from ..._common import progress as _progress
from ..._common import settings
from ..._common.client import ServiceClient
from ..._common.driver_messages import Progress
from .._shared.stall_settings import FORWARDED_SETTINGS, lenient

STARTING, RUNNING, FINISHING = "starting", "running", "finishing"
_RECONNECTS = 3  # a connection the driver's listener dropped (flooded) is made again this often, then given up
_RECONNECT_TIMEOUT_S = 10.0


class Heartbeat:
    """A daemon thread sending this rank's progress every ``interval`` seconds."""

    def __init__(self, address: tuple[str, int], secret: bytes, rank: int, interval: float,
                 on_lost: Callable[[str], None] | None = None):
        self.rank = rank
        self._on_lost = on_lost or (lambda reason: None)
        self.interval = interval
        self.state = STARTING  # set by the worker: RUNNING while the user's function runs, then FINISHING
        self._address = address
        self._secret = secret
        self._settings = {s.name: s.raw() for s in FORWARDED_SETTINGS if s.raw() is not None}
        self._wake = threading.Event()  # a change of state is sent at once, not at the next beat
        self._sent = threading.Condition()
        self._sent_state: str | None = None  # the state of the latest beat the driver has
        self._thread = threading.Thread(target=self._run, name="sparkhvd-heartbeat", daemon=True)

    @classmethod
    def start(cls, address: tuple[str, int], secret: bytes, rank: int,
              on_lost: Callable[[str], None] | None = None) -> "Heartbeat":
        """Start beating; ``on_lost(reason)`` runs when the driver can no longer be reached."""
        interval, problem = lenient(settings.HEARTBEAT, settings.HEARTBEAT.raw(), "this rank's environment")
        if problem:
            sys.stderr.write(f"sparkhvd: {problem}\n")
        beat = cls(address, secret, rank, interval, on_lost)
        beat._thread.start()
        return beat

    def running(self) -> None:
        self.state = RUNNING
        self._wake.set()

    def finishing(self, timeout: float = 0.0) -> None:
        """The function returned: send a beat at once, and wait up to ``timeout`` s until it is sent, so that the
        driver has the rank's final metrics before its result."""
        self.state = FINISHING
        self._wake.set()
        with self._sent:
            self._sent.wait_for(lambda: self._sent_state == FINISHING, timeout)

    def message(self) -> Progress:
        """One heartbeat."""
        collectives = _progress.snapshot()
        return Progress(rank=self.rank, state=self.state, interval=self.interval, settings=self._settings,
                        metrics=_metrics.snapshot(collectives["done"]) if _metrics.ON else None, **collectives)

    def _run(self) -> None:
        client, failures = None, 0
        while True:
            try:
                if client is None:
                    client = ServiceClient(self._address, self._secret, connect_timeout=_RECONNECT_TIMEOUT_S)
                beat = self.message()
                client.tell(beat)
                failures = 0
                with self._sent:
                    self._sent_state = beat.state
                    self._sent.notify_all()
            except (OSError, ConnectionError) as exc:  # evicted by a flooded listener, or the driver is gone
                if client is not None:
                    client.close()
                    client = None
                failures += 1
                if failures > _RECONNECTS:  # the driver closed the run, or a cut link timed out
                    self._on_lost(f"lost the connection to the driver ({exc})")
                    return
                time.sleep(0.2 * failures)
                continue
            except Exception as exc:  # noqa: BLE001 - a bug here must not end the beats, nor the rank
                sys.stderr.write(f"sparkhvd: rank {self.rank}'s heartbeat failed once: {type(exc).__name__}: {exc}\n")
            self._wake.wait(self.interval)
            self._wake.clear()
