"""The driver service refuses anything that is not an authenticated, fresh, well-sized frame."""

from __future__ import annotations

import logging
import pickle
import socket
import struct
import time

import pytest

from sparkhvd._common.client import ServiceClient, ServiceError
from sparkhvd._common.driver_messages import Register, StoreSet
from sparkhvd._common.protocol import _HEADER, MAGIC, NONCE_BYTES, AuthenticatedChannel, Kind, ProtocolError, new_secret
from sparkhvd.runner._service.service import DriverService


@pytest.fixture
def service():
    svc = DriverService(np=2, secret=new_secret(), payload=b"payload")
    yield svc
    svc.close()


def _wait_for_refusal(svc, count=1, timeout=5.0):
    deadline = time.monotonic() + timeout
    while len(svc.refusals) < count and time.monotonic() < deadline:
        time.sleep(0.01)
    return svc.refusals


def _closed(sock: socket.socket) -> bool:
    """Whether the server closes the connection (after whatever it sends last) within 5 s."""
    sock.settimeout(5)
    try:
        while sock.recv(4096):
            pass
        return True
    except ConnectionResetError:
        return True
    except socket.timeout:
        return False


@pytest.mark.unit
def test_service_binds_to_loopback(service):
    assert service.address[0] == "127.0.0.1"


@pytest.mark.unit
def test_authenticated_store_round_trip(service):
    client = ServiceClient(service.address, service._secret)
    client.request(Kind.STORE_SET, {"key": "k"}, b"v")
    assert client.request(Kind.STORE_GET, {"key": "k", "timeout": 1}).blob == b"v"
    assert client.request(Kind.STORE_ADD, {"key": "n", "amount": 3}).meta["value"] == 3
    with pytest.raises(ServiceError, match="timed out after 0.1 s waiting for key 'missing'"):
        client.request(Kind.STORE_GET, {"key": "missing", "timeout": 0.1})
    client.close()


@pytest.mark.unit
def test_wrong_key_is_refused(service):
    client = ServiceClient(service.address, new_secret())
    with pytest.raises((ConnectionError, OSError)):
        client.request(Kind.FETCH)
    assert "HMAC" in _wait_for_refusal(service)[0]


@pytest.mark.unit
def test_truncated_frame_is_refused(service):
    sock = socket.create_connection(service.address)
    channel = AuthenticatedChannel.connect(sock, service._secret)
    header = _HEADER.pack(MAGIC, Kind.STORE_SET, 0, 100, 0)
    sock.sendall(header + channel._header_tag(b"C", header) + b"{")  # an honest header, then hang up mid-body
    sock.shutdown(socket.SHUT_WR)
    assert "connection closed after 1 of 100 bytes" in _wait_for_refusal(service)[0]
    channel.close()


@pytest.mark.unit
def test_oversized_length_is_refused_before_reading(service):
    sock = socket.create_connection(service.address)
    AuthenticatedChannel.connect(sock, service._secret)
    sock.sendall(_HEADER.pack(MAGIC, Kind.RESULT, 0, 10, 1 << 40))  # a terabyte, never sent
    assert _closed(sock)
    assert "exceed the limits" in _wait_for_refusal(service)[0]


@pytest.mark.unit
def test_replayed_frame_is_refused(service):
    """The same bytes sent twice on a connection, and again on a new one, are both refused."""
    sock = socket.create_connection(service.address)
    channel = AuthenticatedChannel.connect(sock, service._secret)
    sent = []
    real_sendall = sock.sendall
    channel.sock = type("Recorder", (), {"sendall": lambda self, b: (sent.append(b), real_sendall(b))})()
    channel.send(Kind.STORE_SET, {"key": "k"}, b"v")
    channel.sock = sock
    assert channel.recv().kind == Kind.OK
    frame = b"".join(sent)
    real_sendall(frame)  # replay on the same connection
    assert _closed(sock)
    assert "sequence 0 where 1 was expected" in _wait_for_refusal(service)[0]

    other = socket.create_connection(service.address)
    other.recv(len(MAGIC) + NONCE_BYTES)
    other.sendall(frame)  # replay on a new connection: another nonce
    assert _closed(other)
    assert "HMAC" in _wait_for_refusal(service, 2)[1]


