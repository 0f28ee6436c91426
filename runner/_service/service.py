"""The driver service: one authenticated TCP server per run.

It registers tasks and hands out ranks, serves the pickled function, serves the rendezvous
store the process groups are built from (``_common/rendezvous.py``; a blocked get or wait
ends when the run does), receives log lines, results and errors, and tells every worker to
stop when the run is aborted. It decides nothing about the run's outcome: the run's policy reads
its state as ``status()`` snapshots and decides (``_policy/policy.py``, ``_policy/supervise.py``).

Until a connection's first frame header verifies under the run's secret, it costs one
descriptor and a few bytes, never a thread: one thread reads every such handshake under a whole
deadline (``FIRST_FRAME_TIMEOUT_S``), evicting the oldest when its slots are full, and counts
what it refuses (``_common/listener.py``). Authenticated connections, a thread each, are
capped at ``CONNECTIONS_PER_RANK`` per rank plus ``CONNECTIONS_EXTRA``.

This file holds the listener, the greeting, the connections and the driver's side of the service; the
requests are answered by job, in the classes ``DriverService`` is made of: ``_service/tasks.py``
(registration, rank assignment, the function, the abort watch), ``_service/reports.py`` (output lines,
results, errors, exits, heartbeats), ``_service/commit_requests.py`` (elastic commits) and ``_service/store_requests.py``
(the rendezvous store).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from types import MappingProxyType
from typing import Callable

from ..._common.driver_messages import ONE_WAY, Aborted, MessageError, Refusal, decode_request, encode
from ..._common.listener import GuardedListener, Handshake, RefusalTally, Refused
from ..._common.protocol import (
    _HEADER,
    MAGIC,
    NONCE_BYTES,
    TAG_BYTES,
    AuthenticatedChannel,
    Kind,
    PeerClosed,
    ProtocolError,
)
from ..._common.rendezvous import RendezvousStore
from ..._common.topology import Placement
from .commit_requests import CommitHandlers
from .commit_store import CommitStore
from .reports import Failure, ReportHandlers
from .status import RunStatus
from .store_requests import STORE_KINDS, StoreHandlers
from .tasks import Registration, TaskHandlers

# Failure and Registration, the records the service keeps, are imported from here with DriverService.
__all__ = ["CONNECTIONS_EXTRA", "CONNECTIONS_PER_RANK", "FIRST_FRAME_TIMEOUT_S", "DriverService", "Failure", "LogSink",
           "Registration"]

log = logging.getLogger("sparkhvd.service")

LogSink = Callable[[int, str, list, "str | None"], None]  # (rank, stream, lines, progress): runner/_service/logs.py
LOST_POLL_S = 0.5  # how often wait_for_exits asks which ranks the cluster lost
FIRST_FRAME_TIMEOUT_S = 30.0  # a connection's first frame header must be authenticated this long after it connects
# Authenticated connections at once: each rank holds about five (its task agent with the log pumps,
# the worker, the abort watch, the rendezvous store, the heartbeat); the rest is headroom for
# hvd.init() after hvd.shutdown() and for user code that opens its own clients.
CONNECTIONS_PER_RANK = 32
CONNECTIONS_EXTRA = 64
BAD_FRAMES_LOGGED = 5  # malformed one-way frames logged per run; the rest are counted in bad_frames


class DriverService(TaskHandlers, ReportHandlers, CommitHandlers, StoreHandlers):
    """Serves one run of ``np`` tasks. Thread-safe; every state change notifies ``cv``."""

    def __init__(self, *, np: int, secret: bytes, payload: bytes, bind_host: str = "127.0.0.1",
                 on_log: LogSink | None = None, run_id: str | None = None, commits: CommitStore | None = None,
                 on_restore: Callable[[dict | None], None] | None = None, attempt: int = 0,
                 on_metrics: Callable[[int, int, dict | None], None] | None = None,
                 on_timeline: Callable[..., None] | None = None):
        self.np = np
        self.run_id = run_id
        self._secret = secret
        self.cv = threading.Condition()
        self.aborted: str | None = None
        self.finished = False
        # the tasks and their ranks (_service/tasks.py)
        self._payload = payload
        self.registrations: dict[int, Registration] = {}
        self.placements: list[Placement] | None = None
        self.gpu_lists: list[list[str]] = []  # task -> its CUDA_VISIBLE_DEVICES (_common/topology.py: host_gpus)
        self.endpoints: list = []  # rank -> [address, torch port, tf port] or None (runner/_shared/framework_env.py)
        self.placed_at: float | None = None  # when every task had registered and the ranks were assigned
        #: ``time.monotonic()`` of the attempt's start-up steps: ``registered`` (the first task), ``placed`` (the
        #: last: ranks assigned), ``fetched`` (every rank's process asked for the function: all processes are up)
        self.milestones: dict[str, float] = {}
        self._fetches = 0
        self._agents: dict[socket.socket, int] = {}  # each task agent's connection (its REGISTER's) -> its task
        self.agents_gone: set[int] = set()  # tasks whose agent's connection closed: no exit will come from them
        # what the ranks report (_service/reports.py)
        self._on_log = on_log or (lambda rank, stream, lines, progress: None)
        self._on_metrics = on_metrics or (lambda rank, attempt, metrics: None)  # each beat's (_service/metrics.py)
        self._on_timeline = on_timeline or (lambda *report, **details: None)  # each rank's traces (_service/timeline.py)
        self.bad_frames = 0  # one-way frames (LOG, PROGRESS) dropped as malformed (the first few are logged)
        self.results: dict[int, bytes] = {}
        self.failures: list[Failure] = []
        self.exits: dict[int, int] = {}
        self.progress: dict[int, tuple] = {}  # rank -> (its latest heartbeat's meta, when it arrived)
        # elastic commits (_service/commit_requests.py)
        self.hosts_updated: list | None = None  # [timestamp, HostUpdateResult]: told to rank 0 with each commit
        self.commits = commits if commits is not None else CommitStore(run_id=run_id or "")
        self._on_restore = on_restore  # called once, at rank 0's first RESTORE, with the commit's meta
        self.attempt = attempt  # which launch of the run this service serves (0, then one more per relaunch)
        self.store = RendezvousStore(self.cv, self._over)  # the ranks' c10d rendezvous (_service/store_requests.py)
        self._conns: set[socket.socket] = set()  # authenticated connections, each served by a thread
        self.max_connections = CONNECTIONS_PER_RANK * np + CONNECTIONS_EXTRA
        self._listen(bind_host)

    def _listen(self, bind_host: str) -> None:
        """Open the listening socket on ``bind_host`` (any free port) and start the listener's thread."""
        server = socket.create_server((bind_host, 0), backlog=128)
        self.address = (bind_host, server.getsockname()[1])
        self.tally = RefusalTally(f"the sparkhvd driver service at {bind_host}:{self.address[1]}", log)
        self.refusals = self.tally.recent  # the last refusals in full ("peer: reason"), newest last
        self._handlers = {
            Kind.REGISTER: self._register, Kind.FETCH: self._fetch, Kind.WATCH: self._watch,
            Kind.LOG: self._log, Kind.RESULT: self._result, Kind.ERROR: self._error,
            Kind.EXIT: self._exit, Kind.PROGRESS: self._progress, Kind.TIMELINE: self._timeline,
            Kind.CLOCK: self._clock,
            Kind.COMMIT: self._commit, Kind.RESTORE: self._restore,
            **{kind: self._store_request for kind in STORE_KINDS},
        }
        self._listener = GuardedListener(server, self._greet, tally=self.tally, name="sparkhvd-service",
                                         timeout=lambda: FIRST_FRAME_TIMEOUT_S)
        self._thread = self._listener.thread

    # ---- driver-side control -------------------------------------------------------------

    def abort(self, reason: str) -> None:
        """Tell every worker to stop and fail every blocked request."""
        with self.cv:
            if self.aborted is None and not self.finished:
                self.aborted = reason
            self.cv.notify_all()

    def status(self, wait: float = 0.0) -> RunStatus:
        """What the ranks have reported, copied under the lock, after waiting up to ``wait`` seconds for news."""
        with self.cv:
            if wait > 0:
                self.cv.wait(wait)
            return RunStatus(
                np=self.np, at=time.monotonic(), registrations=MappingProxyType(dict(self.registrations)),
                placements=None if self.placements is None else tuple(self.placements), placed_at=self.placed_at,
                results=MappingProxyType(dict(self.results)), failures=tuple(self.failures),
                exits=MappingProxyType(dict(self.exits)), progress=MappingProxyType(dict(self.progress)),
                hosts_updated=None if self.hosts_updated is None else tuple(self.hosts_updated),
                agents_gone=frozenset(self.agents_gone))

    def wait_for_exits(self, timeout: float, lost: Callable[[], set] | None = None) -> None:
        """Wait until every started rank's agent has reported its process's exit, or is gone.

        An agent reports only after reaping its rank process, so afterwards none is left running. An agent whose
        connection closed first (its executor was lost) reports nothing: it is not waited for. Nor is a rank in
        ``lost()`` (asked every ``LOST_POLL_S``, outside the lock): the ranks whose executor the cluster says it
        lost, whose agents may keep their connections open (a host cut off, or stopped). Ranks start only once all
        have registered: before that there is nothing to wait for.
        """
        asked = time.monotonic()
        deadline = asked + timeout
        gone: frozenset = frozenset(lost()) if lost is not None else frozenset()
        while True:
            with self.cv:
                if self.placements is None or len(self.exits) >= self.np or self._exits_or_gone(gone):
                    return
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return
                self.cv.wait(remaining if lost is None else min(remaining, LOST_POLL_S))
            if lost is not None and time.monotonic() - asked >= LOST_POLL_S:
                gone, asked = frozenset(lost()), time.monotonic()

    def close(self) -> None:
        """Stop serving: close the listening socket and every connection."""
        with self.cv:
            self.finished = True
            self.cv.notify_all()
        self._listener.close()
        with self.cv:
            conns = list(self._conns)
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            conn.close()
        self.tally.close(f"during run {self.run_id}" if self.run_id else "while it served its run")

    def _over(self) -> bool:
        return self.aborted is not None or self.finished

    def _exits_or_gone(self, lost: frozenset) -> bool:
        """Every rank has reported its exit, or its agent is gone, or it is in ``lost`` (cv held; ranks placed)."""
        return all(p.rank in self.exits or p.rank in lost or task in self.agents_gone
                   for task, p in enumerate(self.placements))

    # ---- connections ---------------------------------------------------------------------

    def _greet(self, sock: socket.socket, peer: str) -> "_DriverGreeting":
        return _DriverGreeting(self, sock, peer)

    def _admit(self, channel: AuthenticatedChannel, header: bytes, peer: str) -> None:
        """Serve a connection whose first frame header is authenticated, on a thread of its own."""
        sock = channel.sock
        with self.cv:
            serving = len(self._conns)
            full = serving >= self.max_connections
            if not full and not self.finished:
                self._conns.add(sock)
        if self.finished:
            raise Refused("authenticated after the run had finished")
        if full:
            text = (f"the driver service already serves {serving} authenticated connections, its limit for "
                    f"np={self.np} ({CONNECTIONS_PER_RANK} per rank + {CONNECTIONS_EXTRA}); close the ServiceClient "
                    "connections you open (new_client()) when you are done with them.")
            self._reply_and_refuse(channel, text)
        sock.setblocking(True)
        try:
            threading.Thread(target=self._serve, args=(channel, header, peer), daemon=True,
                             name=f"sparkhvd-conn-{peer}").start()
        except RuntimeError as exc:  # no thread to be had: refuse this one, keep serving the others
            with self.cv:
                self._conns.discard(sock)
            self._reply_and_refuse(channel, f"the driver could not start a thread to serve this connection ({exc}); "
                                            "it is out of threads or memory.")

    def _reply_and_refuse(self, channel: AuthenticatedChannel, text: str) -> None:
        try:
            channel.sock.settimeout(1.0)
            self._refuse(channel, text)
        except OSError:
            pass
        raise Refused(text)

    def _serve(self, channel: AuthenticatedChannel, header: bytes, peer: str) -> None:
        """Answer an authenticated connection's requests until it closes or breaks."""
        sock = channel.sock
        try:
            sock.settimeout(None)  # authenticated: from here on a connection may idle
            msg = channel.recv_body(header)
            while True:
                handler = self._handlers.get(msg.kind)
                if handler is None:
                    raise ProtocolError(f"unknown frame kind {msg.kind}")
                try:
                    request = decode_request(msg.kind, msg.meta, np=self.np)
                except MessageError as exc:
                    self._bad_frame(channel, Kind(msg.kind), exc, peer)
                    msg = channel.recv()
                    continue
                try:
                    handler(channel, request, msg.blob, peer)
                except (ProtocolError, OSError):
                    raise
                except Exception as exc:  # noqa: BLE001 - a request from an authenticated peer that breaks a handler
                    log.warning("sparkhvd driver service: bad %s request from %s: %r", Kind(msg.kind).name, peer, exc)
                    self._refuse(channel, f"the driver service could not handle a {Kind(msg.kind).name} request: "
                                          f"{type(exc).__name__}: {exc}")
                msg = channel.recv()
        except PeerClosed:
            pass
        except ProtocolError as exc:
            self.tally.add(str(exc), peer)
        except OSError:
            pass
        finally:
            with self.cv:
                self._conns.discard(sock)
                task = self._agents.pop(sock, None)
                if task is not None:
                    self.agents_gone.add(task)
                    self.cv.notify_all()
            try:
                sock.close()
            except OSError:
                pass

    def _wait(self, ready: Callable[[], bool], timeout: float | None) -> bool:
        """Wait until ``ready()`` or the run is over; True if ready."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.cv:
            while not ready():
                if self._over():
                    return False
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self.cv.wait(remaining if remaining is not None else 1.0)
            return True

    def _refuse(self, channel: AuthenticatedChannel, text: str) -> None:
        channel.send(Kind.ERR, encode(Refusal(text)))

    def _abort_reply(self, channel: AuthenticatedChannel) -> None:
        channel.send(Kind.ABORT, encode(Aborted(self.aborted or "the run has finished")))

    def _bad_frame(self, channel: AuthenticatedChannel, kind: Kind, exc: MessageError, peer: str) -> None:
        """A frame whose meta is not its kind's message: a request is refused with the sentence; a one-way frame
        (LOG, PROGRESS) is logged and dropped, never answered (an answer would be read as the reply to that
        connection's next request)."""
        if kind not in ONE_WAY:
            log.warning("sparkhvd driver service: refused a %s frame from %s because %s", kind.name, peer, exc)
            return self._refuse(channel, f"the driver service refused a {kind.name} frame because {exc}; the sender "
                                         "runs another sparkhvd version than the driver: install the same version on "
                                         "the driver and the executors.")
        with self.cv:
            self.bad_frames += 1
            count = self.bad_frames
        if count <= BAD_FRAMES_LOGGED:
            log.warning("sparkhvd driver service: refused a %s frame from %s because %s; it is dropped and the "
                        "connection stays open. The task that sent it runs another sparkhvd version than the driver: "
                        "install the same version on the driver and the executors.%s", kind.name, peer, exc,
                        " Further malformed one-way frames are counted, not logged." if count == BAD_FRAMES_LOGGED
                        else "")


class _DriverGreeting(Handshake):
    """The unauthenticated phase of a driver-service connection: our nonce out, then the first
    frame's header and header tag in, checked before anything else is read."""

    def __init__(self, service: DriverService, sock: socket.socket, peer: str):
        nonce = os.urandom(NONCE_BYTES)
        self.greeting = MAGIC + nonce
        self.need = _HEADER.size
        self._service = service
        self._peer = peer
        self._channel = AuthenticatedChannel(sock, service._secret, nonce, is_server=True)

    def check(self, data: bytes) -> int:
        header = data[:_HEADER.size]
        try:
            if len(data) == _HEADER.size:
                self._channel.check_header(header)  # magic and lengths, before waiting for the tag
                return _HEADER.size + TAG_BYTES
            self._channel.check_header_tag(header, data[_HEADER.size:])
        except ProtocolError as exc:
            raise Refused(str(exc)) from None
        self._service._admit(self._channel, header, self._peer)
        return 0

    def too_slow(self, timeout: float) -> str:
        return f"no authenticated frame within {timeout:g} s"

    def unserved(self, reason: str) -> bytes:
        """Tell a real client it was dropped unserved, so it can connect again (see ServiceClient)."""
        try:
            self._channel.send(Kind.ERR, encode(Refusal(unserved=True, message=(
                f"{self._service.tally.what} dropped this connection before its first request arrived ({reason}); "
                "the driver's log says whether its port is flooded with connections that never authenticate, and "
                "from where."))))
        except (OSError, ValueError):
            pass
        return b""
