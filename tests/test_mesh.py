"""The control links (collective/_mesh.py): real sockets on 127.0.0.1 between endpoints in threads,
plus hostile peers, a peer that leaves, a peer that never comes, and an oversized frame."""

from __future__ import annotations

import hashlib
import hmac
import socket
import struct
import threading
import time

import pytest
import torch.distributed as dist

from sparkhvd.collective._mesh import _HELLO, HEADER_BYTES, Endpoint, MeshError

KEY = b"k" * 32


def _endpoints(n, timeout=30.0, key=KEY):
    store = dist.HashStore()
    return store, [Endpoint(rank=r, host="127.0.0.1", key=key, store=store, prefix="c/", timeout=timeout)
                   for r in range(n)]


def _header(length, tag=0):
    return struct.pack("<11q", tag, *([0] * 9), length)


def _on_threads(fns):
    results, errors = [None] * len(fns), [None] * len(fns)

    def run(i):
        try:
            results[i] = fns[i]()
        except Exception as exc:  # noqa: BLE001 - handed to the test
            errors[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "an exchange hung"
    return results, errors


def _link_up(eps):
    """One exchange between two endpoints, which makes their links."""
    _on_threads([lambda: _gather(eps[0], [0, 1], b"a"), lambda: _gather(eps[1], [0, 1], b"b")])


def _gather(endpoint, ranks, payload, max_payload=1 << 20, link=0):
    mesh = endpoint.mesh(link, ranks, "test op")
    return mesh.allgather(_header(len(payload), endpoint.rank), payload, max_payload, "test op",
                          lambda frames: [(struct.unpack("<11q", h)[0], bytes(p)) for h, p in frames])


def test_three_ranks_exchange_frames_of_every_size_and_sets_interleave():
    _, eps = _endpoints(3)
    sizes = [0, 5, 300_000, 3_000_000]  # bigger than a socket buffer: both sides must send and read at once

    def rank(r):
        out = []
        for size in sizes:
            out.append(_gather(eps[r], [0, 1, 2], bytes([r]) * size, max_payload=1 << 22))
        if r > 0:  # a second set on its own links, made after the first
            out.append(_gather(eps[r], [1, 2], b"pair%d" % r, link=7))
        return out

    results, errors = _on_threads([lambda r=r: rank(r) for r in range(3)])
    assert errors == [None, None, None]
    for r in range(3):
        for i, size in enumerate(sizes):
            assert results[r][i] == [(q, bytes([q]) * size) for q in range(3)]
    assert results[1][-1] == results[2][-1] == [(1, b"pair1"), (2, b"pair2")]
    for ep in eps:
        ep.close()


def test_a_connection_without_the_key_is_refused_and_the_real_peer_still_gets_in():
    store, eps = _endpoints(2)
    host, port = store.get("c/0").decode().rsplit(":", 1)
    intruder = socket.create_connection((host, int(port)))

    def rank0():
        return _gather(eps[0], [0, 1], b"zero")

    def rank1():
        challenge = intruder.recv(16)
        hello = _HELLO.pack(0, 1)  # claims to be rank 1 on the same link, without the key
        intruder.sendall(hello + hmac.new(b"wrong" * 7, challenge + hello, hashlib.sha256).digest())
        assert intruder.recv(1) == b""  # refused: closed
        return _gather(eps[1], [0, 1], b"one")

    results, errors = _on_threads([rank0, rank1])
    assert errors == [None, None]
    assert results[0] == results[1] == [(0, b"zero"), (1, b"one")]
    intruder.close()
    for ep in eps:
        ep.close()


def test_an_idle_connection_holds_up_nobody_and_a_late_rank_is_still_let_in(monkeypatch):
    from sparkhvd.collective import _mesh

    store, eps = _endpoints(2, timeout=10.0)
    host, port = store.get("c/0").decode().rsplit(":", 1)
    idle = socket.create_connection((host, int(port)))  # connects first and never answers its challenge
    monkeypatch.setattr(_mesh, "_HANDSHAKE_TIMEOUT", 0.5)  # rank 1 must be greeted well before rank 0 arrives

    def rank0():
        time.sleep(2)
        return _gather(eps[0], [0, 1], b"late")

    start = time.monotonic()
    results, errors = _on_threads([rank0, lambda: _gather(eps[1], [0, 1], b"early")])
    assert errors == [None, None]
    assert results[0] == results[1] == [(0, b"late"), (1, b"early")]
    assert time.monotonic() - start < 8
    idle.close()
    for ep in eps:
        ep.close()


def test_a_peer_that_leaves_fails_the_others_at_once_and_for_good():
    _, eps = _endpoints(2)
    _link_up(eps)
    eps[1].close()
    start = time.monotonic()
    with pytest.raises(MeshError, match=r"^rank 1 closed its control link during test op: it has exited or "
                                        r"failed; its own error is in its output\.$"):
        _gather(eps[0], [0, 1], b"a")
    assert time.monotonic() - start < 10
    with pytest.raises(MeshError, match=r"^test op cannot run: the control links broke in an earlier collective "
                                        r"\(rank 1 closed .*\); restart the job\.$"):
        _gather(eps[0], [0, 1], b"a")
    eps[0].close()


def test_a_peer_that_never_calls_is_named_when_the_timeout_ends():
    _, eps = _endpoints(2, timeout=1.0)
    _link_up(eps)
    with pytest.raises(MeshError, match=r"^test op waited 1 s for ranks 1, which never called it; every rank of a "
                                        r"set must call the same collectives in the same order\.$"):
        _gather(eps[0], [0, 1], b"a")
    for ep in eps:
        ep.close()


def test_a_peer_that_never_connects_is_named():
    _, eps = _endpoints(2, timeout=1.0)
    with pytest.raises(MeshError, match=r"^ranks 1 did not connect within 1 s for test op; they never reached it, "
                                        r"or cannot reach this rank's control address \('127\.0\.0\.1', \d+\)\.$"):
        _gather(eps[0], [0, 1], b"a")
    for ep in eps:
        ep.close()


def test_an_oversized_frame_is_refused_before_its_body_is_read():
    _, eps = _endpoints(2)

    def rank1():  # announces 2 GiB
        mesh = eps[1].mesh(0, [0, 1], "test op")
        sock = mesh._links[0]
        sock.setblocking(True)
        sock.sendall(_header(1 << 31))

    results, errors = _on_threads([lambda: _gather(eps[0], [0, 1], b"a", max_payload=1024), rank1])
    assert isinstance(errors[0], MeshError)
    assert str(errors[0]) == ("rank 1 sent a control frame with a 2147483648-byte payload during test op, over the "
                              "limit of 1024; every rank must run the same sparkhvd version.")
    for ep in eps:
        ep.close()


def test_header_layout():
    assert HEADER_BYTES == len(_header(0)) == 88


def test_an_exchange_interrupted_midway_leaves_the_links_unusable():
    import signal

    _, eps = _endpoints(2)
    _link_up(eps)

    class Interrupted(Exception):
        pass

    def interrupt(*_):
        raise Interrupted("stop")

    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.3)
        with pytest.raises(Interrupted):
            _gather(eps[0], [0, 1], b"a" * 100)  # rank 1 never answers: interrupted while waiting
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    with pytest.raises(MeshError, match=r"^test op cannot run: the control links broke in an earlier collective "
                                        r"\(stop\); restart the job\.$"):
        _gather(eps[0], [0, 1], b"a")
    for ep in eps:
        ep.close()


