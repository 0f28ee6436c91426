"""The driver service: one authenticated TCP server per run.

It registers tasks and hands out ranks, serves the pickled function, serves the rendezvous
store the process groups are built from (``_common/rendezvous.py``; a blocked get or wait
ends when the run does), receives log lines, results and errors, and tells every worker to
stop when the run is aborted. It decides nothing about the run's outcome: ``_run.py`` watches
its state and decides.

Until a connection's first frame header verifies under the run's secret, it costs one
descriptor and a few bytes, never a thread: one thread reads every such handshake under a whole
deadline (``FIRST_FRAME_TIMEOUT_S``), evicting the oldest when its slots are full, and counts
what it refuses (``_common/listener.py``). Authenticated connections, a thread each, are
capped at ``CONNECTIONS_PER_RANK`` per rank plus ``CONNECTIONS_EXTRA``.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from .._common.commits import HostUpdateResult
from .._common.listener import GuardedListener, Handshake, RefusalTally, Refused
from .._common.protocol import (
    _HEADER,
    MAGIC,
    NONCE_BYTES,
    TAG_BYTES,
    AuthenticatedChannel,
    Kind,
    Message,
    PeerClosed,
    ProtocolError,
    check_log_meta,
)
from .._common.rendezvous import RendezvousStore, StoreClosed, StoreTimeout
from .._common.topology import Placement, assign_ranks, host_gpus
from ._commits import CommitStore

log = logging.getLogger("sparkhvd.service")

LogSink = Callable[[int, str, list, "str | None"], None]  # (rank, stream, lines, progress): runner/_logs.py
FIRST_FRAME_TIMEOUT_S = 30.0  # a connection's first frame header must be authenticated this long after it connects
# Authenticated connections at once: each rank holds about five (its task agent with the log pumps,
# the worker, the abort watch, the rendezvous store, the heartbeat); the rest is headroom for
# hvd.init() after hvd.shutdown() and for user code that opens its own clients.
CONNECTIONS_PER_RANK = 32
CONNECTIONS_EXTRA = 64
BAD_LOGS_LOGGED = 5  # malformed LOG frames logged per run; the rest are counted in bad_logs

_STORE_KINDS = (Kind.STORE_SET, Kind.STORE_GET, Kind.STORE_ADD, Kind.STORE_CHECK, Kind.STORE_WAIT,
                Kind.STORE_CAS, Kind.STORE_DELETE, Kind.STORE_NUM_KEYS)


@dataclass
class Registration:
    """What a task told the driver about itself."""

    task: int
    host: str  # the hostname, for messages
    pid: int
    gpus: list  # Spark's GPU addresses for the task
    peer: str  # the address the driver saw the task's connection come from
    host_id: str = ""  # what groups ranks by host (runner/_host.py); the hostname where absent
    devices: list = field(default_factory=list)  # its GPUs as the host names them: ``gpus`` mapped by the agent


@dataclass
class Failure:
    """A rank's exception, as its worker reported it."""

    rank: int
    type: str
    message: str
    traceback: str
    pickled: bytes = b""
    arrived: float = field(default_factory=time.monotonic)


class DriverService:
    """Serves one run of ``np`` tasks. Thread-safe; every state change notifies ``cv``."""

    def __init__(self, *, np: int, secret: bytes, payload: bytes, bind_host: str = "127.0.0.1",
                 on_log: LogSink | None = None, run_id: str | None = None, commits: CommitStore | None = None,
                 on_restore: Callable[[dict | None], None] | None = None, attempt: int = 0):
        self.np = np
        self.run_id = run_id
        self._secret = secret
        self._payload = payload
        self._on_log = on_log or (lambda rank, stream, lines, progress: None)
        self.bad_logs = 0  # LOG frames refused as malformed (the first few are logged)
        self.cv = threading.Condition()
        self.registrations: dict[int, Registration] = {}
        self.placements: list[Placement] | None = None
        self.gpu_lists: list[list[str]] = []  # task -> its CUDA_VISIBLE_DEVICES (_common/topology.py: host_gpus)
        self.placed_at: float | None = None  # when every task had registered and the ranks were assigned
        self.results: dict[int, bytes] = {}
        self.failures: list[Failure] = []
        self.exits: dict[int, int] = {}
        self.progress: dict[int, tuple] = {}  # rank -> (its latest heartbeat's meta, when it arrived)
        self.aborted: str | None = None
        self.hosts_updated: list | None = None  # [timestamp, HostUpdateResult]: told to rank 0 with each commit
        self.finished = False
        self.commits = commits if commits is not None else CommitStore(run_id=run_id or "")
        self._on_restore = on_restore  # called once, at rank 0's first RESTORE, with the commit's meta
        self.attempt = attempt  # which launch of the run this service serves (0, then one more per relaunch)
        self._restored: set[str] = set()  # states whose commit this attempt has asked for
        self.store = RendezvousStore(self.cv, self._over)  # the ranks' c10d rendezvous, served as STORE_*
        self._conns: set[socket.socket] = set()  # authenticated connections, each served by a thread
        self.max_connections = CONNECTIONS_PER_RANK * np + CONNECTIONS_EXTRA
        server = socket.create_server((bind_host, 0), backlog=128)
        self.address = (bind_host, server.getsockname()[1])
        self.tally = RefusalTally(f"the sparkhvd driver service at {bind_host}:{self.address[1]}", log)
        self.refusals = self.tally.recent  # the last refusals in full ("peer: reason"), newest last
        self._handlers = {
            Kind.REGISTER: self._register, Kind.FETCH: self._fetch, Kind.WATCH: self._watch,
            Kind.LOG: self._log, Kind.RESULT: self._result, Kind.ERROR: self._error,
            Kind.EXIT: self._exit, Kind.PROGRESS: self._progress,
            Kind.COMMIT: self._commit, Kind.RESTORE: self._restore,
            **{kind: self._store_request for kind in _STORE_KINDS},
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
                    handler(channel, msg, peer)
                except (ProtocolError, OSError):
                    raise
                except Exception as exc:  # noqa: BLE001 - a malformed request from an authenticated peer
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
        channel.send(Kind.ERR, {"message": text})

    def _abort_reply(self, channel: AuthenticatedChannel) -> None:
        channel.send(Kind.ABORT, {"reason": self.aborted or "the run has finished"})

    # ---- registration, function, watch ---------------------------------------------------

    def _register(self, channel: AuthenticatedChannel, msg: Message, peer: str) -> None:
        task = msg.meta.get("task")
        refusal = None
        with self.cv:
            if not isinstance(task, int) or not 0 <= task < self.np:
                refusal = f"task index {task!r} is outside 0..{self.np - 1}"
            elif task in self.registrations:
                refusal = f"task {task} registered twice; a retried Spark task cannot join a run that has started"
            else:
                self._add_registration(task, msg, peer)
        if refusal is not None:
            return self._refuse(channel, refusal)  # never send while holding cv
        if not self._wait(lambda: self.placements is not None, None):
            return self._abort_reply(channel)
        # The placement (what the rank process reads back as a Placement) and the task's GPU list beside it.
        channel.send(Kind.ASSIGN, {**self.placements[task].as_dict(), "host_gpus": self.gpu_lists[task]})

    def _add_registration(self, task: int, msg: Message, peer: str) -> None:
        """Record a task (cv held); once all have registered, assign the ranks."""
        self.registrations[task] = Registration(
            task=task, host=str(msg.meta.get("host")), pid=int(msg.meta.get("pid", 0)),
            gpus=list(msg.meta.get("gpus") or []), peer=peer,
            host_id=str(msg.meta.get("host_id") or msg.meta.get("host")),
            devices=[str(d) for d in msg.meta.get("devices") or []])
        if len(self.registrations) == self.np:
            hosts = [self.registrations[t].host_id for t in range(self.np)]
            self.placements, self.gpu_lists = host_gpus(assign_ranks(hosts), hosts,
                                                        [self.registrations[t].devices for t in range(self.np)])
            self.placed_at = time.monotonic()
        self.cv.notify_all()

    def _fetch(self, channel: AuthenticatedChannel, msg: Message, peer: str) -> None:
        channel.send(Kind.OK, {}, self._payload)

    def _watch(self, channel: AuthenticatedChannel, msg: Message, peer: str) -> None:
        with self.cv:
            while not self._over():
                self.cv.wait()
            aborted = self.aborted
        if aborted is not None:
            channel.send(Kind.ABORT, {"reason": aborted})

    # ---- logs, results, errors -----------------------------------------------------------

    def _log(self, channel: AuthenticatedChannel, msg: Message, peer: str) -> None:
        """Lines of a rank's output (one-way, so a malformed frame is logged and dropped, never answered:
        an answer would be read as the reply to that connection's next request)."""
        try:
            rank, stream, lines, progress = check_log_meta(msg.meta, self.np)
        except ValueError as exc:
            with self.cv:
                self.bad_logs += 1
                count = self.bad_logs
            if count <= BAD_LOGS_LOGGED:
                log.warning("sparkhvd driver service: refused a LOG frame from %s because %s; its lines are dropped "
                            "and the connection stays open. The task that sent it runs another sparkhvd version "
                            "than the driver: install the same version on the driver and the executors.%s", peer,
                            exc, " Further malformed LOG frames are counted, not logged." if count == BAD_LOGS_LOGGED
                            else "")
            return
        self._on_log(rank, stream, lines, progress)

    def _result(self, channel: AuthenticatedChannel, msg: Message, peer: str) -> None:
        with self.cv:
            self.results[int(msg.meta["rank"])] = msg.blob
            self.cv.notify_all()
        channel.send(Kind.OK)

    def _error(self, channel: AuthenticatedChannel, msg: Message, peer: str) -> None:
        meta = msg.meta
        with self.cv:
            self.failures.append(Failure(rank=int(meta["rank"]), type=str(meta.get("type")),
                                         message=str(meta.get("message")),
                                         traceback=str(meta.get("traceback", "")), pickled=msg.blob))
            self.cv.notify_all()
        channel.send(Kind.OK)

    def _progress(self, channel: AuthenticatedChannel, msg: Message, peer: str) -> None:
        """A rank's heartbeat (one-way): kept for the stall report, read by ``_stall.py``."""
        rank = int(msg.meta["rank"])
        with self.cv:
            if 0 <= rank < self.np:
                self.progress[rank] = (msg.meta, time.monotonic())

    def _exit(self, channel: AuthenticatedChannel, msg: Message, peer: str) -> None:
        with self.cv:
            self.exits[int(msg.meta["rank"])] = int(msg.meta["code"])
            self.cv.notify_all()
        channel.send(Kind.OK)

    # ---- elastic commits (runner/_commits.py) ------------------------------------------------

    def announce_growth(self) -> None:
        """Tell rank 0, in the answer to its next commit, that the run can have more ranks (Horovod's hosts added)."""
        with self.cv:
            if self.hosts_updated is None:
                self.hosts_updated = [time.time(), int(HostUpdateResult.added)]

    def _commit(self, channel: AuthenticatedChannel, msg: Message, peer: str) -> None:
        key = str(msg.meta["key"])
        with self.cv:
            if self.finished:  # a frame received as the attempt ended: the next attempt's commits must not meet it
                return self._refuse(channel, f"commit {msg.meta.get('seq')} of {key} arrived after this attempt had "
                                             "ended, so it was not kept.")
            # A restarted attempt's commit made before it loaded the previous one (a commit before hvd.elastic.run)
            # must not replace it: the next RESTORE would resume from the start.
            stale = key not in self._restored and self.commits.attempt_of(key) not in (None, self.attempt)
            update = self.hosts_updated
        if stale:
            return channel.send(Kind.OK, {"kept": False})
        try:
            kept = self.commits.put(msg.meta, msg.blob, attempt=self.attempt)
        except OSError as exc:
            log.warning("sparkhvd driver service: could not keep commit %s of %s: %s", msg.meta.get("seq"), key, exc)
            return self._refuse(channel, f"the driver could not keep commit {msg.meta.get('seq')} of {key} "
                                         f"({len(msg.blob)} bytes): {exc}; free space there, or pass "
                                         "HorovodRunner(commit_dir=URL) to keep commits on shared storage.")
        channel.send(Kind.OK, {"kept": kept, **({"hosts_updated": update} if update else {})})

    def _restore(self, channel: AuthenticatedChannel, msg: Message, peer: str) -> None:
        with self.cv:
            self._restored.add(str(msg.meta["key"]))
        commit = self.commits.get(str(msg.meta["key"]))
        if msg.meta.get("data", True):
            on_restore, self._on_restore = self._on_restore, None
            if on_restore is not None:
                on_restore(None if commit is None else commit.meta)
        if commit is None:
            return channel.send(Kind.OK, {"found": False})
        channel.send(Kind.OK, {"found": True, "commit": commit.meta},
                     commit.data() if msg.meta.get("data", True) else b"")

    # ---- the rendezvous store (_common/rendezvous.py) over this service's frames --------

    def _store_request(self, channel: AuthenticatedChannel, msg: Message, peer: str) -> None:
        """Answer a STORE_* request from ``self.store``: OK, or ABORT if the run ends first."""
        try:
            meta, blob = _call_store(self.store, msg)
        except StoreClosed:
            return self._abort_reply(channel)
        except StoreTimeout as exc:
            return self._refuse(channel, str(exc))
        channel.send(Kind.OK, meta, blob)


def _call_store(store: RendezvousStore, msg: Message) -> tuple[dict, bytes]:
    """Decode a STORE_* request, call the store, and return the OK reply's meta and blob."""
    meta = msg.meta
    if msg.kind == Kind.STORE_SET:
        store.set(meta["key"], msg.blob)
        return {}, b""
    if msg.kind == Kind.STORE_GET:
        return {}, store.get(meta["key"], meta.get("timeout"))
    if msg.kind == Kind.STORE_ADD:
        return {"value": store.add(meta["key"], int(meta["amount"]))}, b""
    if msg.kind == Kind.STORE_CHECK:
        return {"value": store.check(meta["keys"])}, b""
    if msg.kind == Kind.STORE_WAIT:
        store.wait(meta["keys"], meta.get("timeout"))
        return {}, b""
    if msg.kind == Kind.STORE_CAS:
        n = int(meta["expected_len"])
        return {}, store.compare_set(meta["key"], msg.blob[:n], msg.blob[n:])
    if msg.kind == Kind.STORE_DELETE:
        return {"value": store.delete_key(meta["key"])}, b""
    return {"value": store.num_keys()}, b""  # STORE_NUM_KEYS, the last of _STORE_KINDS


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
            self._channel.send(Kind.ERR, {"unserved": True, "message": (
                f"{self._service.tally.what} dropped this connection before its first request arrived ({reason}); "
                "the driver's log says whether its port is flooded with connections that never authenticate, and "
                "from where.")})
        except (OSError, ValueError):
            pass
        return b""