@pytest.mark.unit
def test_reflected_frame_is_refused(service):
    """A frame the server sent cannot be sent back to it as a request."""
    sock = socket.create_connection(service.address)
    server_side = AuthenticatedChannel(sock, service._secret, b"\0" * NONCE_BYTES, is_server=True)
    nonce = sock.recv(len(MAGIC) + NONCE_BYTES)[len(MAGIC):]
    server_side._nonce = nonce
    server_side.send(Kind.STORE_SET, {"key": "k"}, b"v")  # tagged in the server's direction
    assert _closed(sock)
    assert "HMAC" in _wait_for_refusal(service)[0]


class _CreatesFile:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


@pytest.mark.unit
def test_unverified_pickle_is_never_unpickled(service, tmp_path):
    target = tmp_path / "pwned"
    payload = pickle.dumps(_CreatesFile(str(target)))
    pickle.loads(pickle.dumps(_CreatesFile(str(tmp_path / "control")))).close()
    assert (tmp_path / "control").exists()  # the payload does create a file when unpickled
    client = ServiceClient(service.address, new_secret())  # an attacker without the secret
    with pytest.raises((ConnectionError, OSError)):
        client.request(Kind.RESULT, {"rank": 0}, payload)
    with pytest.raises((ConnectionError, OSError)):
        client.request(Kind.ERROR, {"rank": 0, "type": "X", "message": "m"}, payload)
    _wait_for_refusal(service)
    assert not target.exists()
    assert service.results == {} and service.failures == []


@pytest.mark.unit
def test_garbage_greeting_is_refused(service):
    sock = socket.create_connection(service.address)
    sock.recv(len(MAGIC) + NONCE_BYTES)
    sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + b"\0" * 32)
    assert _closed(sock)
    assert "bad frame magic" in _wait_for_refusal(service)[0]


@pytest.mark.unit
def test_client_refuses_a_non_sparkhvd_server():
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    sock = socket.create_connection(("127.0.0.1", port))
    conn, _ = server.accept()
    conn.sendall(b"HTTP/1.1 200 OK\r\n\r\n" + b"x" * 16)
    with pytest.raises(ProtocolError, match="not a sparkhvd driver service"):
        AuthenticatedChannel.connect(sock, new_secret())
    for s in (sock, conn, server):
        s.close()


@pytest.mark.unit
def test_register_refuses_bad_task_index(service):
    client = ServiceClient(service.address, service._secret)
    with pytest.raises(ServiceError, match=r"task index 7 is outside 0..1"):
        client.ask(Register(task=7, host="h", host_id="h", pid=1, gpus=[], devices=[]))


@pytest.mark.unit
@pytest.mark.parametrize("kind, meta, reason", [
    (Kind.REGISTER, {"task": 0, "host": "h"}, r"it lacks its field 'host_id'"),
    (Kind.EXIT, {"rank": 0, "code": 1, "signal": 9}, r"it has the field 'signal', which EXIT does not have \('rank', "
                                                    r"'code'\)"),
    (Kind.RESULT, {"rank": "0"}, r"its field 'rank' is '0' \(str\) where a whole number was expected"),
    (Kind.ERROR, {"rank": 5, "type": "E", "message": "m"}, r"its rank 5 is not a rank of this run \(0\.\.1\)"),
    (Kind.STORE_ADD, ["k", 1], r"its meta is a JSON list where an object was expected"),
])
def test_a_request_that_is_not_its_kinds_message_is_refused_with_the_field_and_the_fix(service, kind, meta, reason):
    client = ServiceClient(service.address, service._secret)
    try:
        with pytest.raises(ServiceError, match=rf"^the driver service refused a {kind.name} frame because {reason}; "
                                               r"the sender runs another sparkhvd version than the driver: install the "
                                               r"same version on the driver and the executors\.$"):
            client.request(kind, meta)
        client.ask(StoreSet(key="k"), b"v")  # the connection goes on
    finally:
        client.close()
    assert service.status().exits == {} and service.status().results == {}


