"""The rendezvous store (_common/rendezvous.py) as the ranks see it: the real DriverStore client
talking to a real DriverService on 127.0.0.1, with c10d Store semantics and the run's abort."""

from __future__ import annotations

import datetime
import subprocess
import sys
import threading
import time

import pytest

torch = pytest.importorskip("torch")
dist = torch.distributed

from sparkhvd._common.client import RunAborted, ServiceClient, ServiceError  # noqa: E402
from sparkhvd._common.protocol import new_secret  # noqa: E402
from sparkhvd.collective._engine.store import DriverStore  # noqa: E402
from sparkhvd.runner._service.service import DriverService  # noqa: E402


@pytest.fixture
def service():
    svc = DriverService(np=2, secret=new_secret(), payload=b"")
    yield svc
    svc.close()


def _store(service, prefix="run/", timeout_s=30.0) -> DriverStore:
    store = DriverStore(ServiceClient(service.address, service._secret), prefix=prefix)
    store.set_timeout(datetime.timedelta(seconds=timeout_s))
    return store


def _until_blocked(service, timeout=5.0):
    """Return once a request is blocked on the service's condition (CPython's Condition keeps its waiters)."""
    deadline = time.monotonic() + timeout
    while not service.cv._waiters:
        assert time.monotonic() < deadline, "no request blocked on the store"
        time.sleep(0.005)


def _in_thread(call):
    """Run ``call`` on a thread; the returned dict holds its "value" or "error" once the thread ends."""
    out = {}

    def run():
        try:
            out["value"] = call()
        except Exception as exc:  # noqa: BLE001 - the test asserts on it
            out["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


@pytest.mark.unit
def test_c10d_semantics_under_the_prefix(service):
    store = _store(service)
    store.set("a", "text")
    store.set("b", b"\x00\xff")
    assert store.get("a") == b"text" and store.get("b") == b"\x00\xff"
    assert store.add("n", 3) == 3 and store.add("n", -1) == 2 and store.get("n") == b"2"
    assert store.check(["a", "b"]) is True and store.check(["a", "nope"]) is False
    store.wait(["a", "b"])
    assert store.compare_set("c", "", "first") == b"first"  # unset and expected empty: set
    assert store.compare_set("c", "wrong", "second") == b"first"  # mismatch: the current value
    assert store.compare_set("c", "first", "second") == b"second"
    assert store.compare_set("unset", "x", "y") == b"x"  # unset, expected not empty: expected back
    assert store.num_keys() == 4
    assert store.delete_key("a") is True and store.delete_key("a") is False
    assert store.num_keys() == 3
    assert service.store.snapshot() == {"run/b": b"\x00\xff", "run/n": b"2", "run/c": b"second"}


@pytest.mark.unit
def test_c10d_calls_the_store_through_a_prefix_store(service):
    store = _store(service, prefix="")
    wrapped = dist.PrefixStore("pg", store)  # what new_group does to the default store; it adds the "/"
    wrapped.set("k", "v")
    assert wrapped.get("k") == b"v"
    assert wrapped.add("n", 5) == 5
    wrapped.wait(["k", "n"])
    assert wrapped.check(["k"]) is True
    assert sorted(service.store.snapshot()) == ["pg/k", "pg/n"]


@pytest.mark.unit
def test_a_blocked_get_and_wait_end_when_another_rank_sets_the_key(service):
    waiter, setter = _store(service), _store(service)
    getting, got = _in_thread(lambda: waiter.get("late"))
    _until_blocked(service)
    setter.set("late", "here")
    getting.join(5)
    assert got == {"value": b"here"}
    waiting, waited = _in_thread(lambda: waiter.wait(["x", "y"]))
    _until_blocked(service)
    setter.set("x", "1")
    setter.set("y", "2")
    waiting.join(5)
    assert waited == {"value": None}


@pytest.mark.unit
def test_a_get_timeout_is_refused_with_the_key(service):
    store = _store(service, timeout_s=0.2)
    start = time.monotonic()
    with pytest.raises(ServiceError, match=r"^timed out after 0.2 s waiting for key 'run/missing'$"):
        store.get("missing")
    assert 0.2 <= time.monotonic() - start < 3
    with pytest.raises(ServiceError, match=r"^timed out after 0.1 s waiting for keys \['run/a', 'run/b'\]$"):
        store.wait(["a", "b"], datetime.timedelta(seconds=0.1))
    store.set("a", "still served")  # the connection survives a refusal
    assert store.get("a") == b"still served"


@pytest.mark.unit
def test_a_blocked_get_ends_with_the_abort_reason(service):
    store = _store(service)
    getting, got = _in_thread(lambda: store.get("never"))
    _until_blocked(service)
    start = time.monotonic()
    service.abort("rank 1 raised ValueError")
    getting.join(5)
    assert time.monotonic() - start < 2
    assert isinstance(got.get("error"), RunAborted) and str(got["error"]) == "rank 1 raised ValueError"
    with pytest.raises(RunAborted, match="rank 1 raised ValueError"):  # and later ones at once
        store.wait(["never"])


@pytest.mark.unit
def test_a_blocked_wait_ends_when_the_service_closes(service):
    store = _store(service)
    waiting, waited = _in_thread(lambda: store.wait(["never"]))
    _until_blocked(service)
    service.close()
    waiting.join(5)
    assert not waiting.is_alive()
    # the run's end is answered (ABORT) or the connection is closed under it, whichever comes first
    assert isinstance(waited.get("error"), (RunAborted, OSError)), waited


def test_the_rendezvous_module_does_not_import_torch():
    code = ("import sys, sparkhvd._common.rendezvous, sparkhvd.runner._service.service; "
            "print(sorted(m for m in ('torch', 'pyspark', 'tensorflow') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
