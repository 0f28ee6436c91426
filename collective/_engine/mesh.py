"""Authenticated TCP links between the ranks of a process set: the transport of the control traffic.

``Endpoint.star`` makes one set's links for the engine (``engine.py``): the set's coordinator
(its first member) links to every other member, and every other member only to the coordinator.
The engine frames those sockets with ``channel.PeerChannel``; this module carries no frames itself.

Each rank listens on one port, whose address it puts in the rendezvous store. Of two members, the
later one in the set connects and the earlier one accepts. A connection proves it belongs to the
run before it is used: the accepting side sends a random challenge, the connecting side answers
with its (link id, rank) and an HMAC-SHA256 of challenge and answer under the run's secret
(HorovodRunner's; under torchrun, a key rank 0 publishes in the store, which is as trusted as the
store itself), and the accepting side answers with one byte: accepted, turned away to make room
(the connecting side tries again, for a while), or refused (the set was removed there, or
``hvd.shutdown()`` ran). As with gloo, the frames themselves trust the network. The listener
(``_common/listener.py``) reads every handshake on one thread under a whole deadline, and a flood of
connections that never authenticate evicts its own oldest, never a real peer for good.

Every failure to make a link is a ``MeshError`` that names the peer and what to do: a peer that
never connects, an address that does not answer, a listener that keeps turning the link away,
or a process out of file descriptors.
"""

from __future__ import annotations

import atexit
import errno
import functools
import hashlib
import hmac
import logging
import os
import socket
import struct
import threading
import time

from ..._common.listener import GuardedListener, Handshake, RefusalTally, Refused

log = logging.getLogger("sparkhvd.mesh")

_HELLO = struct.Struct("!qq")  # link id, connecting rank
_CHALLENGE_BYTES = 16
_PROOF_BYTES = hashlib.sha256().digest_size
_HANDSHAKE_TIMEOUT = 30.0  # one handshake, from connect to the accepting side's answer
_DIAL_RETRY_S = 4 * _HANDSHAKE_TIMEOUT  # how long a dial is tried again while the listener turns it away
_ACCEPTED, _BUSY, _REFUSED = b"+", b"B", b"X"  # the accepting side's answer to a handshake


class MeshError(ConnectionError):
    """A control link failed: a peer exited, sent a bad frame, or never arrived."""


class Endpoint:
    """This process's listener and the run's key, from which it makes each set's links (``star``).

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
        self._pid = os.getpid()  # a forked child's close() leaves the refusal summary to this process
        self._arrived: dict = {}  # (link id, rank) -> greeted socket, not yet claimed by ``_connect``
        self._forgotten: set = set()  # link ids of removed sets: their late connections are refused
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._closed = False
        self._tally = RefusalTally(f"rank {rank}'s control listener at {self._address[0]}:{self._address[1]}", log)
        self._at_exit = functools.partial(_summarise, self._tally, os.getpid())
        atexit.register(self._at_exit)  # the summary line, when the rank's process ends without hvd.shutdown()
        self._guard = GuardedListener(self._listener, lambda sock, peer: _PeerGreeting(self, sock), tally=self._tally,
                                      timeout=lambda: _HANDSHAKE_TIMEOUT, name="sparkhvd-control-accept")
        store.set(f"{prefix}{rank}", f"{self._address[0]}:{self._address[1]}")

    def star(self, link_id: int, members: list, what: str) -> dict:
        """One set's links for the engine: its coordinator (``members[0]``) links to every other member,
        every other member only to the coordinator. Returns peer -> socket."""
        coordinator = members[0]
        ranks = list(members) if self.rank == coordinator else [coordinator, self.rank]
        return self._connect(link_id, ranks, what)

    def forget(self, link_id: int) -> None:
        """The set was removed: refuse its late connections and close those not claimed yet (the engine
        closes the links it was handed)."""
        with self._lock:
            self._forgotten.add(link_id)
            stale = [self._arrived.pop(k) for k in list(self._arrived) if k[0] == link_id]
        for sock in stale:
            sock.close()

    def close(self) -> None:
        with self._changed:
            self._closed = True
            arrived, self._arrived = list(self._arrived.values()), {}
            self._changed.notify_all()  # a set's links being made: give up now
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




def _summarise(tally: RefusalTally, pid: int) -> None:
    if os.getpid() == pid:  # not in a forked child that exits normally
        tally.close("while it was open")


class _PeerGreeting(Handshake):
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
