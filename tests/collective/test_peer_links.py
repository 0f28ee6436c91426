"""The control links as the engine makes and uses them: ``Endpoint.star`` (collective/_engine/mesh.py) makes
them, ``PeerChannel`` (collective/_engine/channel.py) frames them. Real sockets on 127.0.0.1 between endpoints in
threads, plus hostile peers, a peer that leaves, a peer that never comes, and frames over the limits."""

from __future__ import annotations

import hashlib
import hmac
import re
import select
import selectors
import socket
import struct
import threading
import time

import pytest
import torch.distributed as dist

from sparkhvd.collective._engine.channel import FRAME, MAX_META, PeerChannel
from sparkhvd.collective._engine.mesh import _HELLO, Endpoint, MeshError

KEY = b"k" * 32


def _endpoints(n, timeout=30.0, key=KEY):
    store = dist.HashStore()
    return store, [Endpoint(rank=r, host="127.0.0.1", key=key, store=store, prefix="c/", timeout=timeout)
                   for r in range(n)]


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
    assert not any(t.is_alive() for t in threads), "a rank hung"
    return results, errors


def _star(eps, members, link=0, what="test op"):
    """Every member's ``star`` links for one set, made together as the engine's ranks do: peer -> socket."""
    results, errors = _on_threads([lambda r=r: eps[r].star(link, members, what) for r in members])
    assert errors == [None] * len(members)
    return dict(zip(members, results))


def _pump(channels, want, timeout=30.0):
    """Send what the channels have queued and read until each has handed out ``want[peer]`` frames:
    peer -> [(meta, payload bytes)], in arrival order."""
    got = {peer: [] for peer in channels}
    deadline = time.monotonic() + timeout
    with selectors.DefaultSelector() as selector:
        for peer, channel in channels.items():
            selector.register(channel.sock, selectors.EVENT_READ, peer)
        while any(len(got[p]) < want[p] for p in channels) or any(c.pending() for c in channels.values()):
            remaining = deadline - time.monotonic()
            assert remaining > 0, f"frames missing after {timeout} s: got {[(p, len(f)) for p, f in got.items()]}"
            for peer, channel in channels.items():
                selector.modify(channel.sock, selectors.EVENT_READ | (selectors.EVENT_WRITE if channel.pending()
                                                                      else 0), peer)
            selector.select(min(remaining, 1.0))
            for peer, channel in channels.items():
                channel.flush()
                got[peer].extend((meta, bytes(payload)) for meta, payload in channel.receive())
    return got


def _say_hello(links, a, b):
    """One frame each way on the link between ranks ``a`` and ``b``: proves it carries frames."""
    ends = {a: PeerChannel(links[a][b], b, 1024), b: PeerChannel(links[b][a], a, 1024)}
    for me, channel in ends.items():
        channel.send({"from": me}, b"hi %d" % me)
    got = {me: _pump({channel.peer: channel}, {channel.peer: 1})[channel.peer] for me, channel in ends.items()}
    assert got == {a: [({"from": b}, b"hi %d" % b)], b: [({"from": a}, b"hi %d" % a)]}
    return ends


def _close(*link_maps):
    for links in link_maps:
        for sock in links.values():
            sock.close()


def _raw(sock):
    """The socket a test writes hostile bytes on, blocking."""
    sock.setblocking(True)
    return sock


@pytest.mark.unit
def test_a_star_links_the_coordinator_to_every_member_and_carries_frames_of_every_size():
    _, eps = _endpoints(3)
    sizes = [0, 5, 300_000, 3_000_000]  # bigger than a socket buffer: both ends must send and read at once
    channels = []

    def rank(r):
        links = eps[r].star(0, [0, 1, 2], "test op")
        mine = {peer: PeerChannel(sock, peer, max_payload=1 << 22) for peer, sock in links.items()}
        channels.extend(mine.values())
        for channel in mine.values():
            for size in sizes:
                channel.send({"from": r, "size": size}, bytes([r]) * size)
        got = _pump(mine, dict.fromkeys(mine, len(sizes)))
        pair = None
        if r > 0:  # a second set on its own links, made after the first; rank 1 coordinates it
            pair_links = eps[r].star(7, [1, 2], "pair")
            pair = {peer: PeerChannel(sock, peer, 1024) for peer, sock in pair_links.items()}
            channels.extend(pair.values())
            for channel in pair.values():
                channel.send({"pair": r}, b"pair%d" % r)
            pair = _pump(pair, dict.fromkeys(pair, 1))
        return got, pair

    results, errors = _on_threads([lambda r=r: rank(r) for r in range(3)])
    assert errors == [None, None, None]
    got = [result[0] for result in results]
    assert sorted(got[0]) == [1, 2] and list(got[1]) == [0] and list(got[2]) == [0]  # no worker-to-worker link
    for r in range(3):
        for peer, frames in got[r].items():
            assert [meta for meta, _ in frames] == [{"from": peer, "size": size} for size in sizes]
            assert [payload for _, payload in frames] == [bytes([peer]) * size for size in sizes]
    assert results[0][1] is None
    assert results[1][1] == {2: [({"pair": 2}, b"pair2")]} and results[2][1] == {1: [({"pair": 1}, b"pair1")]}
    for channel in channels:
        channel.close()
    for ep in eps:
        ep.close()


