"""Direct TCP links between the ranks of a process set: the transport of the control exchange.

Before each collective the ranks of its set exchange a small frame (what they are about to
do, and sometimes a small payload: see ``torch/_check.py``). Through gloo that exchange is an
allgather that hops through gloo's worker and I/O threads: about 0.35 ms between two processes
on one host. Here each rank sends its frame straight to every other member on a socket it
keeps open and reads theirs, in the calling thread: about 0.07 ms, and a 1 MB frame in about
0.4 ms, where gloo's allreduce of 1 MB takes 2 ms or more.

A frame is a fixed header of ``HEADER_FIELDS`` int64s, whose last field is the length of the
payload that follows it. Nothing is unpickled. A frame over ``max_payload`` is refused before
its body is read.

Links are made on a set's first exchange: every member listens on one port (its address is in
the rendezvous store), connects to the members before it and accepts the ones after it. A
connection proves it belongs to the run before it is used: the accepting side sends a random
challenge, the connecting side answers with an HMAC-SHA256 of it under the run's secret
(HorovodRunner's; under torchrun, a key rank 0 publishes in the store, which is as trusted as
the store itself), and the accepting side answers with one byte: accepted, turned away to make
room (the connecting side tries again), or refused. As with gloo, the frames themselves trust
the network. The listener (``_listener.py``) reads every handshake on one thread under a whole
deadline, and a flood of connections that never authenticate evicts its own oldest, never a
real peer for good.

A peer that exits or fails closes its links, so the others fail at once with its rank named,
instead of waiting out a timeout.
"""

from __future__ import annotations

import atexit
import errno
import functools
import hashlib
import hmac
import logging
import os
import selectors
import socket
import struct
import threading
import time

from ._listener import GuardedListener, Handshake, Refused, RefusalTally

log = logging.getLogger("sparkhvd.mesh")

HEADER_FIELDS = 11  # int64s; the last one is the payload length
HEADER_BYTES = HEADER_FIELDS * 8
_HELLO = struct.Struct("!qq")  # link id, connecting rank
_CHALLENGE_BYTES = 16
_PROOF_BYTES = hashlib.sha256().digest_size
_HANDSHAKE_TIMEOUT = 30.0  # one handshake, from connect to the accepting side's answer
_DIAL_RETRY_S = 4 * _HANDSHAKE_TIMEOUT  # how long a dial is tried again while the listener turns it away
_ACCEPTED, _BUSY, _REFUSED = b"+", b"B", b"X"  # the accepting side's answer to a handshake


class MeshError(ConnectionError):
    """A control link failed: a peer exited, sent a bad frame, or never arrived."""