def test_shutdown_wakes_a_rank_waiting_for_its_peers_and_removed_sets_refuse_late_links():
    store, eps = _endpoints(2, timeout=30.0)
    threading.Timer(0.5, eps[0].close).start()
    start = time.monotonic()
    with pytest.raises(MeshError, match=r"^test op cannot run: hvd\.shutdown\(\) closed this rank's control "
                                        r"links\.$"):
        _gather(eps[0], [0, 1], b"a")  # rank 1 never comes
    assert time.monotonic() - start < 10
    _, eps2 = _endpoints(2)
    eps2[0].forget(5)  # rank 0 removed set 5; rank 1 then links up for it and is told so at once
    with pytest.raises(MeshError, match=r"^rank 0 refused the control link for late: that process set was removed "
                                        r"there, or hvd\.shutdown\(\) ran there; every rank must create and remove "
                                        r"process sets together\.$"):
        eps2[1].mesh(5, [0, 1], "late")
    assert not eps2[0]._arrived
    for ep in eps + eps2:
        ep.close()


def test_a_forked_child_closing_its_copy_leaves_the_parent_listening():
    import os

    _, eps = _endpoints(2)
    pid = os.fork()
    if pid == 0:  # the child, e.g. a DataLoader worker running an atexit hvd.shutdown()
        eps[0].close()
        os._exit(0)
    os.waitpid(pid, 0)
    results, errors = _on_threads([lambda: _gather(eps[0], [0, 1], b"a"), lambda: _gather(eps[1], [0, 1], b"b")])
    assert errors == [None, None] and results[0] == [(0, b"a"), (1, b"b")]
    for ep in eps:
        ep.close()


def test_a_peer_that_never_answers_the_connect_is_named_unreachable_not_flooded(monkeypatch):
    """No SYN-ACK (a full accept queue here; a cut path or a dead host in life): one try, a true message."""
    from sparkhvd.collective import _mesh

    monkeypatch.setattr(_mesh, "_HANDSHAKE_TIMEOUT", 1.0)
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(0)  # never accepts: once its queue is full, new SYNs go unanswered
    fillers = []
    try:
        for _ in range(4):
            s = socket.socket()
            s.setblocking(False)
            s.connect_ex(silent.getsockname())
            fillers.append(s)
        time.sleep(0.2)
        store, (ep,) = _endpoints(1)
        store.set("c/9", "%s:%d" % silent.getsockname())
        started = time.monotonic()
        with pytest.raises(MeshError, match=r"could not reach rank 9's control address 127\.0\.0\.1:\d+ for test op "
                                            r"within 1 s; its host is down, or the network between the two hosts "
                                            r"drops the connection \(routes, firewalls\)\."):
            ep._dial(9, 0, "test op", time.monotonic() + 60)
        print(f"named unreachable after {time.monotonic() - started:.1f} s")
        ep.close()
    finally:
        for s in fillers:
            s.close()
        silent.close()
