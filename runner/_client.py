"""The task side of the driver service: one authenticated connection, request/response."""

from __future__ import annotations

import socket
import threading

from ._protocol import Channel, Kind, Message


class ServiceError(RuntimeError):
    """The driver service refused a request; the message says why."""


class RunAborted(RuntimeError):
    """The driver aborted the run (another rank failed, a timeout, or Ctrl-C on the driver)."""


class ServiceClient:
    """A connection to the driver service. Thread-safe: one request at a time."""

    def __init__(self, address: tuple[str, int], secret: bytes, *, connect_timeout: float = 30.0):
        sock = socket.create_connection(address, timeout=connect_timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            self._channel = Channel.connect(sock, secret)  # the greeting, still under the timeout
        except OSError:
            sock.close()
            raise
        sock.settimeout(None)
        self._lock = threading.Lock()

    def request(self, kind: Kind, meta: dict | None = None, blob: bytes = b"") -> Message:
        """Send one request and return its answer; ERR and ABORT answers raise."""
        with self._lock:
            self._channel.send(kind, meta, blob)
            reply = self._channel.recv()
        if reply.kind == Kind.ERR:
            raise ServiceError(reply.meta.get("message", "the driver service refused the request"))
        if reply.kind == Kind.ABORT:
            raise RunAborted(reply.meta.get("reason", "the run was aborted"))
        return reply

    def notify(self, kind: Kind, meta: dict | None = None, blob: bytes = b"") -> None:
        """Send a one-way frame (log lines)."""
        with self._lock:
            self._channel.send(kind, meta, blob)

    def close(self) -> None:
        self._channel.close()