@pytest.mark.unit
def test_a_connection_without_the_key_is_refused_and_the_real_peer_still_gets_in():
    store, eps = _endpoints(2)
    host, port = store.get("c/0").decode().rsplit(":", 1)
    intruder = socket.create_connection((host, int(port)))

    def rank1():
        challenge = intruder.recv(16)
        hello = _HELLO.pack(0, 1)  # claims to be rank 1 on the same link, without the key
        intruder.sendall(hello + hmac.new(b"wrong" * 7, challenge + hello, hashlib.sha256).digest())
        assert intruder.recv(1) == b""  # refused: closed
        return eps[1].star(0, [0, 1], "test op")

    results, errors = _on_threads([lambda: eps[0].star(0, [0, 1], "test op"), rank1])
    assert errors == [None, None]
    links = dict(enumerate(results))
    _say_hello(links, 0, 1)  # the link rank 0 took is the real rank 1's, not the intruder's
    assert eps[0]._tally.counts() == {"wrong key: the answer to the challenge is not an HMAC under this run's key": 1}
    intruder.close()
    _close(*links.values())
    for ep in eps:
        ep.close()


@pytest.mark.unit
def test_an_idle_connection_holds_up_nobody_and_a_late_rank_is_still_let_in(monkeypatch):
    from sparkhvd.collective._engine import mesh as _mesh

    store, eps = _endpoints(2, timeout=10.0)
    host, port = store.get("c/0").decode().rsplit(":", 1)
    idle = socket.create_connection((host, int(port)))  # connects first and never answers its challenge
    monkeypatch.setattr(_mesh, "_HANDSHAKE_TIMEOUT", 0.5)  # rank 1 must be greeted well before rank 0 arrives

    def rank0():
        time.sleep(2)  # rank 0 reaches the set late; rank 1 is already linked and waiting
        return eps[0].star(0, [0, 1], "test op")

    start = time.monotonic()
    results, errors = _on_threads([rank0, lambda: eps[1].star(0, [0, 1], "test op")])
    assert errors == [None, None]
    assert time.monotonic() - start < 8
    links = dict(enumerate(results))
    _say_hello(links, 0, 1)
    idle.close()
    _close(*links.values())
    for ep in eps:
        ep.close()


@pytest.mark.unit
def test_a_peer_that_leaves_fails_its_link_at_once_after_the_frames_it_sent():
    _, eps = _endpoints(2)
    links = _star(eps, [0, 1])
    coordinator = PeerChannel(links[0][1], 1, 1024)
    worker = PeerChannel(links[1][0], 0, 1024)
    worker.send({"last": "words"}, b"bye")
    worker.close()  # rank 1 exits
    start = time.monotonic()
    frames = []
    with pytest.raises(MeshError, match=r"^rank 1 closed its control link: it has exited or failed; its own error "
                                        r"is in its output\.$"):
        while time.monotonic() - start < 10:
            select.select([coordinator.sock], [], [], 1.0)
            frames.extend((meta, bytes(payload)) for meta, payload in coordinator.receive())
    assert frames == [({"last": "words"}, b"bye")]  # handed out before the failure
    assert time.monotonic() - start < 10
    with pytest.raises(MeshError, match=r"^rank 1 closed its control link"):  # and for good
        coordinator.receive()
    coordinator.close()
    for ep in eps:
        ep.close()


