"""Elastic commits off the ranks, piece by piece, against a real driver service over real sockets:
the Publisher keeps each state's newest commit and survives a broken link, the driver's store keeps
only newer commits and never reuses a spill file, a restarted attempt's early commit does not hide
the previous attempt's newest, and a commit_dir file is checked before it is unpickled."""

from __future__ import annotations

import hashlib
import os
import pickle

import pytest

from sparkhvd._common import commits as _commits
from sparkhvd._common import context as _context
from sparkhvd._common.client import ServiceClient, ServiceError
from sparkhvd._common.commits import Publisher
from sparkhvd._common.protocol import Kind, new_secret
from sparkhvd._common.topology import Placement
from sparkhvd.runner._service.commit_store import CommitStore
from sparkhvd.runner._service.service import DriverService


@pytest.fixture
def driver(tmp_path):
    """A real driver service on 127.0.0.1, and a worker context (what a rank process has) pointing at it."""
    secret = new_secret()
    store = CommitStore(run_id="test", memory_bytes=1 << 20)
    services = []

    def start(attempt: int = 0) -> DriverService:
        service = DriverService(np=1, secret=secret, payload=b"", commits=store, attempt=attempt, run_id="test")
        services.append(service)
        ctx = _context.WorkerContext(placement=Placement(rank=0, size=1, local_rank=0, local_size=1, cross_rank=0,
                                                         cross_size=1),
                                     run_id="test", address=service.address, secret=secret,
                                     client=ServiceClient(service.address, secret))
        _context._set(ctx)
        return service

    yield start
    _context._set(None)
    for service in services:
        service.close()
    store.close()


@pytest.mark.unit
def test_the_publisher_sends_each_states_newest_commit_however_commits_interleave(driver):
    service = driver()
    publisher = Publisher(_context.current())
    pad = bytes(4 << 20)  # slow enough to send that later commits queue up behind it
    for seq in range(1, 21):
        publisher.submit({"key": "A", "seq": seq}, {"n": seq, "pad": pad})
        publisher.submit({"key": "B", "seq": seq}, {"n": seq})
    assert publisher.flush(60)
    assert service.commits.get("A").meta["seq"] == 20
    assert service.commits.get("B").meta["seq"] == 20  # one state's commits never replace another's


@pytest.mark.unit
def test_a_broken_link_loses_one_commit_not_every_later_one(driver, capsys):
    service = driver()
    publisher = Publisher(_context.current())
    publisher.submit({"key": "A", "seq": 1}, {"n": 1})
    assert publisher.flush(30)
    publisher._client.close()  # the connection breaks under the publisher
    publisher.submit({"key": "A", "seq": 2}, {"n": 2})
    assert publisher.flush(30)
    assert "rank 0 could not send commit 2 of A off the rank" in capsys.readouterr().out
    publisher.submit({"key": "A", "seq": 3}, {"n": 3})
    assert publisher.flush(30)
    assert service.commits.get("A").meta["seq"] == 3  # it connected again


@pytest.mark.unit
def test_the_store_keeps_only_newer_commits_and_never_removes_a_kept_spill_file(tmp_path):
    store = CommitStore(run_id="test", memory_bytes=0)  # every commit spills to a file
    try:
        assert store.put({"key": "A", "seq": 5}, b"five", attempt=0)
        assert not store.put({"key": "A", "seq": 4}, b"four", attempt=0)  # older, same attempt: a late frame
        assert not store.put({"key": "A", "seq": 5}, b"again", attempt=0)
        assert store.get("A").data() == b"five"
        assert store.put({"key": "A", "seq": 5}, b"five, next attempt", attempt=1)  # seq numbers repeat after a loss
        assert store.get("A").data() == b"five, next attempt"  # its file survived the old one's removal
        spill_dir = os.path.dirname(store.get("A").spilled)
        assert len(os.listdir(spill_dir)) == 1
    finally:
        store.close()
    assert not os.path.exists(spill_dir)
    assert not store.put({"key": "A", "seq": 9}, b"after the run", attempt=1)