class Endpoint:
    """This process's listener, the run's key, and the links it has made (one Mesh per set).

    A background thread accepts connections and reads their handshakes (``GuardedListener``),
    so a peer is let in whenever it connects, whatever this rank's own code is doing, and a
    connection that never proves itself holds up nothing but its own handshake slot.
    """

    def __init__(self, *, rank: int, host: str, key: bytes, store, prefix: str, timeout: float):
        self.rank = rank
        self._key = key
        self._store = store
        self._prefix = prefix
        self._timeout = timeout
        self._listener = socket.create_server((host, 0))
        self._address = self._listener.getsockname()
        self._pid = os.getpid()  # a forked child must not shut down the sockets it shares with us
        self._arrived: dict = {}  # (link id, rank) -> greeted socket, not yet claimed by a Mesh
        self._meshes: dict = {}
        self._making: dict = {}  # link id -> lock held while that set's links are made
        self._forgotten: set = set()  # link ids of removed sets: their late connections are refused
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._closed = False
        self._tally = RefusalTally(f"rank {rank}'s control listener at {self._address[0]}:{self._address[1]}", log)
        self._at_exit = functools.partial(_summarise, self._tally, os.getpid())
        atexit.register(self._at_exit)  # the summary line, when the rank's process ends without hvd.shutdown()
        self._guard = GuardedListener(self._listener, lambda sock, peer: _Greeting(self, sock), tally=self._tally,
                                      timeout=lambda: _HANDSHAKE_TIMEOUT, name="sparkhvd-control-accept")
        store.set(f"{prefix}{rank}", f"{self._address[0]}:{self._address[1]}")

    def mesh(self, link_id: int, ranks: list, what: str) -> Mesh:
        """The links among ``ranks`` (global ranks, this one included), made on first use."""
        with self._lock:
            mesh = self._meshes.get(link_id)
            if mesh is not None:
                return mesh
            making = self._making.setdefault(link_id, threading.Lock())
        with making:
            with self._lock:
                mesh = self._meshes.get(link_id)
            if mesh is None:
                mesh = Mesh(self._connect(link_id, ranks, what), ranks, self._timeout, self._pid)
                with self._lock:
                    gone = self._closed or link_id in self._forgotten
                    if not gone:
                        self._meshes[link_id] = mesh
                if gone:
                    mesh.close()
                    raise MeshError(f"{what} cannot run: its process set was removed, or hvd.shutdown() ran, "
                                    "while its control links were being made.")
            return mesh

    def star(self, link_id: int, members: list, what: str) -> dict:
        """One set's links for the engine: its coordinator (``members[0]``) links to every other member,
        every other member only to the coordinator. Returns peer -> socket."""
        coordinator = members[0]
        ranks = list(members) if self.rank == coordinator else [coordinator, self.rank]
        return self._connect(link_id, ranks, what)

    def forget(self, link_id: int) -> None:
        """Close one set's links (the set was removed)."""
        with self._lock:
            self._forgotten.add(link_id)
            self._making.pop(link_id, None)
            mesh = self._meshes.pop(link_id, None)
            stale = [self._arrived.pop(k) for k in list(self._arrived) if k[0] == link_id]
        if mesh is not None:
            mesh.close()
        for sock in stale:
            sock.close()

    def close(self) -> None:
        with self._changed:
            self._closed = True
            meshes, self._meshes = list(self._meshes.values()), {}
            arrived, self._arrived = list(self._arrived.values()), {}
            self._changed.notify_all()  # a set's links being made: give up now
        for mesh in meshes:
            mesh.close()
        for sock in arrived:
            sock.close()
        self._guard.close()  # in a forked child, only closes our copy of the listening socket
        if os.getpid() == self._pid:
            atexit.unregister(self._at_exit)
            self._tally.close("while it was open")

    def _connect(self, link_id: int, ranks: list, what: str) -> dict:
        deadline = time.monotonic() + self._timeout
        links = {}
        try:
            for peer in ranks[:ranks.index(self.rank)]:
                links[peer] = self._dial(peer, link_id, what, deadline)
            expected = set(ranks[ranks.index(self.rank) + 1:])
            with self._changed:
                while True:
                    for peer in [p for p in expected if (link_id, p) in self._arrived]:
                        links[peer] = self._arrived.pop((link_id, peer))
                        expected.discard(peer)
                    remaining = deadline - time.monotonic()
                    if not expected or remaining <= 0 or self._closed:
                        break
                    self._changed.wait(remaining)
                closed = self._closed
            if closed:
                raise MeshError(f"{what} cannot run: hvd.shutdown() closed this rank's control links.")
            if expected:
                raise MeshError(f"ranks {','.join(map(str, sorted(expected)))} did not connect within "
                                f"{self._timeout:.0f} s for {what}; they never reached it, or cannot reach this "
                                f"rank's control address {self._address}.")
        except BaseException:
            for sock in links.values():
                sock.close()
            raise
        for sock in links.values():
            sock.settimeout(None)
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return links

    def _dial(self, peer: int, link_id: int, what: str, deadline: float) -> socket.socket:
        """A link to an earlier member ``peer``, made by its listener; tried again, until ``deadline``,
        while that listener turns connections away (its port flooded) or does not answer."""
        address = self._store.get(f"{self._prefix}{peer}").decode()
        host, port = address.rsplit(":", 1)
        started, attempts, pause = time.monotonic(), 0, 0.05
        deadline = min(deadline, started + _DIAL_RETRY_S)
        while True:
            attempts += 1
            outcome = self._dial_once((host, int(port)), peer, link_id, what, deadline)
            if isinstance(outcome, socket.socket):
                return outcome
            if time.monotonic() + pause >= deadline:
                break
            time.sleep(pause)
            pause = min(1.0, pause * 2)
        raise MeshError(f"could not make the control link to rank {peer} for {what}: its listener at {address} "
                        f"turned away or did not answer all {attempts} attempts in {time.monotonic() - started:.0f} s "
                        f"(the last: {outcome}). Rank {peer} may well be healthy: something is flooding that port "
                        "with connections that never authenticate (its output counts them), or its process is out of "
                        "file descriptors; stop what connects to it, or raise `ulimit -n` there.")

    def _dial_once(self, address: tuple, peer: int, link_id: int, what: str, deadline: float):
        """One attempt: the linked socket, or why the listener turned it away (worth another try)."""
        try:
            sock = socket.create_connection(address, timeout=max(0.05, min(_HANDSHAKE_TIMEOUT,
                                                                           deadline - time.monotonic())))
        except TimeoutError as exc:  # no SYN-ACK: a cut path or a dead host, not a busy listener
            raise MeshError(f"could not reach rank {peer}'s control address {address[0]}:{address[1]} for {what} "
                            f"within {_HANDSHAKE_TIMEOUT:.0f} s; its host is down, or the network between the two "
                            "hosts drops the connection (routes, firewalls).") from exc
        except OSError as exc:
            if exc.errno in (errno.EMFILE, errno.ENFILE):
                raise MeshError(f"rank {self.rank} could not open its control link to rank {peer} for {what}: this "
                                f"process is out of file descriptors ({exc}); raise `ulimit -n` where the ranks run, "
                                "or close the files and sockets the training function keeps open.") from exc
            raise MeshError(f"could not reach rank {peer}'s control address {address[0]}:{address[1]} for {what} "
                            f"({exc}); it has exited, or this host cannot reach it.") from exc
        try:
            limit = min(deadline, time.monotonic() + _HANDSHAKE_TIMEOUT)
            challenge = _read_exactly(sock, _CHALLENGE_BYTES, limit)
            hello = _HELLO.pack(link_id, self.rank)
            sock.sendall(hello + hmac.new(self._key, challenge + hello, hashlib.sha256).digest())
            answer = _read_exactly(sock, 1, limit)
        except TimeoutError:
            sock.close()
            return "no answer to the handshake in time"
        except OSError as exc:
            sock.close()
            return f"the listener closed the connection during the handshake ({exc})"
        if answer == _ACCEPTED:
            return sock
        sock.close()
        if answer == _BUSY:
            return "the listener was full and dropped this connection to make room"
        raise MeshError(f"rank {peer} refused the control link for {what}: that process set was removed there, or "
                        "hvd.shutdown() ran there; every rank must create and remove process sets together.")

    def _file(self, sock: socket.socket, hello: bytes) -> None:
        """Accept a proven connection under its (link id, rank), for ``_connect`` to claim."""
        key = _HELLO.unpack(hello)
        with self._changed:
            if self._closed or key[0] in self._forgotten:
                raise Refused(f"a control link for set {key[0]} from rank {key[1]} that this rank cannot take (its set "
                              "was removed, or hvd.shutdown() ran)", _REFUSED)
            sock.send(_ACCEPTED)  # before any frame of the set can be sent on it
            stale = self._arrived.get(key)  # a retry of a dial that gave up on its first try: the new one wins
            self._arrived[key] = sock
            if stale is not None:
                stale.close()
            self._changed.notify_all()


