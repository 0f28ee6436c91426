"""Listeners that no one on the network can exhaust: the driver service's port and the ranks'
control ports.

One thread per listener accepts connections and reads every handshake without blocking: no
thread is started for a connection that has not proved it knows the run's secret. Each
connection must finish its handshake by a deadline counted from its accept (a trickle of bytes
does not extend it). At most ``max_pending`` handshakes are in progress at once; a connection
that finds them all taken evicts the oldest, so a flood of idle or slow connections cannot lock
a real peer out: a real peer answers at once, what a connection has sent is read before it is
evicted, and a real peer dropped all the same is told so (``Handshake.unserved``) and connects
again (``ServiceClient.request``, ``Endpoint._dial``). When the process is out of file
descriptors, the oldest handshake is dropped to make room; connections that already proved
themselves are never touched.

Refused connections are counted by reason (``RefusalTally``): the first is logged, then at most
one line per ``REPORT_INTERVAL_S`` while refusals go on, and one summary line when the listener
closes.
"""

from __future__ import annotations

import abc
import collections
import errno
import logging
import os
import re
import selectors
import socket
import threading
import time
from typing import Callable

REPORT_INTERVAL_S = 30.0  # at most one log line about refusals per interval
MAX_REASONS = 16  # distinct refusal reasons counted; others are counted together
MAX_PEERS = 8  # distinct peer addresses named in a report
RECENT = 100  # the last refusals kept in full, newest last
ACCEPT_BATCH = 64  # connections accepted before the handshakes already under way are read again
_OUT_OF_FDS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)