@pytest.mark.unit
def test_a_restarted_attempts_commit_before_it_resumes_does_not_replace_the_newest(driver):
    first = driver(attempt=0)
    first.commits.put({"key": "ObjectState-0", "seq": 57, "fields": {"epoch": 3}}, pickle.dumps({"values": {}}),
                      attempt=0)
    first.close()
    service = driver(attempt=1)
    client = _context.current().client
    early = {"key": "ObjectState-0", "seq": 1, "fields": {"epoch": 0}, "before_resume": True}
    assert client.request(Kind.COMMIT, early, b"x").meta["kept"] is False
    assert service.commits.get("ObjectState-0").meta["seq"] == 57
    # Another rank's RESTORE (no data) comes first, and rank 0's early commit, sent by its background thread, may
    # arrive after its own RESTORE: neither lets the early commit replace the previous attempt's (the suite under
    # load resumed a state from 0 so).
    assert _commits.fetch("ObjectState-0", data=False)[0]["seq"] == 57
    meta, _ = _commits.fetch("ObjectState-0")  # rank 0's RESTORE
    assert meta["seq"] == 57
    assert client.request(Kind.COMMIT, early, b"x").meta["kept"] is False
    assert service.commits.get("ObjectState-0").meta["seq"] == 57
    later = client.request(Kind.COMMIT, {"key": "ObjectState-0", "seq": 58, "fields": {"epoch": 3}}, b"y")
    assert later.meta["kept"] is True
    assert service.commits.get("ObjectState-0").meta["seq"] == 58
    # a state no earlier attempt committed keeps its commits from before its first hvd.elastic.run
    fresh = {"key": "ObjectState-1", "seq": 1, "before_resume": True}
    assert client.request(Kind.COMMIT, fresh, b"z").meta["kept"] is True


@pytest.mark.unit
def test_a_commit_that_arrives_after_its_attempt_ended_is_refused(driver):
    service = driver()
    client = _context.current().new_client()
    client.request(Kind.COMMIT, {"key": "A", "seq": 2}, b"in time")  # connected and authenticated
    service.finished = True  # what close() sets first; the connection is still open
    with pytest.raises(ServiceError, match=r"commit 3 of A arrived after this attempt had ended, so it was not kept"):
        client.request(Kind.COMMIT, {"key": "A", "seq": 3}, b"late")
    assert service.commits.get("A").meta["seq"] == 2
    client.close()


@pytest.mark.unit
def test_a_commit_dir_file_that_is_not_rank_0s_is_never_unpickled(driver, tmp_path):
    service = driver()
    path = tmp_path / "A-1.pkl"
    path.write_bytes(pickle.dumps({"n": 1}))
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    service.commits.put({"key": "A", "seq": 1, "path": str(path), "sha256": digest}, b"", attempt=0)
    assert _commits.fetch("A")[1] == {"n": 1}
    path.write_bytes(pickle.dumps({"n": "written by someone else"}))
    with pytest.raises(ValueError, match=r"the commit file .*A-1\.pkl is not the one rank 0 wrote \(its SHA-256 is "
                                         r"[0-9a-f]{64}, the driver recorded [0-9a-f]{64}\); something else wrote to "
                                         r"commit_dir: give each run a commit_dir that only it writes to\. Nothing "
                                         r"was loaded from it\."):
        _commits.fetch("A")


def test_a_relaunch_heard_between_commits_waits_for_the_next_commit(monkeypatch):
    from sparkhvd.collective._core._elastic import HostsUpdatedInterrupt, HostUpdateResult, ObjectState

    state = ObjectState(lambda obj: obj, lambda: 0, epoch=0)  # one rank: a broadcast returns its object
    monkeypatch.setattr(_commits, "growing", True)  # the driver said it can grow the run: ranks leave for new ones
    state.on_hosts_updated(1.0, HostUpdateResult.added)
    state.epoch = 1
    state.check_host_updates()  # leaving here would lose epoch 1, done since the last commit
    with pytest.raises(HostsUpdatedInterrupt) as info:
        state.commit()
    assert info.value.relaunch and not info.value.skip_sync
    assert state._saved_state == {"epoch": 1}
    state.commit()  # heard once, raised once


def test_a_users_own_host_update_still_interrupts_at_any_check():
    from sparkhvd.collective._core._elastic import HostsUpdatedInterrupt, HostUpdateResult, ObjectState

    state = ObjectState(lambda obj: obj, lambda: 0, epoch=0)
    state.on_hosts_updated(1.0, HostUpdateResult.removed)
    with pytest.raises(HostsUpdatedInterrupt) as info:
        state.check_host_updates()
    assert info.value.skip_sync and not info.value.relaunch
