"""Wire format of the driver service: authenticated frames over TCP.

A connection opens with the server sending a fresh 16-byte nonce (its only unauthenticated
bytes). After that every frame, in either direction, is

    header = magic(4) | kind(1) | seq(8) | meta_len(4) | blob_len(8)
    frame  = header | header_tag | meta (JSON) | blob (raw bytes) | tag

    header_tag = HMAC-SHA256(secret, "H" | direction | nonce | header)
    tag        = HMAC-SHA256(secret, direction | nonce | header | meta | blob)

``direction`` is b"C" for client -> server and b"S" for server -> client, so a frame cannot be
reflected back; ``nonce`` binds the frame to this connection, so a frame recorded on another
connection is refused; ``seq`` counts 0, 1, 2, ... per direction, so a frame replayed, dropped
or reordered within the connection is refused. The header's own tag is verified (and its
lengths and sequence checked) before a byte of the body is read or a buffer is allocated for
it, so a peer without the secret cannot make the driver hold more than one header; and
nothing in a frame is parsed, let alone unpickled, before its tag is verified.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import json
import os
import socket
import struct
from dataclasses import dataclass, field

MAGIC = b"SHV1"
NONCE_BYTES = 16
SECRET_BYTES = 32
TAG_BYTES = 32
_HEADER = struct.Struct("!4sBQIQ")

MAX_META_BYTES = 1 << 20  # control data: a megabyte is plenty
MAX_BLOB_BYTES = 2 << 30  # pickled functions and results


class Kind(enum.IntEnum):
    """Frame kinds. Requests are answered with OK, ERR or a kind of their own; what each frame's meta holds is
    its message in _common/driver_messages.py."""

    OK = 1
    ERR = 2
    ABORT = 3  # server -> worker: stop now
    REGISTER = 10  # task -> server; answered with ASSIGN once every task has registered
    ASSIGN = 11
    FETCH = 12  # worker -> server; answered with OK carrying the pickled function
    WATCH = 13  # worker -> server; answered with ABORT when the run is aborted
    LOG = 20  # one-way: lines of a rank's stdout/stderr, or log_to_driver messages
    RESULT = 21
    ERROR = 22
    EXIT = 23  # a rank's process exited with this code
    PROGRESS = 24  # one-way: a rank's heartbeat, with the collectives it is in (runner/_rank/heartbeat.py)
    TIMELINE = 25  # a rank's timeline traces, as it ends (runner/_service/timeline.py merges them)
    CLOCK = 26  # worker -> server; answered with OK carrying the driver's wall clock (the timeline's offsets)
    STORE_SET = 30
    STORE_GET = 31
    STORE_ADD = 32
    STORE_CHECK = 33
    STORE_WAIT = 34
    STORE_CAS = 35
    STORE_DELETE = 36
    STORE_NUM_KEYS = 37
    COMMIT = 40  # rank 0 -> server: an elastic state's newest commit (runner/_service/commit_store.py)
    RESTORE = 41  # rank -> server; answered with OK carrying the newest commit of a state, if any


#: A LOG frame's streams (_common/driver_messages.py: Log): a line rewritten with ``\r`` arrives once, as its
#: final state, and the stream's unfinished line (a tqdm bar) travels as the frame's ``progress``. Stream
#: ``FILE_ONLY``'s lines go to the rank's log file and are never shown (a failed rank's whole traceback).
FILE_ONLY = "file"
LOG_STREAMS = ("stdout", "stderr", "driver", FILE_ONLY)
MAX_PROGRESS_CHARS = 4096  # longer progress states are cut to this for display
MAX_LINE_BYTES = 64 * 1024  # a rank's longer output lines reach the driver in pieces of this size
FLUSH_CHARS = 64 * 1024  # the most characters of output lines one LOG frame carries


class ProtocolError(ConnectionError):
    """A peer sent something that is not a valid, authenticated frame."""


class PeerClosed(ProtocolError):
    """The peer closed the connection cleanly, between frames."""


class AuthenticationError(ProtocolError):
    """A frame's HMAC tag did not verify under this run's secret."""


def new_secret() -> bytes:
    """A fresh per-run secret."""
    return os.urandom(SECRET_BYTES)


@dataclass
class Message:
    """One decoded frame: a kind byte, JSON metadata and an optional raw blob."""

    kind: int
    meta: dict = field(default_factory=dict)
    blob: bytes = b""


def _recv_exactly(sock: socket.socket, n: int, at_boundary: bool = False) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            if got == 0 and at_boundary:
                raise PeerClosed("the peer closed the connection")
            raise ProtocolError(f"connection closed after {got} of {n} bytes of a frame")
        got += k
    return bytes(buf)


class AuthenticatedChannel:
    """One authenticated connection, from either end.

    Not thread-safe: callers serialise sends and receives (one thread each is fine).
    """

    def __init__(self, sock: socket.socket, secret: bytes, nonce: bytes, *, is_server: bool,
                 max_blob: int = MAX_BLOB_BYTES):
        self.sock = sock
        self._secret = secret
        self._nonce = nonce
        self._send_dir, self._recv_dir = (b"S", b"C") if is_server else (b"C", b"S")
        self._send_seq = 0
        self._recv_seq = 0
        self._max_blob = max_blob

    @classmethod
    def accept(cls, sock: socket.socket, secret: bytes, **kw) -> "AuthenticatedChannel":
        """Server side: send this connection's fresh nonce."""
        nonce = os.urandom(NONCE_BYTES)
        sock.sendall(MAGIC + nonce)
        return cls(sock, secret, nonce, is_server=True, **kw)

    @classmethod
    def connect(cls, sock: socket.socket, secret: bytes, **kw) -> "AuthenticatedChannel":
        """Client side: read the server's nonce."""
        hello = _recv_exactly(sock, len(MAGIC) + NONCE_BYTES)
        if hello[:4] != MAGIC:
            raise ProtocolError(f"the peer is not a sparkhvd driver service (greeting {hello[:4]!r})")
        return cls(sock, secret, hello[4:], is_server=False, **kw)

    def _header_tag(self, direction: bytes, header: bytes) -> bytes:
        return hmac.new(self._secret, b"H" + direction + self._nonce + header, hashlib.sha256).digest()

    def _tag(self, direction: bytes, header: bytes, meta: bytes, blob: bytes) -> bytes:
        mac = hmac.new(self._secret, direction + self._nonce, hashlib.sha256)
        mac.update(header)
        mac.update(meta)
        mac.update(blob)
        return mac.digest()

    def send(self, kind: int, meta: dict | None = None, blob: bytes = b"") -> None:
        meta_bytes = json.dumps(meta or {}, separators=(",", ":")).encode()
        if len(meta_bytes) > MAX_META_BYTES:
            raise ValueError(f"frame metadata is {len(meta_bytes)} bytes, over the {MAX_META_BYTES}-byte limit")
        if len(blob) > self._max_blob:
            raise ValueError(
                f"a payload of {len(blob)} bytes is over the driver service's {self._max_blob}-byte "
                "limit; save large objects to storage and return their path instead")
        header = _HEADER.pack(MAGIC, kind, self._send_seq, len(meta_bytes), len(blob))
        header += self._header_tag(self._send_dir, header)
        tag = self._tag(self._send_dir, header[:_HEADER.size], meta_bytes, blob)
        self._send_seq += 1
        if len(blob) < (1 << 20):
            self.sock.sendall(b"".join((header, meta_bytes, blob, tag)))  # one write for small frames
        else:
            for part in (header + meta_bytes, blob, tag):  # no copy of a large payload
                self.sock.sendall(part)

    def recv(self) -> Message:
        header = _recv_exactly(self.sock, _HEADER.size, at_boundary=True)
        self.check_header(header)
        self.check_header_tag(header, _recv_exactly(self.sock, TAG_BYTES))
        return self.recv_body(header)

    def check_header(self, header: bytes) -> None:
        """Refuse a received header whose magic or lengths are wrong (before its tag is read)."""
        magic, _, _, meta_len, blob_len = _HEADER.unpack(header)
        if magic != MAGIC:
            raise ProtocolError(f"bad frame magic {magic!r}")
        if meta_len > MAX_META_BYTES or blob_len > self._max_blob:
            raise ProtocolError(
                f"frame lengths meta={meta_len} blob={blob_len} exceed the limits "
                f"{MAX_META_BYTES}/{self._max_blob}; refused before reading the body")

    def check_header_tag(self, header: bytes, header_tag: bytes) -> None:
        """Refuse a header not tagged under this run's secret, or out of sequence."""
        if not hmac.compare_digest(header_tag, self._header_tag(self._recv_dir, header)):
            raise AuthenticationError("frame header failed HMAC verification (wrong secret or tampered frame); "
                                      "refused before reading the body")
        seq = _HEADER.unpack(header)[2]
        if seq != self._recv_seq:
            raise AuthenticationError(f"frame sequence {seq} where {self._recv_seq} was expected (replayed frame)")

    def recv_body(self, header: bytes) -> Message:
        """The rest of a frame whose header passed both checks; its whole tag is verified."""
        _, kind, _, meta_len, blob_len = _HEADER.unpack(header)
        meta = _recv_exactly(self.sock, meta_len)
        blob = _recv_exactly(self.sock, blob_len)
        tag = _recv_exactly(self.sock, TAG_BYTES)
        if not hmac.compare_digest(tag, self._tag(self._recv_dir, header, meta, blob)):
            raise AuthenticationError("frame failed HMAC verification (wrong secret or tampered frame)")
        self._recv_seq += 1
        return Message(kind, json.loads(meta) if meta_len else {}, blob)

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass
