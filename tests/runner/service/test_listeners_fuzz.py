"""No one on the network can deny service: hostile clients against both listeners during a real run.

Threads in the test process send thousands of random frames, oversized headers, wrong-HMAC
frames and one-byte-at-a-time greetings, and hold well over a listener's worth of idle
connections, against the driver service and against rank 0's control port, while a real
np=-2 run (local processes, real gloo) links up and allreduces. The run must return the right
value, the refusals must be summarised in one line (not one line each), and the driver must
not start a thread per connection. Every loop is bounded in count and time; only 127.0.0.1.
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import os
import random
import re
import socket
import subprocess
import sys
import textwrap
import threading
import time

from sparkhvd import HorovodRunner
from sparkhvd._common.protocol import _HEADER, MAGIC, NONCE_BYTES, AuthenticatedChannel, Kind
from sparkhvd.runner import _horovod_runner
from sparkhvd.runner._service import service as _service

ATTACK_S = 40.0  # a hard bound on every attacking loop, far above the run's few seconds
IDLE = 1200  # idle connections held against each listener: over twice its 512 handshake slots


class Attack:
    """Hostile clients of one listener, on threads: ``service`` (the driver's) or ``mesh`` (a rank's)."""

    def __init__(self, address: tuple, target: str, stop: threading.Event, seed: int):
        self.address = address
        self.target = target
        self.greeting = len(MAGIC) + NONCE_BYTES if target == "service" else 16
        self.stop = stop
        self.seed = seed
        self.sent = collections.Counter()
        self.idle: list = []
        self.held = threading.Event()  # set once the idle connections are all open
        self.threads: list = []
        self._end = time.monotonic() + ATTACK_S
        self._lock = threading.Lock()

    def start(self, *, random_frames=1500, oversized=500, wrong_hmac=1500, slow=4) -> "Attack":
        jobs = [(self._hold_idle, IDLE), (self._random, random_frames), (self._oversized, oversized),
                (self._wrong_hmac, wrong_hmac)] + [(self._slow, i) for i in range(slow)]
        for fn, arg in jobs:
            t = threading.Thread(target=fn, args=(arg,), daemon=True, name=f"attack-{self.target}-{fn.__name__}")
            t.start()
            self.threads.append(t)
        return self

    def finish(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(15)
        assert not any(t.is_alive() for t in self.threads), "an attacking thread did not stop"
        for s in self.idle:
            s.close()

    @property
    def connections(self) -> int:
        return sum(n for k, n in self.sent.items() if k != "connect failed")

    def _going(self) -> bool:
        return not self.stop.is_set() and time.monotonic() < self._end

    def _count(self, what: str) -> None:
        with self._lock:
            self.sent[what] += 1

    def _connect(self) -> socket.socket:
        sock = socket.create_connection(self.address, timeout=3)
        return sock

    def _hold_idle(self, n: int) -> None:
        for _ in range(n):
            if not self._going():
                break
            try:
                self.idle.append(self._connect())
                self._count("idle")
            except OSError:
                self._count("connect failed")
        self.held.set()

    def _once(self, what: str, body) -> None:
        try:
            with self._connect() as sock:
                body(sock)
                sock.settimeout(3)
                try:
                    while sock.recv(4096):  # until the listener closes it
                        pass
                except OSError:
                    pass
            self._count(what)
        except OSError:
            self._count("connect failed")

    def _random(self, n: int) -> None:
        rng = random.Random(self.seed)
        for _ in range(n):
            if not self._going():
                break

            def body(sock):
                if rng.random() < 0.5:
                    sock.recv(self.greeting)
                sock.sendall(rng.randbytes(rng.randint(1, 300)))
                sock.shutdown(socket.SHUT_WR)
            self._once("random", body)

    def _oversized(self, n: int) -> None:
        for _ in range(n):
            if not self._going():
                break

            def body(sock):
                sock.recv(self.greeting)
                if self.target == "service":  # a terabyte announced, never sent
                    sock.sendall(_HEADER.pack(MAGIC, Kind.RESULT, 0, 1 << 20, 1 << 40))
                else:  # far more than a handshake
                    try:
                        sock.sendall(os.urandom(256 * 1024))
                    except OSError:
                        pass
            self._once("oversized", body)

    def _wrong_hmac(self, n: int) -> None:
        wrong = os.urandom(32)
        for i in range(n):
            if not self._going():
                break

            def body(sock):
                if self.target == "service":
                    AuthenticatedChannel.connect(sock, wrong).send(Kind.STORE_SET, {"key": f"k{i}"}, b"v")
                else:
                    challenge = sock.recv(16)
                    hello = (0).to_bytes(8, "big") + (1).to_bytes(8, "big")  # set 0, claiming to be rank 1
                    sock.sendall(hello + hmac.new(wrong, challenge + hello, hashlib.sha256).digest())
            self._once("wrong HMAC", body)

    def _slow(self, i: int) -> None:
        """One byte at a time, 0.1 s apart, until the listener gives up on the connection."""
        while self._going():
            try:
                sock = self._connect()
            except OSError:
                self._count("connect failed")
                continue
            with sock:
                try:
                    sock.recv(self.greeting)
                    for b in (MAGIC + b"\0" * 60)[:60]:
                        if not self._going():
                            break
                        sock.send(bytes([b]))
                        time.sleep(0.1)
                except OSError:
                    pass
            self._count("slow")


class ThreadPeak:
    """The most threads alive in this process, sampled every 20 ms."""

    def __init__(self):
        self.peak = threading.active_count()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, threading.active_count())

    def close(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


def _train(go: str):
    """Waits (bounded) until the test's attack on rank 0's port is under way, then allreduces."""
    import torch

    import sparkhvd.collective.torch as hvd

    hvd.init()
    deadline = time.monotonic() + 30
    while not os.path.exists(go) and time.monotonic() < deadline:
        time.sleep(0.02)
    out = []
    for i in range(5):
        t = torch.arange(4, dtype=torch.float32) + 1 + 4 * hvd.rank()
        out.append(hvd.allreduce(t, op=hvd.Sum, name=f"fuzz.{i}").tolist())
    return out


EXPECTED = [[6.0, 8.0, 10.0, 12.0]] * 5  # (1..4) + (5..8)


def _control_address(service, timeout: float):
    """Rank 0's control address, from the rendezvous store (where its peers find it)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = [v for k, v in service.store.snapshot().items() if re.search(r"(^|/)control/0$", k)]
        if found:
            host, port = found[0].decode().rsplit(":", 1)
            return host, int(port)
        time.sleep(0.02)
    raise AssertionError("rank 0 never published its control address")


def test_a_run_survives_fuzzing_of_both_listeners(monkeypatch, tmp_path, caplog, capfd):
    monkeypatch.setattr(_service, "FIRST_FRAME_TIMEOUT_S", 2.0)  # so slow greetings are refused within the test
    go = str(tmp_path / "go")
    start = time.monotonic()
    assert HorovodRunner(np=-2, driver_log_verbosity="log_callback_only").run(_train, go=__file__) == EXPECTED
    quiet_s = time.monotonic() - start
    capfd.readouterr()

    services = []

    class Captured(_service.DriverService):
        def __init__(self, **kw):
            super().__init__(**kw)
            services.append(self)

    monkeypatch.setattr(_horovod_runner, "DriverService", Captured)
    stop = threading.Event()
    attacks = []
    errors = []

    def attack():
        try:
            while not services and not stop.is_set():
                time.sleep(0.005)
            service = services[0]
            attacks.append(Attack(service.address, "service", stop, seed=1).start())
            control = _control_address(service, 30)
            mesh = Attack(control, "mesh", stop, seed=2).start()
            attacks.append(mesh)
            mesh.held.wait(30)
            deadline = time.monotonic() + 30  # and until a good part of the rest has been sent
            while min(a.connections for a in attacks) < 2500 and time.monotonic() < deadline:
                time.sleep(0.02)
            # Evictions can take every idle connection before its 2 s are up while the flood lasts; once the
            # bounded attacks are spent, the idle ones left time out. Wait for one (the run asserts on it).
            while not any("no authenticated frame" in k for k in service.tally.counts()) \
                    and time.monotonic() < deadline:
                time.sleep(0.02)
        except Exception as exc:  # noqa: BLE001 - handed to the test
            errors.append(exc)
        finally:
            open(go, "w").close()  # the ranks link up and allreduce while rank 0's port is flooded

    baseline = threading.active_count()
    peak = ThreadPeak()
    caplog.set_level("WARNING")
    attacker = threading.Thread(target=attack, daemon=True)
    attacker.start()
    start = time.monotonic()
    try:
        runner = HorovodRunner(np=-2, driver_log_verbosity="log_callback_only")
        value = runner.run(_train, go=go)
        fuzzed_s = time.monotonic() - start
    finally:
        stop.set()
        attacker.join(30)
        for a in attacks:
            a.finish()
    peak_threads = peak.close()
    assert errors == []
    assert value == EXPECTED

    service, (svc_attack, mesh_attack) = services[0], attacks
    capfd.readouterr()  # what the run printed is not the point here
    service_lines = [r.getMessage() for r in caplog.records if r.name == "sparkhvd.service"]
    with open(runner.last_result.log_paths[0]) as f:  # rank 0's output, as the driver received it
        mesh_lines = [line for line in f.read().splitlines() if "control listener at" in line]
    print(f"\nrun without fuzzing {quiet_s:.1f} s, with fuzzing {fuzzed_s:.1f} s")
    print(f"driver service: {svc_attack.connections:,} hostile connections ({dict(svc_attack.sent)}), "
          f"{service.tally.total:,} refused: {service.tally.counts()}")
    print(f"rank 0's control port: {mesh_attack.connections:,} hostile connections ({dict(mesh_attack.sent)})")
    print(f"threads in the driver process: {baseline} before, at most {peak_threads} during "
          f"({sum(len(a.threads) for a in attacks) + 2} of them the test's own)")
    print("driver log lines about refusals:", len(service_lines), *service_lines, sep="\n  ")
    print("rank lines about refusals:", len(mesh_lines), *mesh_lines, sep="\n  ")

    assert svc_attack.connections > 2000 and mesh_attack.sent["idle"] > 1000
    assert service.tally.total > 2000
    assert len(service.refusals) <= 100  # the last refusals in full, no more
    # One line when the first refusal came, at most one per interval after it, one summary at the end.
    summaries = [m for m in service_lines if re.search(r"refused [\d,]+ connections (during run \w+|while it served "
                                                       r"its run): ", m)]
    assert len(summaries) == 1, service_lines
    assert len(service_lines) <= 2 + fuzzed_s / 30 + 1
    assert "wrong secret" not in summaries[0] and "frame header failed HMAC verification" in summaries[0]
    assert "no authenticated frame within 2 s" in summaries[0]
    assert "from 127.0.0.1" in summaries[0]
    mesh_summaries = [line for line in mesh_lines if re.search(r"refused [\d,]+ connections while it was open", line)]
    assert len(mesh_summaries) == 1, mesh_lines
    assert "wrong key" in mesh_summaries[0] and "evicted while authenticating" in mesh_summaries[0]
    assert len(mesh_lines) <= 2 + fuzzed_s / 30 + 1
    # No thread per connection: a few per rank's real connections, not thousands.
    attackers = sum(len(a.threads) for a in attacks) + 2
    assert peak_threads - attackers - baseline < 40
    deadline = time.monotonic() + 10
    while threading.active_count() > baseline and time.monotonic() < deadline:
        time.sleep(0.05)
    assert threading.active_count() <= baseline


