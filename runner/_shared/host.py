"""What a host is: how ranks are grouped, and the network address and interface a rank uses."""

from __future__ import annotations

import fcntl
import hashlib
import os
import socket
import struct

from ..._common import settings
from ..._common.network import local_address

_NAMESPACES = ("net", "uts", "ipc")  # processes that share these (and the kernel) share a host
_SIOCGIFADDR = 0x8915


def host_id() -> str:
    """This host's identity: its hostname plus a hash of the kernel's boot id and its namespaces.

    Two containers (or network namespaces) on one machine with the same hostname are different
    hosts, as in Horovod's host hash; two processes in one container are the same host.
    """
    parts = [socket.gethostname()]
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            parts.append(f.read().strip())
    except OSError:
        pass
    for ns in _NAMESPACES:
        try:
            parts.append(os.readlink(f"/proc/self/ns/{ns}"))
        except OSError:
            pass
    digest = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:12]
    return f"{parts[0]}-{digest}"


def interfaces() -> dict:
    """``name -> IPv4 address`` of this host's interfaces that have one (Linux)."""
    found = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue  # down, or no IPv4 address
            found[name] = socket.inet_ntoa(packed[20:24])
    return found


def interface_of(address: str) -> str | None:
    """The name of the interface that holds ``address``, or None."""
    for name, held in interfaces().items():
        if held == address:
            return name
    return None


def address_of(interface: str) -> str:
    """The IPv4 address of ``interface``; a clear error when it is not there."""
    found = interfaces()
    if interface not in found:
        raise ValueError(
            f"network_interface={interface!r} has no IPv4 address on host {socket.gethostname()} (its interfaces "
            f"with one: {', '.join(f'{n} {a}' for n, a in sorted(found.items())) or 'none'}); pass the name of "
            "the interface the hosts reach each other on, or leave network_interface unset to use the one that "
            "routes to the driver.")
    return found[interface]


def rank_address(driver_host: str) -> str:
    """This rank's address for its peers; gloo is pointed at the same interface.

    gloo otherwise picks the address the hostname resolves to, which on many hosts is loopback
    (Debian's 127.0.1.1): its peers on other hosts are then refused.
    """
    chosen = settings.NETWORK_INTERFACE.get()
    try:
        local = address_of(chosen) if chosen else local_address(driver_host)
    except OSError as exc:
        raise ValueError(f"this rank cannot tell which of its addresses reaches the driver at {driver_host} ({exc}); "
                         "pass network_interface= with the name of the interface the hosts reach each other "
                         "on.") from exc
    if settings.GLOO_SOCKET_IFNAME.raw() is None:
        interface = interface_of(local)
        if interface is not None:
            os.environ[settings.GLOO_SOCKET_IFNAME.name] = interface
    return local
