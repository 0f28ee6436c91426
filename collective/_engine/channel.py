"""One control link, framed for the engine's selector loop: whole frames in and out, never blocking.

A frame is ``FRAME`` (two little-endian int64s: the lengths of the meta and of the payload),
then the meta (UTF-8 JSON: what the frame says) and the payload (raw tensor bytes). Nothing is
unpickled, and a length over the limits is refused before its body is read. The links are made
and authenticated by ``mesh.Endpoint``; as with gloo, the frames themselves trust the network.
"""

from __future__ import annotations

import collections
import json
import socket
import struct

from .mesh import MeshError

FRAME = struct.Struct("<qq")
_encode = json.JSONEncoder(separators=(",", ":")).encode  # one encoder: json.dumps with options builds one per call
_decode = json.JSONDecoder().decode  # on text: json.loads would first work out the bytes' encoding each time
MAX_META = 64 << 20  # a response listing every op of a large model is a few MB at most
BUFFER = 256 << 10  # bytes read at once; a larger frame gets a buffer of its own


class PeerChannel:
    """The engine's end of one link to ``peer`` (a global rank)."""

    frames_sent = 0  # by this process, over every link (``bench/control_scale.py`` reads them)
    meta_bytes_sent = 0  # the frames' JSON, without their payloads

    def __init__(self, sock: socket.socket, peer: int, max_payload: int):
        self.sock = sock
        self.peer = peer
        self._max_payload = max_payload
        self._out: collections.deque = collections.deque()  # memoryviews still to send
        self._buf = bytearray(BUFFER)  # frames as they arrive: [_start, _end) is still to parse
        self._start = self._end = 0
        self._body: bytearray | None = None  # a frame too large for the buffer, ``_got`` bytes of it in
        self._meta_len = 0
        self._got = 0
        self._failure: MeshError | None = None  # the link failed after frames that were still to be handed out
        self.events = 0  # the selector events its socket is registered for (the engine's bookkeeping)
        self.queued = 0  # bytes handed to ``send`` so far
        self.sent = 0  # bytes the socket has taken so far: a frame queued when ``queued`` was q has left once sent >= q

    def send(self, meta: dict, payload=b"") -> None:
        """Queue a frame and send what the socket takes now (``flush`` sends the rest)."""
        PeerChannel.frames_sent += 1
        data = _encode(meta).encode()
        PeerChannel.meta_bytes_sent += len(data)
        payload = memoryview(payload).cast("B")
        head = FRAME.pack(len(data), payload.nbytes) + data
        self.queued += len(head) + payload.nbytes
        if self._out:  # behind frames still waiting for room
            self._out.append(memoryview(head))
            if payload.nbytes:
                self._out.append(payload)
            self.flush()
            return
        try:
            n = self.sock.sendmsg([head, payload] if payload.nbytes else [head])
        except BlockingIOError:
            n = 0
        except OSError as exc:
            raise self._failed(exc) from exc
        self.sent += n
        if n < len(head):
            self._out.append(memoryview(head)[n:])
            n = len(head)
        if n - len(head) < payload.nbytes:
            self._out.append(payload[n - len(head):])
        if self._out:
            self.flush()  # as much more as the socket takes now

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
            self.sent += n
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
        """Read what the socket has into ``frames``. Small frames come in through one buffer, several per
        system call; a frame larger than the buffer is read straight into its own. Returns after a read
        that did not fill what it asked for: the selector says again if more arrives."""
        while True:
            if self._body is not None:  # a large frame, read into its own buffer
                if self._recv(memoryview(self._body)[self._got:]) is None:
                    return
                if self._got == len(self._body):
                    body, self._body, self._got = self._body, None, 0
                    frames.append(self._frame(body, self._meta_len))
                continue
            while self._parse(frames):
                pass
            if self._body is not None:
                continue
            if self._start:  # keep the unparsed tail at the front
                tail = self._end - self._start
                self._buf[:tail] = self._buf[self._start:self._end]
                self._start, self._end = 0, tail
            asked = len(self._buf) - self._end
            n = self._recv(memoryview(self._buf)[self._end:])
            if n is None:
                return
            self._end += n
            if n < asked:
                while self._parse(frames):
                    pass
                if self._body is None:
                    return

    def _parse(self, frames: list) -> bool:
        """Take one whole frame from the buffer (True), or start a large one's own buffer (False)."""
        have = self._end - self._start
        if have < FRAME.size:
            return False
        meta_len, payload_len = FRAME.unpack_from(self._buf, self._start)
        if not (0 <= meta_len <= MAX_META and 0 <= payload_len <= self._max_payload):
            raise MeshError(f"rank {self.peer} sent a control frame of {meta_len} + {payload_len} bytes, "
                            f"over the limits ({MAX_META} + {self._max_payload}); every rank must run "
                            "the same sparkhvd version.")
        size = meta_len + payload_len
        begin = self._start + FRAME.size
        if have - FRAME.size >= size:
            self._start = begin + size
            frames.append(self._frame(self._buf[begin:begin + size], meta_len))  # a copy: the buffer is reused
            return True
        if FRAME.size + size > len(self._buf):  # too large for the buffer: its own, filled from here on
            self._body, self._meta_len = bytearray(size), meta_len
            self._got = have - FRAME.size
            self._body[:self._got] = self._buf[begin:self._end]
            self._start = self._end = 0
        return False

    def _recv(self, into: memoryview) -> int | None:
        """One read into ``into``: the bytes read, or None when none are waiting."""
        try:
            n = self.sock.recv_into(into)
        except BlockingIOError:
            return None
        except OSError as exc:
            raise self._failed(exc) from exc
        if n == 0:
            raise MeshError(f"rank {self.peer} closed its control link: it has exited or failed; its own error "
                            "is in its output.")
        if self._body is not None:
            self._got += n
        return n

    def _frame(self, body: bytearray, meta_len: int) -> tuple:
        try:
            meta = _decode(body[:meta_len].decode())
        except ValueError as exc:
            raise MeshError(f"rank {self.peer} sent a control frame that is not valid JSON ({exc}); every "
                            "rank must run the same sparkhvd version.") from exc
        return meta, memoryview(body)[meta_len:]

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