@pytest.mark.unit
def test_a_malformed_heartbeat_is_dropped_unanswered_and_the_connection_goes_on(service, caplog):
    caplog.set_level(logging.WARNING, logger="sparkhvd.service")
    client = ServiceClient(service.address, service._secret)
    try:
        client.notify(Kind.PROGRESS, {"rank": 0, "state": "running"})  # no interval, no settings
        client.ask(StoreSet(key="k"), b"v")  # answered next: no ERR was sent for the heartbeat
    finally:
        client.close()
    assert service.status().progress == {} and service.bad_frames == 1
    assert any("refused a PROGRESS frame from 127.0.0.1 because it lacks its field 'interval'; it is dropped"
               in r.getMessage() for r in caplog.records)


@pytest.mark.unit
def test_payload_limit_message():
    a, b = socket.socketpair()
    channel = AuthenticatedChannel(a, new_secret(), b"\0" * NONCE_BYTES, is_server=False, max_blob=10)
    with pytest.raises(ValueError, match="over the driver service's 10-byte limit; save large objects"):
        channel.send(Kind.RESULT, {}, b"x" * 11)
    a.close(), b.close()
    assert struct.calcsize("!4sBQIQ") == _HEADER.size


@pytest.mark.unit
def test_unauthenticated_header_is_refused_before_any_body_is_read(service):
    """A header claiming a large body, without the secret: refused on its header tag, nothing allocated."""
    sock = socket.create_connection(service.address)
    AuthenticatedChannel.connect(sock, service._secret)
    sock.sendall(_HEADER.pack(MAGIC, Kind.RESULT, 0, 10, 512 << 20) + b"\0" * 32)
    assert _closed(sock)
    assert "frame header failed HMAC verification" in _wait_for_refusal(service)[0]


@pytest.mark.unit
def test_a_connection_that_never_authenticates_is_dropped(monkeypatch):
    from sparkhvd.runner._service import service as _service

    monkeypatch.setattr(_service, "FIRST_FRAME_TIMEOUT_S", 0.3)
    svc = DriverService(np=1, secret=new_secret(), payload=b"")
    try:
        sock = socket.create_connection(svc.address)
        sock.recv(len(MAGIC) + NONCE_BYTES)  # greeting, then silence
        assert _closed(sock)
        assert "no authenticated frame within 0.3 s" in _wait_for_refusal(svc)[0]
    finally:
        svc.close()


@pytest.mark.unit
def test_a_malformed_request_gets_an_error_not_a_dropped_connection(service):
    client = ServiceClient(service.address, service._secret)
    client.request(Kind.STORE_SET, {"key": "n"}, b"not a number")
    with pytest.raises(ServiceError, match="could not handle a STORE_ADD request: ValueError"):
        client.request(Kind.STORE_ADD, {"key": "n", "amount": 1})
    assert client.request(Kind.STORE_CHECK, {"keys": ["n"]}).meta["value"] is True  # still connected


@pytest.mark.unit
def test_close_stops_listening_and_ends_the_accept_thread():
    svc = DriverService(np=1, secret=new_secret(), payload=b"")
    address = svc.address
    svc.close()
    assert not svc._thread.is_alive()
    with pytest.raises(OSError):
        socket.create_connection(address, timeout=2).recv(1) or (_ for _ in ()).throw(ConnectionRefusedError())


def test_the_service_survives_running_out_of_file_descriptors(tmp_path):
    """80 raw connections against a 64-descriptor limit; once they go, a real client is served."""
    import subprocess
    import sys

    code = """
import resource, socket, time
resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
from sparkhvd.runner._service.service import DriverService
from sparkhvd._common.client import ServiceClient
from sparkhvd._common.protocol import Kind, new_secret
svc = DriverService(np=1, secret=new_secret(), payload=b"")
socks = []
for _ in range(80):
    try:
        socks.append(socket.create_connection(svc.address, timeout=1))
    except OSError:
        break
time.sleep(0.5)
for s in socks:
    s.close()
time.sleep(0.5)
client = ServiceClient(svc.address, svc._secret, connect_timeout=5)
client.request(Kind.STORE_SET, {"key": "k"}, b"v")
print("SERVED", svc._thread.is_alive())
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "SERVED True" in out.stdout, out.stdout + out.stderr[-2000:]
