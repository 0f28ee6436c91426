"""Where a task agent and the warm process meet: the socket's name, the start command and the message format.

The warm process (the zygote, ``runner/_warm/server.py``) is started as ``python -m sparkhvd.runner._warm.server
<key>`` and listens on a Linux abstract Unix socket named by the key (``runner/_warm/key.py``). Agents connect
through ``runner/_warm/client.py``.

Protocol (SOCK_SEQPACKET, one JSON message each way, never pickle): a request
``{"env": {...}, "cwd": "...", "argv": ["-m", "sparkhvd.runner._rank.worker"]}`` carries the rank's
stdin, stdout and stderr pipe ends as file descriptors; the warm process answers ``{"pid": n}`` once the
rank leads a process group of its own (so that killing group ``n`` reaches it) and,
when the rank has exited, ``{"exit": code}`` on the same connection. If the agent's end of that
connection closes first (a killed Spark task), the rank's process group is killed. ``{"ping": true}``
is answered with ``{"pid": n, "key": key}``, ``{"stop": true}`` with ``{"stopping": true}``, and a bad
request with ``{"error": "bad request: ..."}``. Abstract sockets have no file permissions, so both ends
check the other's uid (``peer_uid``): only the same user may ask for a rank, and an agent only hands a
rank's pipes to a warm process of its own user.
"""

from __future__ import annotations

import socket
import struct

SERVER_MODULE = "sparkhvd.runner._warm.server"  # python -m SERVER_MODULE <key>; how its processes are found
WORKER_MODULE = "sparkhvd.runner._rank.worker"  # the rank's bootstrap; how rank processes are found
WORKER_ARGV = ("-m", WORKER_MODULE)  # a request's argv for a rank (more arguments may follow)
MAX_REQUEST_BYTES = 4 << 20
_NAME_PREFIX = "\0sparkhvd-zygote-"


def address(key: str) -> str:
    """The abstract socket name of ``key``'s warm process (no file: the leading NUL)."""
    return _NAME_PREFIX + key


def peer_uid(sock: socket.socket) -> int:
    """The uid of the process at the other end of a connected Unix socket."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[1]