def default_max_pending() -> int:
    """Handshakes in progress at once: a quarter of this process's file descriptors, 16 to 512."""
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        if soft == resource.RLIM_INFINITY or soft <= 0:
            soft = 1 << 16
    except (ImportError, OSError, ValueError):  # pragma: no cover - not POSIX
        soft = 1024
    return max(16, min(512, soft // 4))


class Refused(Exception):
    """A connection failed its handshake; the message is the reason (counted, not printed)."""

    def __init__(self, reason: str, reply: bytes = b""):
        super().__init__(reason)
        self.reply = reply  # sent, without waiting, before the connection is closed


class Handshake(abc.ABC):
    """One connection's unauthenticated phase, driven by the listener's thread.

    ``greeting`` is sent when the connection is accepted; then the listener reads until it holds
    ``need`` bytes and calls ``check`` with them all.
    """

    greeting: bytes = b""
    need: int = 0

    @abc.abstractmethod
    def check(self, data: bytes) -> int:
        """Verify ``data``; return the total bytes needed before the next check, or 0 once the
        connection has been handed over (the listener lets go of it). Raise ``Refused`` to close it."""

    def unserved(self, reason: str) -> bytes:
        """What to send a connection dropped unserved (evicted to make room, or too slow),
        before closing it: a real peer may take it as a cue to connect again."""
        return b""

    def too_slow(self, timeout: float) -> str:
        """The refusal reason for a handshake not finished by its deadline."""
        return f"slow handshake: not finished within {timeout:g} s of connecting"


Opener = Callable[[socket.socket, str], Handshake]


class RefusalTally:
    """Refused connections counted by reason and peer; logged at most once per interval.

    Reasons are grouped with their numbers replaced by <NUM> (as Ray Train's poll.py groups
    errors) and shown by their first example; the count of distinct reasons and peers is bounded.
    """

    def __init__(self, what: str, log: logging.Logger, interval: float | None = None):
        self.what = what  # "the driver service at 127.0.0.1:4242": the subject of every line
        self._log = log
        self._interval = interval
        self._lock = threading.Lock()
        self.total = 0
        self._reasons: dict[str, list] = {}  # key -> [first example, count]
        self._peers: dict[str, int] = {}
        self._other_peers = 0
        self.recent: collections.deque = collections.deque(maxlen=RECENT)  # "peer: reason", newest last
        self._reported = 0  # total at the last log line
        self._last_log: float | None = None
        self._summarised = False

    def add(self, reason: str, peer: str) -> None:
        """Count one refusal; log the first at once and then at most one line per interval."""
        key = _group(reason)
        with self._lock:
            self.total += 1
            self.recent.append(f"{peer}: {reason}")
            entry = self._reasons.get(key)
            if entry is None:
                if len(self._reasons) >= MAX_REASONS:
                    key = "other reasons"
                    entry = self._reasons.setdefault(key, [key, 0])
                else:
                    entry = self._reasons[key] = [_short(reason), 0]
            entry[1] += 1
            if peer in self._peers or len(self._peers) < MAX_PEERS:
                self._peers[peer] = self._peers.get(peer, 0) + 1
            else:
                self._other_peers += 1
            now = time.monotonic()
            interval = REPORT_INTERVAL_S if self._interval is None else self._interval
            if self._last_log is None:
                line = (f"{self.what} refused a connection from {peer}: {reason}. Further refusals are counted and "
                        f"reported at most every {interval:g} s, and summarised when it closes.")
            elif now - self._last_log >= interval:
                line = (f"{self.what} refused {self.total - self._reported:,} more connections in the last "
                        f"{now - self._last_log:.1f} s ({self.total:,} in all): {self._breakdown()}.")
            else:
                return
            self._last_log, self._reported = now, self.total
        self._log.warning("%s", line)

    def counts(self) -> dict:
        """A snapshot: {reason (first example): count}."""
        with self._lock:
            return {example: n for example, n in self._reasons.values()}

    def summary(self, during: str) -> str | None:
        """One sentence for everything refused, or None when nothing was."""
        with self._lock:
            if not self.total:
                return None
            return f"{self.what} refused {self.total:,} connection{'s' if self.total != 1 else ''} {during}: " \
                   f"{self._breakdown()}."

    def close(self, during: str) -> None:
        """Log the summary line, once."""
        with self._lock:
            if self._summarised:
                return
            self._summarised = True
        line = self.summary(during)
        if line is not None:
            self._log.warning("%s", line)

    def _breakdown(self) -> str:
        reasons = sorted(self._reasons.values(), key=lambda e: -e[1])
        text = "; ".join(f"{n:,} × {example}" for example, n in reasons)
        peers = ", ".join(sorted(self._peers))
        if self._other_peers:
            peers += f" and {self._other_peers:,} connections from other addresses"
        return f"{text}; from {peers}"


def _group(reason: str) -> str:
    reason = re.sub(r"b'(?:[^'\\]|\\.)*'|b\"(?:[^\"\\]|\\.)*\"", "<BYTES>", reason)
    return re.sub(r"\d+(?:\.\d+)?", "<NUM>", reason)


def _short(reason: str) -> str:
    """A reason without its explanation: up to the first ';' or ' ('."""
    return re.split(r";| \(", reason, maxsplit=1)[0].strip()


class _Pending:
    __slots__ = ("sock", "peer", "handshake", "timeout", "deadline", "buf")

    def __init__(self, sock, peer, handshake, timeout):
        self.sock, self.peer, self.handshake, self.timeout = sock, peer, handshake, timeout
        self.deadline = time.monotonic() + timeout
        self.buf = bytearray()


class GuardedListener:
    """Accepts on ``server`` and runs each connection's ``Handshake`` (from ``opener``) on one thread.

    ``timeout()`` is each handshake's whole deadline in seconds, read at accept; refusals go to
    ``tally``. ``close()`` stops it and closes every connection still in its handshake.
    """

    def __init__(self, server: socket.socket, opener: Opener, *, tally: RefusalTally,
                 timeout: Callable[[], float], name: str, max_pending: int | None = None):
        self._server = server
        self._opener = opener
        self.tally = tally
        self._timeout = timeout
        self.max_pending = max_pending or default_max_pending()
        self._pending: collections.OrderedDict = collections.OrderedDict()  # fd -> _Pending, oldest first
        self._selector = selectors.DefaultSelector()
        self._closed = False
        self._pid = os.getpid()
        server.setblocking(False)
        self._selector.register(server, selectors.EVENT_READ, None)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def thread(self) -> threading.Thread:
        """The thread that accepts and reads handshakes."""
        return self._thread

    @property
    def pending(self) -> int:
        """Handshakes in progress now."""
        return len(self._pending)

    def close(self) -> None:
        """Stop accepting; close the listening socket and every connection still in its handshake."""
        self._closed = True
        if os.getpid() != self._pid:  # a forked child: the thread is not here, the sockets are shared
            self._server.close()
            return
        try:
            self._server.shutdown(socket.SHUT_RDWR)  # wakes the thread
        except OSError:
            pass
        if self._thread is not threading.current_thread():
            self._thread.join(5.0)
        self._server.close()

    # ---- the thread ----------------------------------------------------------------------

    def _run(self) -> None:
        paused_until = 0.0
        try:
            while not self._closed:
                now = time.monotonic()
                if paused_until and now >= paused_until:
                    self._selector.register(self._server, selectors.EVENT_READ, None)
                    paused_until = 0.0
                waits = [1.0]
                if self._pending:
                    waits.append(next(iter(self._pending.values())).deadline - now)
                if paused_until:
                    waits.append(paused_until - now)
                events = self._selector.select(max(0.0, min(waits)))
                if self._closed:
                    break
                listener_ready = False
                for key, _ in events:
                    if key.data is None:
                        listener_ready = True
                    else:
                        self._read(key.data)
                if listener_ready and not self._accept():
                    self._selector.unregister(self._server)  # out of descriptors: pause accepting
                    paused_until = time.monotonic() + 0.1
                self._expire()
        finally:
            for item in list(self._pending.values()):
                self._drop(item)
            self._selector.close()

    def _accept(self) -> bool:
        """Accept what is waiting (a batch); False when out of file descriptors with nothing to drop."""
        for _ in range(ACCEPT_BATCH):
            try:
                sock, address = self._server.accept()
            except BlockingIOError:
                return True
            except OSError as exc:
                if self._closed:
                    return True
                if exc.errno in _OUT_OF_FDS:
                    if self._pending:  # make room: the oldest handshake goes
                        self._evict(f"the listener's process ran out of file descriptors ({os.strerror(exc.errno)}); "
                                    "dropped the oldest unauthenticated connection to make room")
                        continue
                    self.tally.add(f"could not accept a connection: {os.strerror(exc.errno)}; no connection in its "
                                   "handshake is left to drop, so the process's own files and connections hold every "
                                   "descriptor: raise the limit with `ulimit -n`", "an address not yet known")
                    return False
                continue  # ECONNABORTED and the like: that connection is gone, not the listener
            peer = address[0] if isinstance(address, tuple) else str(address)
            if len(self._pending) >= self.max_pending:
                self._evict(f"evicted while authenticating: {self.max_pending} connections were authenticating at "
                            "once (the listener's limit)")
            self._open(sock, peer)
        return True

    def _open(self, sock: socket.socket, peer: str) -> None:
        try:
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            handshake = self._opener(sock, peer)
            item = _Pending(sock, peer, handshake, self._timeout())
            if handshake.greeting:
                sock.send(handshake.greeting)  # a few bytes into an empty buffer: never partial
            self._selector.register(sock, selectors.EVENT_READ, item)
        except (OSError, ValueError) as exc:
            self.tally.add(f"could not greet the connection ({exc})", peer)
            sock.close()
            return
        self._pending[sock.fileno()] = item

    def _read(self, item: _Pending) -> None:
        """Read what has arrived on one handshake; check it once enough has."""
        try:
            while True:
                want = item.handshake.need - len(item.buf)
                try:
                    chunk = item.sock.recv(want)
                except BlockingIOError:
                    return
                if not chunk:
                    raise Refused("closed before finishing its handshake" if item.buf
                                  else "closed without sending a byte")
                item.buf += chunk
                if len(item.buf) < item.handshake.need:
                    continue
                need = item.handshake.check(bytes(item.buf))
                if need == 0:  # handed over: the connection is no longer ours
                    self._forget(item)
                    return
                item.handshake.need = need
        except Refused as exc:
            self.tally.add(str(exc), item.peer)
            self._drop(item, exc.reply)
        except OSError as exc:
            self.tally.add(f"failed during its handshake ({exc})", item.peer)
            self._drop(item)
        except Exception as exc:  # noqa: BLE001 - a bug in a check must not stop the listener
            self.tally.add(f"could not be checked ({type(exc).__name__}: {exc})", item.peer)
            self._drop(item)

    def _expire(self) -> None:
        now = time.monotonic()
        while self._pending:
            item = next(iter(self._pending.values()))
            if item.deadline > now:
                return
            reason = item.handshake.too_slow(item.timeout)
            self.tally.add(reason, item.peer)
            self._drop(item, item.handshake.unserved(reason))

    def _evict(self, reason: str) -> None:
        """Drop the oldest handshake, unless what it sent completes it now."""
        item = next(iter(self._pending.values()))
        self._read(item)
        if self._pending.get(item.sock.fileno()) is item:  # still there: nothing completed it
            self.tally.add(reason, item.peer)
            self._drop(item, item.handshake.unserved(reason))

    def _forget(self, item: _Pending) -> None:
        self._pending.pop(item.sock.fileno(), None)
        try:
            self._selector.unregister(item.sock)
        except (KeyError, ValueError):
            pass

    def _drop(self, item: _Pending, reply: bytes = b"") -> None:
        self._forget(item)
        if reply:
            try:
                item.sock.send(reply)
            except OSError:
                pass
        item.sock.close()
