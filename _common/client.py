"""The task side of the driver service: one authenticated connection, request/response."""

from __future__ import annotations

import socket
import threading
import time

from .driver_messages import Aborted, MessageError, Refusal, decode, encode
from .protocol import AuthenticatedChannel, Kind, Message

_UNSERVED_RETRIES = 5  # a connection the driver dropped unserved (flooded listener) is made again


#: A driver unreachable this long ends the connection (and so the rank: see runner/_rank/exit.py, watch), instead of
#: leaving ranks on a cut-off host running until TCP gives up: idle, 30 s then 3 probes
#: 10 s apart; with unacknowledged data, 60 s.
_KEEPALIVE = (30, 10, 3)
_USER_TIMEOUT_MS = 60_000


def _keepalive(sock: socket.socket) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    idle, interval, count = _KEEPALIVE
    for option, value in (("TCP_KEEPIDLE", idle), ("TCP_KEEPINTVL", interval), ("TCP_KEEPCNT", count),
                          ("TCP_USER_TIMEOUT", _USER_TIMEOUT_MS)):
        if hasattr(socket, option):  # Linux; elsewhere the system's defaults
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)


class ServiceError(RuntimeError):
    """The driver service refused a request; the message says why."""


class RunAborted(RuntimeError):
    """The driver aborted the run (another rank failed, a timeout, or Ctrl-C on the driver)."""


class ServiceClient:
    """A connection to the driver service. Thread-safe: one request at a time."""

    def __init__(self, address: tuple[str, int], secret: bytes, *, connect_timeout: float = 30.0):
        self._address = address
        self._secret = secret
        self._connect_timeout = connect_timeout
        self._channel = self._open()
        self._answered = False  # whether a request on this connection has been answered
        self._lock = threading.Lock()

    def _open(self) -> AuthenticatedChannel:
        where = f"{self._address[0]}:{self._address[1]}"
        try:
            sock = socket.create_connection(self._address, timeout=self._connect_timeout)
        except socket.timeout as exc:
            raise TimeoutError(f"could not connect to the sparkhvd driver service at {where} within "
                               f"{self._connect_timeout:g} s; the driver is unreachable from this host, or "
                               "overloaded.") from exc
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        _keepalive(sock)
        try:
            channel = AuthenticatedChannel.connect(sock, self._secret)  # the greeting, still under the timeout
        except socket.timeout as exc:
            sock.close()
            raise TimeoutError(f"the sparkhvd driver service at {where} took the connection but did not greet it "
                               f"within {self._connect_timeout:g} s: the driver process is overloaded (out of file "
                               "descriptors, threads or memory) or stopped; its log says which.") from exc
        except OSError:
            sock.close()
            raise
        sock.settimeout(None)
        return channel

    def request(self, kind: Kind, meta: dict | None = None, blob: bytes = b"") -> Message:
        """Send one request and return its answer; ERR and ABORT answers raise.

        A first request that the driver dropped unserved, to make room while its port was
        flooded, is sent again on a new connection (a few times, backing off).
        """
        with self._lock:
            for attempt in range(_UNSERVED_RETRIES + 1):
                self._channel.send(kind, meta, blob)
                reply = self._channel.recv()
                if self._answered or reply.kind != Kind.ERR or not reply.meta.get("unserved"):
                    break
                if attempt == _UNSERVED_RETRIES:
                    break
                self._channel.close()
                time.sleep(0.05 * 2 ** attempt)
                self._channel = self._open()
            self._answered = True
        if reply.kind == Kind.ERR:
            raise ServiceError(_answer(Refusal, reply).message)
        if reply.kind == Kind.ABORT:
            raise RunAborted(_answer(Aborted, reply).reason)
        return reply

    def ask(self, request, blob: bytes = b"") -> Message:
        """Send one request of _common/driver_messages.py and return its answer's frame (decode its meta with
        ``driver_messages.decode``); ERR and ABORT answers raise."""
        return self.request(request.KIND, encode(request), blob)

    def tell(self, message, blob: bytes = b"") -> None:
        """Send a one-way message of _common/driver_messages.py (LOG, PROGRESS)."""
        self.notify(message.KIND, encode(message), blob)

    def notify(self, kind: Kind, meta: dict | None = None, blob: bytes = b"") -> None:
        """Send a one-way frame (log lines)."""
        with self._lock:
            self._channel.send(kind, meta, blob)

    def close(self) -> None:
        self._channel.close()


def _answer(cls, reply: Message):
    """An ERR or ABORT frame's message; the default one where the driver's sentence cannot be read."""
    try:
        return decode(cls, reply.meta)
    except MessageError:
        return cls()