_LOW_FD_DRIVER = textwrap.dedent("""
    import resource, sys, time
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))
    from sparkhvd import HorovodRunner
    from sparkhvd.runner import _horovod_runner
    from sparkhvd.runner._service import service as _service

    class Announced(_service.DriverService):
        def __init__(self, **kw):
            super().__init__(**kw)
            print("ADDRESS", self.address[0], self.address[1], flush=True)

    _horovod_runner.DriverService = Announced

    def train():
        import torch
        import sparkhvd.collective.torch as hvd
        hvd.init()
        time.sleep(3)  # the ranks' connections come and go while the flood holds the port
        return hvd.allreduce(torch.ones(3) * (hvd.rank() + 1), op=hvd.Sum).tolist()

    print("VALUE", HorovodRunner(np=-2, driver_log_verbosity="log_callback_only").run(train), flush=True)
""")


def test_a_driver_with_256_file_descriptors_survives_a_flood_of_idle_connections():
    """The driver runs in a subprocess limited to 256 descriptors; this process holds 1,200
    connections to its port (its handshake slots are 64) and sends wrong-HMAC frames."""
    proc = subprocess.Popen([sys.executable, "-c", _LOW_FD_DRIVER], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    stop = threading.Event()
    attack = None
    try:
        line = proc.stdout.readline()
        assert line.startswith("ADDRESS"), line + proc.stderr.read()[-3000:]
        host, port = line.split()[1:]
        start = time.monotonic()
        attack = Attack((host, int(port)), "service", stop, seed=3).start(random_frames=0, oversized=0,
                                                                          wrong_hmac=3000, slow=0)
        out, err = proc.communicate(timeout=120)
        print(f"\nrun under a flood with 256 descriptors: {time.monotonic() - start:.1f} s; "
              f"{attack.connections:,} hostile connections ({dict(attack.sent)})")
    finally:
        stop.set()
        if attack is not None:
            attack.finish()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "VALUE [3.0, 3.0, 3.0]" in out, out + err[-4000:]
    assert attack.sent["idle"] > 500
    summary = [line for line in err.splitlines()
               if re.search(r"refused [\d,]+ connections (during run \w+|while it served its run): ", line)]
    assert len(summary) == 1, err[-4000:]
    assert "evicted while authenticating: 64 connections were authenticating at once" in summary[0]
