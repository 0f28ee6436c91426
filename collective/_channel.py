"""One control link, framed for the engine's selector loop: whole frames in and out, never blocking.

A frame is ``FRAME`` (two little-endian int64s: the lengths of the meta and of the payload),
then the meta (UTF-8 JSON: what the frame says) and the payload (raw tensor bytes). Nothing is
unpickled, and a length over the limits is refused before its body is read. The links are made
and authenticated by ``_mesh.Endpoint``; as with gloo, the frames themselves trust the network.
"""

from __future__ import annotations

import collections
import json
import socket
import struct

from ._mesh import MeshError

FRAME = struct.Struct("<qq")
MAX_META = 64 << 20  # a response listing every op of a large model is a few MB at most


class Channel:
    """The engine's end of one link to ``peer`` (a global rank)."""

    frames_sent = 0  # by this process, over every link (``bench/control_scale.py`` reads it)

    def __init__(self, sock: socket.socket, peer: int, max_payload: int):
        self.sock = sock
        self.peer = peer
        self._max_payload = max_payload
        self._out: collections.deque = collections.deque()  # memoryviews still to send
        self._head = bytearray(FRAME.size)
        self._body: bytearray | None = None
        self._meta_len = 0
        self._got = 0
        self._failure: MeshError | None = None  # the link failed after frames that were still to be handed out
        self.events = 0  # the selector events its socket is registered for (the engine's bookkeeping)

    def send(self, meta: dict, payload=b"") -> None:
        """Queue a frame and send what the socket takes now (``flush`` sends the rest)."""
        Channel.frames_sent += 1
        data = json.dumps(meta, separators=(",", ":")).encode()
        payload = memoryview(payload).cast("B")
        self._out.append(memoryview(FRAME.pack(len(data), payload.nbytes) + data))
        if payload.nbytes:
            self._out.append(payload)
        self.flush()

    def pending(self) -> bool:
        """Whether queued bytes wait for room in the socket."""
        return bool(self._out)

    def flush(self) -> None:
        while self._out:
            try:
                n = self.sock.sendmsg(list(self._out)[:64])
            except BlockingIOError:
                return
            except OSError as exc:
                raise self._failed(exc) from exc
            while n:
                first = self._out[0]
                if n >= first.nbytes:
                    n -= first.nbytes
                    self._out.popleft()
                else:
                    self._out[0] = first[n:]
                    n = 0

    def receive(self) -> list:
        """The frames that arrived whole: a list of (meta dict, payload bytearray). A failure of the link is
        raised once the frames that arrived before it have been handed out."""
        if self._failure is not None:
            raise self._failure
        frames = []
        try:
            self._read(frames)
        except MeshError as exc:
            if not frames:
                raise
            self._failure = exc
        return frames

    def _read(self, frames: list) -> None:
        while True:
            if self._body is None:
                buf, need = self._head, FRAME.size
            else:
                buf, need = self._body, len(self._body)
            if self._got == need:
                if self._body is None:
                    meta_len, payload_len = FRAME.unpack(self._head)
                    if not (0 <= meta_len <= MAX_META and 0 <= payload_len <= self._max_payload):
                        raise MeshError(f"rank {self.peer} sent a control frame of {meta_len} + {payload_len} bytes, "
                                        f"over the limits ({MAX_META} + {self._max_payload}); every rank must run "
                                        "the same sparkhvd version.")
                    self._meta_len, self._body, self._got = meta_len, bytearray(meta_len + payload_len), 0
                    if self._body:
                        continue
                body, self._body, self._got = self._body, None, 0
                try:
                    meta = json.loads(bytes(body[:self._meta_len]))
                except ValueError as exc:
                    raise MeshError(f"rank {self.peer} sent a control frame that is not valid JSON ({exc}); every "
                                    "rank must run the same sparkhvd version.") from exc
                frames.append((meta, memoryview(body)[self._meta_len:]))
                continue
            try:
                n = self.sock.recv_into(memoryview(buf)[self._got:need])
            except BlockingIOError:
                return
            except OSError as exc:
                raise self._failed(exc) from exc
            if n == 0:
                raise MeshError(f"rank {self.peer} closed its control link: it has exited or failed; its own error "
                                "is in its output.")
            self._got += n

    def _failed(self, exc: OSError) -> MeshError:
        return MeshError(f"rank {self.peer}'s control link failed ({exc}); it has exited or failed: its own error "
                         "is in its output.")

    def close(self) -> None:
        """Send what is still queued (for up to a second), then close."""
        if self._out:
            try:
                self.sock.settimeout(1.0)
                for part in self._out:
                    self.sock.sendall(part)
            except OSError:
                pass
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