def local_address(toward: str | None) -> str:
    """The address of this host's interface that routes toward ``toward`` (no packet is sent)."""
    if not toward:
        return socket.gethostbyname(socket.gethostname())
    family, _, _, _, address = socket.getaddrinfo(toward, 1, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect(address)
        return probe.getsockname()[0]


def _summarise(tally: RefusalTally, pid: int) -> None:
    if os.getpid() == pid:  # not in a forked child that exits normally
        tally.close("while it was open")


class _Greeting(Handshake):
    """The accepting side of a control handshake: a random challenge out, then the connecting
    rank's (link id, rank) and its HMAC of both under the run's key in."""

    need = _HELLO.size + _PROOF_BYTES

    def __init__(self, endpoint: Endpoint, sock: socket.socket):
        self._endpoint = endpoint
        self._sock = sock
        self.greeting = self._challenge = os.urandom(_CHALLENGE_BYTES)

    def check(self, data: bytes) -> int:
        hello, proof = data[:_HELLO.size], data[_HELLO.size:]
        if not hmac.compare_digest(proof, hmac.new(self._endpoint._key, self._challenge + hello,
                                                   hashlib.sha256).digest()):
            raise Refused("wrong key: the answer to the challenge is not an HMAC under this run's key")
        self._endpoint._file(self._sock, hello)
        return 0

    def unserved(self, reason: str) -> bytes:
        return _BUSY


class Mesh:
    """Open links to every other member of one set; ``allgather`` runs one exchange at a time."""

    def __init__(self, links: dict, ranks: list, timeout: float, owner: int):
        self._links = links  # global rank -> non-blocking socket
        self._owner = owner  # the pid that made the links
        self._ranks = ranks
        self._timeout = timeout
        self._selector = selectors.DefaultSelector()
        for peer, sock in links.items():
            self._selector.register(sock, selectors.EVENT_READ, peer)
        self._headers = {peer: bytearray(HEADER_BYTES) for peer in links}
        self._payloads = {peer: bytearray() for peer in links}
        self._lock = threading.Lock()
        self._broken: str | None = None
        self._received: dict = {}  # the exchange in progress: peer -> its frame, once read whole

    def allgather(self, header, payload, max_payload: int, what: str, consume):
        """Send (header, payload) to every member; return ``consume(frames)``.

        ``header``: HEADER_BYTES bytes whose last little-endian int64 is the payload's length in
        bytes. ``frames``: every member's (header, payload) as byte memoryviews, in set order,
        this rank's being what it passed. They are only valid inside ``consume``, which runs
        before the next exchange can reuse the buffers.
        """
        header, payload = memoryview(header).cast("B"), memoryview(payload).cast("B")
        with self._lock:
            if self._broken is not None:
                raise MeshError(f"{what} cannot run: the control links broke in an earlier collective "
                                f"({self._broken}); restart the job.")
            try:
                received = self._exchange(header, payload, max_payload, what)
            except BaseException as exc:  # a frame may be half sent or half read: the streams are out of step
                self._broken = str(exc) or type(exc).__name__
                raise
            return consume([received[rank] if rank in received else (header, payload) for rank in self._ranks])

    def _exchange(self, header: memoryview, payload: memoryview, max_payload: int, what: str) -> dict:
        unsent = {peer: [header, payload] for peer in self._links}
        got = dict.fromkeys(self._links, 0)
        length = {}
        done = self._received = {}
        deadline = time.monotonic() + self._timeout
        writing = False
        while unsent or len(done) < len(self._links):
            for peer, parts in list(unsent.items()):
                if _send_some(self._links[peer], parts, peer, what):
                    del unsent[peer]
            for peer in self._links:
                if peer not in done:
                    self._receive(peer, got, length, done, max_payload, what)
            if not unsent and len(done) == len(self._links):
                break
            if bool(unsent) != writing:  # wait for room to write only while something is unsent
                writing = bool(unsent)
                for peer, sock in self._links.items():
                    events = selectors.EVENT_READ | (selectors.EVENT_WRITE if peer in unsent else 0)
                    self._selector.modify(sock, events, peer)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(self._links) - set(done))
                raise MeshError(f"{what} waited {self._timeout:.0f} s for ranks {','.join(map(str, missing))}, "
                                "which never called it; every rank of a set must call the same collectives in "
                                "the same order.")
            self._selector.select(remaining)
        if writing:
            for peer, sock in self._links.items():
                self._selector.modify(sock, selectors.EVENT_READ, peer)
        return done

    def waiting_for(self) -> list:
        """The peers whose frame the exchange in progress still waits for (any thread; a diagnostic)."""
        received = self._received
        return sorted(peer for peer in list(self._links) if peer not in received)

    def _receive(self, peer: int, got: dict, length: dict, done: dict, max_payload: int, what: str) -> None:
        sock = self._links[peer]
        while True:
            if peer not in length:
                buf, need = self._headers[peer], HEADER_BYTES
            else:
                buf, need = self._payloads[peer], length[peer]
            if got[peer] == need:
                if peer in length:
                    done[peer] = (memoryview(self._headers[peer]), memoryview(self._payloads[peer])[:length[peer]])
                    return
                size = struct.unpack_from("<q", self._headers[peer], HEADER_BYTES - 8)[0]
                if not 0 <= size <= max_payload:
                    raise MeshError(f"rank {peer} sent a control frame with a {size}-byte payload during {what}, "
                                    f"over the limit of {max_payload}; every rank must run the same sparkhvd "
                                    "version.")
                length[peer] = size
                got[peer] = 0
                if len(self._payloads[peer]) < size:
                    self._payloads[peer] = bytearray(size)
                continue
            try:
                n = sock.recv_into(memoryview(buf)[got[peer]:need])
            except BlockingIOError:
                return
            except OSError as exc:
                raise MeshError(f"rank {peer}'s control link failed during {what} ({exc}); it has exited or "
                                "failed: its own error is in its output.") from exc
            if n == 0:
                raise MeshError(f"rank {peer} closed its control link during {what}: it has exited or failed; "
                                "its own error is in its output.")
            got[peer] += n

    def close(self) -> None:
        for sock in self._links.values():
            if os.getpid() == self._owner:
                try:
                    sock.shutdown(socket.SHUT_RDWR)  # wakes an exchange waiting on it in another thread
                except OSError:
                    pass
            sock.close()
        self._selector.close()


def _send_some(sock: socket.socket, parts: list, peer: int, what: str) -> bool:
    """Send what the socket takes now; True when ``parts`` (consumed in place) is all sent."""
    while parts:
        if not len(parts[0]):
            parts.pop(0)
            continue
        try:
            n = sock.sendmsg(parts)
        except BlockingIOError:
            return False
        except OSError as exc:
            raise MeshError(f"rank {peer}'s control link failed during {what} ({exc}); it has exited or failed: "
                            "its own error is in its output.") from exc
        while n and parts:
            if n >= len(parts[0]):
                n -= len(parts[0])
                parts.pop(0)
            else:
                parts[0] = parts[0][n:]
                n = 0
    return True


def _read_exactly(sock: socket.socket, n: int, deadline: float) -> bytes:
    """``n`` bytes, all by ``deadline`` (a trickle of bytes does not extend it)."""
    data = b""
    while len(data) < n:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("the handshake took too long")
        sock.settimeout(remaining)
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError("the peer closed the connection during the handshake")
        data += chunk
    return data
