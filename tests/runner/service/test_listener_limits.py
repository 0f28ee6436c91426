"""The limits on both listeners, one at a time: whole-handshake deadlines, eviction of the oldest
unauthenticated connection, the cap on authenticated connections, running out of descriptors,
and refusals counted and summarised instead of printed one by one."""

from __future__ import annotations

import logging
import re
import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch.distributed as dist

from sparkhvd._common import listener as _listener
from sparkhvd._common.client import ServiceClient, ServiceError
from sparkhvd._common.listener import RefusalTally
from sparkhvd._common.protocol import MAGIC, NONCE_BYTES, AuthenticatedChannel, Kind, PeerClosed, new_secret
from sparkhvd.collective._engine.mesh import Endpoint, MeshError
from sparkhvd.runner._service import service as _service
from sparkhvd.runner._service.service import DriverService

GREETING = len(MAGIC) + NONCE_BYTES


def _until(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.01)
    return predicate()


@pytest.fixture
def small_listeners(monkeypatch):
    """Listeners made from here on have 4 handshake slots."""
    monkeypatch.setattr(_listener, "default_max_pending", lambda: 4)


@pytest.mark.unit
def test_a_first_frame_trickled_a_byte_at_a_time_is_dropped_at_its_deadline(monkeypatch):
    monkeypatch.setattr(_service, "FIRST_FRAME_TIMEOUT_S", 0.5)
    svc = DriverService(np=1, secret=new_secret(), payload=b"")
    try:
        sock = socket.create_connection(svc.address)
        sock.recv(GREETING)
        start = time.monotonic()
        sent = 0
        try:
            for b in MAGIC + b"\0" * 20:  # 24 bytes, 0.1 s apart: each read is quick, the whole is not
                sock.send(bytes([b]))
                sent += 1
                time.sleep(0.1)
            sock.settimeout(5)
            closed = sock.recv(1) == b""
        except OSError:
            closed = True
        print(f"\ndropped after {time.monotonic() - start:.2f} s and {sent} of 24 trickled bytes")
        assert closed and sent < 24
        assert _until(lambda: svc.refusals)
        assert svc.refusals[0] == "127.0.0.1: no authenticated frame within 0.5 s"
    finally:
        svc.close()


@pytest.mark.unit
def test_a_real_client_slow_to_send_its_first_request_connects_again(monkeypatch):
    monkeypatch.setattr(_service, "FIRST_FRAME_TIMEOUT_S", 0.3)
    svc = DriverService(np=1, secret=new_secret(), payload=b"")
    try:
        client = ServiceClient(svc.address, svc._secret)
        assert _until(lambda: svc.tally.total == 1)  # dropped at the deadline, told why
        assert svc.refusals[0] == "127.0.0.1: no authenticated frame within 0.3 s"
        assert client.request(Kind.STORE_NUM_KEYS).meta["value"] == 0  # and served on a new connection
        client.close()
    finally:
        svc.close()


@pytest.mark.unit
def test_idle_connections_beyond_the_slots_evict_the_oldest_and_a_real_client_is_served(small_listeners):
    svc = DriverService(np=1, secret=new_secret(), payload=b"")
    idle = []
    try:
        for _ in range(20):
            idle.append(socket.create_connection(svc.address))
        client = ServiceClient(svc.address, svc._secret, connect_timeout=5)
        client.request(Kind.STORE_SET, {"key": "k"}, b"v")
        assert client.request(Kind.STORE_GET, {"key": "k", "timeout": 1}).blob == b"v"
        assert _until(lambda: svc.tally.total >= 16)
        assert svc._listener.pending <= 4
        assert svc.tally.counts() == {
            "evicted while authenticating: 4 connections were authenticating at once": svc.tally.total}
        client.close()
    finally:
        for s in idle:
            s.close()
        svc.close()


@pytest.mark.unit
def test_an_evicted_client_is_told_why_and_its_first_request_connects_again(small_listeners):
    svc = DriverService(np=1, secret=new_secret(), payload=b"")
    idle = []
    try:
        raw = socket.create_connection(svc.address)
        channel = AuthenticatedChannel.connect(raw, svc._secret)  # greeted; sends nothing yet
        client = ServiceClient(svc.address, svc._secret, connect_timeout=5)  # greeted; sends nothing yet
        for _ in range(4):  # takes every slot: both are evicted, oldest first
            idle.append(socket.create_connection(svc.address))
        assert _until(lambda: svc.tally.total >= 2)
        reply = channel.recv()
        assert reply.kind == Kind.ERR and reply.meta["unserved"] is True
        assert re.fullmatch(
            r"the sparkhvd driver service at 127\.0\.0\.1:\d+ dropped this connection before its first request "
            r"arrived \(evicted while authenticating: 4 connections were authenticating at once \(the listener's "
            r"limit\)\); the driver's log says whether its port is flooded with connections that never "
            r"authenticate, and from where\.", reply.meta["message"]), reply.meta["message"]
        client.request(Kind.STORE_SET, {"key": "k"}, b"v")  # told it was dropped unserved: connects again
        assert client.request(Kind.STORE_CHECK, {"keys": ["k"]}).meta["value"] is True
        client.close()
        channel.close()
    finally:
        for s in idle:
            s.close()
        svc.close()


@pytest.mark.unit
def test_authenticated_connections_are_capped_per_rank(monkeypatch):
    monkeypatch.setattr(_service, "CONNECTIONS_PER_RANK", 2)
    monkeypatch.setattr(_service, "CONNECTIONS_EXTRA", 1)
    svc = DriverService(np=1, secret=new_secret(), payload=b"")
    try:
        clients = [ServiceClient(svc.address, svc._secret) for _ in range(4)]
        for c in clients[:3]:
            c.request(Kind.STORE_NUM_KEYS)
        with pytest.raises(ServiceError, match=r"^the driver service already serves 3 authenticated connections, its "
                                               r"limit for np=1 \(2 per rank \+ 1\); close the ServiceClient "
                                               r"connections you open \(new_client\(\)\) when you are done with "
                                               r"them\.$"):
            clients[3].request(Kind.STORE_NUM_KEYS)
        clients[0].close()
        assert _until(lambda: len(svc._conns) == 2)
        late = ServiceClient(svc.address, svc._secret)
        assert late.request(Kind.STORE_NUM_KEYS).meta["value"] == 0
        for c in clients[1:] + [late]:
            c.close()
    finally:
        svc.close()


@pytest.mark.unit
def test_a_frame_of_a_kind_the_service_does_not_serve_ends_the_connection_and_is_counted():
    svc = DriverService(np=1, secret=new_secret(), payload=b"")
    try:
        client = ServiceClient(svc.address, svc._secret)
        with pytest.raises(PeerClosed):  # a server's frame sent to the server: no handler, no answer
            client.request(Kind.ASSIGN)
        client.close()
        assert list(svc.refusals) == ["127.0.0.1: unknown frame kind 11"]  # counted before the connection closed
        assert svc.tally.total == 1
    finally:
        svc.close()


@pytest.mark.unit
def test_a_client_that_is_never_greeted_or_never_connected_says_what_happened():
    silent = socket.create_server(("127.0.0.1", 0))  # takes connections, never greets them
    address = silent.getsockname()
    with pytest.raises(TimeoutError, match=r"^the sparkhvd driver service at 127\.0\.0\.1:\d+ took the connection but "
                                           r"did not greet it within 0\.3 s: the driver process is overloaded \(out of "
                                           r"file descriptors, threads or memory\) or stopped; its log says which\.$"):
        ServiceClient(address, new_secret(), connect_timeout=0.3)
    silent.close()

    full = socket.socket()  # a backlog of one, never accepted: the next connection is not answered
    full.bind(("127.0.0.1", 0))
    full.listen(0)
    queued = []
    with pytest.raises(TimeoutError, match=r"^could not connect to the sparkhvd driver service at 127\.0\.0\.1:\d+ "
                                           r"within 0\.3 s; the driver is unreachable from this host, or "
                                           r"overloaded\.$"):
        for _ in range(8):
            queued.append(socket.create_connection(full.getsockname(), timeout=1))
            ServiceClient(full.getsockname(), new_secret(), connect_timeout=0.3)
    for s in queued:
        s.close()
    full.close()