@pytest.mark.unit
def test_a_peer_whose_link_is_reset_is_named_on_receive_and_on_send():
    _, eps = _endpoints(2)
    links = _star(eps, [0, 1])
    coordinator = PeerChannel(links[0][1], 1, 1024)
    links[1][0].setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    links[1][0].close()  # an abortive close: a reset, as when a host drops the connection
    failed = r"^rank 1's control link failed \(\[Errno \d+\] [^)]+\); it has exited or failed: its own error is in " \
             r"its output\.$"
    with pytest.raises(MeshError, match=failed):
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            select.select([coordinator.sock], [], [], 1.0)
            assert coordinator.receive() == []
    with pytest.raises(MeshError, match=failed):
        coordinator.send({"to": "nobody"}, b"x" * 100)
    coordinator.close()
    for ep in eps:
        ep.close()


@pytest.mark.unit
def test_a_peer_that_never_connects_is_named():
    _, eps = _endpoints(2, timeout=1.0)
    with pytest.raises(MeshError, match=r"^ranks 1 did not connect within 1 s for test op; they never reached it, "
                                        r"or cannot reach this rank's control address \('127\.0\.0\.1', \d+\)\.$"):
        eps[0].star(0, [0, 1], "test op")
    for ep in eps:
        ep.close()


@pytest.mark.unit
@pytest.mark.parametrize("meta_len, payload_len", [(0, 1 << 31), (MAX_META + 1, 0), (-1, 0)])
def test_a_frame_over_the_limits_is_refused_before_its_body_is_read(meta_len, payload_len):
    _, eps = _endpoints(2)
    links = _star(eps, [0, 1])
    coordinator = PeerChannel(links[0][1], 1, 1024)
    _raw(links[1][0]).sendall(FRAME.pack(meta_len, payload_len))  # announces a body it never sends
    with pytest.raises(MeshError) as caught:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # the header alone makes it fail: no body to wait for
            select.select([coordinator.sock], [], [], 1.0)
            assert coordinator.receive() == []
    assert str(caught.value) == (f"rank 1 sent a control frame of {meta_len} + {payload_len} bytes, over the limits "
                                 f"({MAX_META} + 1024); every rank must run the same sparkhvd version.")
    coordinator.close()
    _close(links[1])
    for ep in eps:
        ep.close()


@pytest.mark.unit
def test_a_frame_whose_meta_is_not_json_is_refused():
    _, eps = _endpoints(2)
    links = _star(eps, [0, 1])
    coordinator = PeerChannel(links[0][1], 1, 1024)
    _raw(links[1][0]).sendall(FRAME.pack(5, 0) + b"nope!")
    with pytest.raises(MeshError) as caught:
        _pump({1: coordinator}, {1: 1}, timeout=10)
    assert re.fullmatch(r"rank 1 sent a control frame that is not valid JSON \(Expecting value: line 1 column 1 "
                        r"\(char 0\)\); every rank must run the same sparkhvd version\.", str(caught.value)), \
        str(caught.value)
    coordinator.close()
    _close(links[1])
    for ep in eps:
        ep.close()


@pytest.mark.unit
def test_shutdown_wakes_a_rank_waiting_for_its_peers_and_removed_sets_refuse_late_links():
    store, eps = _endpoints(2, timeout=30.0)
    threading.Timer(0.5, eps[0].close).start()
    start = time.monotonic()
    with pytest.raises(MeshError, match=r"^test op cannot run: hvd\.shutdown\(\) closed this rank's control "
                                        r"links\.$"):
        eps[0].star(0, [0, 1], "test op")  # rank 1 never comes
    assert time.monotonic() - start < 10
    _, eps2 = _endpoints(2)
    eps2[0].forget(5)  # rank 0 removed set 5; rank 1 then links up for it and is told so at once
    start = time.monotonic()
    with pytest.raises(MeshError, match=r"^rank 0 refused the control link for late: that process set was removed "
                                        r"there, or hvd\.shutdown\(\) ran there; every rank must create and remove "
                                        r"process sets together\.$"):
        eps2[1].star(5, [0, 1], "late")
    assert time.monotonic() - start < 10
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
    links = _star(eps, [0, 1])
    _say_hello(links, 0, 1)
    _close(*links.values())
    for ep in eps:
        ep.close()


@pytest.mark.unit
def test_a_peer_that_never_answers_the_connect_is_named_unreachable_not_flooded(monkeypatch):
    """No SYN-ACK (a full accept queue here; a cut path or a dead host in life): one try, a true message."""
    from sparkhvd.collective._engine import mesh as _mesh

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
            ep.star(0, [9, 0], "test op")  # rank 9 coordinates: this rank dials it
        print(f"named unreachable after {time.monotonic() - started:.1f} s")
        ep.close()
    finally:
        for s in fillers:
            s.close()
        silent.close()
