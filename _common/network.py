"""This host's addresses."""

from __future__ import annotations

import socket


def local_address(toward: str | None) -> str:
    """The address of this host's interface that routes toward ``toward`` (no packet is sent)."""
    if not toward:
        return socket.gethostbyname(socket.gethostname())
    family, _, _, _, address = socket.getaddrinfo(toward, 1, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect(address)
        return probe.getsockname()[0]