def test_running_out_of_descriptors_keeps_the_service_up_and_is_reported_once():
    code = textwrap.dedent("""
        import logging, os, resource, socket, time
        logging.basicConfig(format="LOG %(message)s")
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
        from sparkhvd.runner._service.service import DriverService
        from sparkhvd._common.client import ServiceClient
        from sparkhvd._common.protocol import Kind, new_secret
        svc = DriverService(np=1, secret=new_secret(), payload=b"")
        client = ServiceClient(svc.address, svc._secret)  # authenticated before the descriptors run out
        client.request(Kind.STORE_SET, {"key": "k"}, b"v")
        files = []
        while True:
            try:
                files.append(os.open(os.devnull, os.O_RDONLY))
            except OSError:
                break
        os.close(files.pop())
        late = socket.socket()  # the last descriptor: the service cannot accept it
        late.settimeout(5)
        late.connect(svc.address)
        time.sleep(1.0)  # out of descriptors for a while: the service keeps trying, and says so once
        print("STILL SERVING", client.request(Kind.STORE_GET, {"key": "k", "timeout": 1}).blob)
        for fd in files:
            os.close(fd)
        print("LATE GREETED", len(late.recv(20)))
        print("COUNTS", svc.tally.counts())
        svc.close()
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    print(out.stdout, out.stderr[-3000:])
    assert "STILL SERVING b'v'" in out.stdout and "LATE GREETED 20" in out.stdout, out.stderr[-3000:]
    lines = [line for line in out.stderr.splitlines() if line.startswith("LOG ")]
    assert len(lines) == 2, lines  # the first refusal, then the summary when it closed
    service = r"LOG the sparkhvd driver service at 127\.0\.0\.1:\d+ "
    assert re.fullmatch(service + r"refused a connection from an address not yet known: could not accept a "
                        r"connection: Too many open files; no connection in its handshake is left to drop, so the "
                        r"process's own files and connections hold every descriptor: raise the limit with "
                        r"`ulimit -n`\. Further refusals are counted and reported at most every 30 s, and "
                        r"summarised when it closes\.", lines[0]), lines[0]
    assert re.fullmatch(service + r"refused [\d,]+ connections while it served its run: [\d,]+ × could not accept a "
                        r"connection: Too many open files; from an address not yet known\.", lines[1]), lines[1]


@pytest.mark.unit
def test_refusals_are_grouped_logged_at_most_once_per_interval_and_summarised_once(caplog):
    log = logging.getLogger("test.tally")
    tally = RefusalTally("the test listener", log, interval=0.3)
    caplog.set_level("WARNING", logger="test.tally")
    start = time.monotonic()
    for i in range(3000):
        tally.add(f"bad frame magic {bytes([i % 256, 7, 8, 9])!r}", "10.0.0.1")
        tally.add(f"frame lengths meta={i} blob={i * 7} exceed the limits; refused before reading the body",
                  f"10.0.1.{i % 20}")
        if i % 1000 == 0:
            time.sleep(0.35)
    for i in range(30):
        tally.add(f"reason number {'x' * i}", "10.0.0.1")
    elapsed = time.monotonic() - start
    tally.close("during run abc")
    tally.close("during run abc")
    lines = [r.getMessage() for r in caplog.records if r.name == "test.tally"]
    print(f"\n{len(lines)} lines for {tally.total:,} refusals in {elapsed:.2f} s", *lines, sep="\n")
    assert lines[0] == ("the test listener refused a connection from 10.0.0.1: bad frame magic b'\\x00\\x07\\x08\\t'. "
                        "Further refusals are counted and reported at most every 0.3 s, and summarised when it closes.")
    assert 3 <= len(lines) <= 2 + elapsed / 0.3 + 1
    assert re.fullmatch(r"the test listener refused [\d,]+ more connections in the last [\d.]+ s \([\d,]+ in all\): .*",
                        lines[1])
    assert len(tally.recent) == 100 and tally.total == 6030
    assert lines[-1] == (
        "the test listener refused 6,030 connections during run abc: 3,000 × bad frame magic b'\\x00\\x07\\x08\\t'; "
        "3,000 × frame lengths meta=0 blob=0 exceed the limits; 16 × other reasons; 1 × reason number; "
        "1 × reason number x; 1 × reason number xx; 1 × reason number xxx; 1 × reason number xxxx; "
        "1 × reason number xxxxx; 1 × reason number xxxxxx; 1 × reason number xxxxxxx; 1 × reason number xxxxxxxx; "
        "1 × reason number xxxxxxxxx; 1 × reason number xxxxxxxxxx; 1 × reason number xxxxxxxxxxx; "
        "1 × reason number xxxxxxxxxxxx; 1 × reason number xxxxxxxxxxxxx; "
        "from 10.0.0.1, 10.0.1.0, 10.0.1.1, 10.0.1.2, 10.0.1.3, 10.0.1.4, 10.0.1.5, 10.0.1.6 and 1,950 connections "
        "from other addresses.")


def _endpoints(n, timeout=30.0):
    store = dist.HashStore()
    return store, [Endpoint(rank=r, host="127.0.0.1", key=b"k" * 32, store=store, prefix="c/", timeout=timeout)
                   for r in range(n)]


def _link(ep, members):
    """This rank's links for one set, as the engine gets them: peer -> socket."""
    return ep.star(0, members, "test op")


@pytest.mark.unit
def test_a_flooded_control_port_still_lets_the_real_peer_in(small_listeners):
    store, eps = _endpoints(2)
    host, port = store.get("c/0").decode().rsplit(":", 1)
    idle = [socket.create_connection((host, int(port))) for _ in range(40)]  # ten times its slots
    results = {}
    threads = [threading.Thread(target=lambda r=r: results.setdefault(r, _link(eps[r], [0, 1]))) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert set(results) == {0, 1}
    assert list(results[0]) == [1] and list(results[1]) == [0]  # each got its link to the other
    counts = eps[0]._tally.counts()
    evicted = counts.pop("evicted while authenticating: 4 connections were authenticating at once")
    assert evicted == 40 + 1 - 4  # the idle ones, and one more to make room for the real peer
    assert set(counts) <= {"failed during its handshake"}, counts  # the idle ones' close, as the test ends
    for s in idle:
        s.close()
    for links in results.values():
        for sock in links.values():
            sock.close()
    for ep in eps:
        ep.close()


@pytest.mark.unit
def test_a_listener_that_always_turns_the_link_away_is_named_as_flooded_not_failed():
    server = socket.create_server(("127.0.0.1", 0))  # answers every handshake with "full: dropped"
    stop = threading.Event()

    def turn_away():
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                continue
            with conn:
                conn.settimeout(2)
                conn.sendall(b"c" * 16)
                try:
                    conn.recv(48)
                    conn.sendall(b"B")
                except OSError:
                    pass

    thread = threading.Thread(target=turn_away, daemon=True)
    thread.start()
    store = dist.HashStore()
    store.set("c/0", f"127.0.0.1:{server.getsockname()[1]}")
    ep = Endpoint(rank=1, host="127.0.0.1", key=b"k" * 32, store=store, prefix="c/", timeout=1.0)
    try:
        with pytest.raises(MeshError, match=r"^could not make the control link to rank 0 for test op: its listener at "
                                            r"127\.0\.0\.1:\d+ turned away or did not answer all \d+ attempts in \d+ s "
                                            r"\(the last: the listener was full and dropped this connection to make "
                                            r"room\)\. Rank 0 may well be healthy: something is flooding that port "
                                            r"with connections that never authenticate \(its output counts them\), or "
                                            r"its process is out of file descriptors; stop what connects to it, or "
                                            r"raise `ulimit -n` there\.$"):
            _link(ep, [0, 1])
    finally:
        stop.set()
        thread.join(5)
        server.close()
        ep.close()


def test_a_rank_out_of_descriptors_says_so_instead_of_blaming_its_peer():
    code = textwrap.dedent("""
        import os, resource
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
        from sparkhvd.collective._engine.mesh import Endpoint, MeshError

        class Store(dict):
            def set(self, key, value):
                self[key] = value.encode() if isinstance(value, str) else value

            def get(self, key):
                return self[key]

        store = Store()
        eps = [Endpoint(rank=r, host="127.0.0.1", key=b"k" * 32, store=store, prefix="c/", timeout=2.0)
               for r in range(2)]
        files = []
        while True:
            try:
                files.append(os.open(os.devnull, os.O_RDONLY))
            except OSError:
                break
        try:
            eps[1].star(0, [0, 1], "allreduce.w")  # rank 1 dials rank 0
        except MeshError as exc:
            print("ERROR", exc)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert re.search(r"^ERROR rank 1 could not open its control link to rank 0 for allreduce\.w: this process is out "
                     r"of file descriptors \(\[Errno 24\] Too many open files[^)]*\); raise `ulimit -n` where the ranks "
                     r"run, or close the files and sockets the training function keeps open\.$", out.stdout, re.M), \
        out.stdout + out.stderr[-3000:]
