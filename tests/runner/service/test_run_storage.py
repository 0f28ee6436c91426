"""A run's folder in its storage (runner/_service/run_storage.py, runner/_service/commit_store.py): the lease keeps two
drivers off one run_id and passes on once expired or once its driver's process is gone; the manifest names the newest
`keep` commits of each state, written whole; a new driver's store starts from them."""

from __future__ import annotations

import json
import os
import socket

import pytest

from sparkhvd.runner import RunIdInUse
from sparkhvd.runner._service.commit_store import CommitStore
from sparkhvd.runner._service.run_storage import LEASE, MANIFEST, RunStorage

pytestmark = pytest.mark.unit


class Clock:
    def __init__(self):
        self.now = 1_000_000.0

    def __call__(self):
        return self.now


def _lease(tmp_path, run_id, **fields):
    folder = tmp_path / run_id
    folder.mkdir(parents=True, exist_ok=True)
    (folder / LEASE).write_text(json.dumps(fields))


def test_a_live_lease_refuses_a_second_driver_and_an_expired_one_passes_on(tmp_path):
    clock = Clock()
    first = RunStorage(str(tmp_path), "r", lease_s=30, clock=clock)
    first.claim()
    try:
        with pytest.raises(RunIdInUse, match=rf"^run_id='r' is running under another driver \(pid {os.getpid()} on "
                                             rf"host {socket.gethostname()}\)"):
            RunStorage(str(tmp_path), "r", lease_s=30, clock=clock).claim()
        clock.now += 31  # the first stopped renewing (its renewals run on the real clock, far apart)
        second = RunStorage(str(tmp_path), "r", lease_s=30, clock=clock)
        second.claim()
        assert json.loads((tmp_path / "r" / LEASE).read_text())["token"] == second.token
        first.release()  # no longer its lease: left alone
        assert (tmp_path / "r" / LEASE).exists()
        second.release()
        assert not (tmp_path / "r" / LEASE).exists()
    finally:
        first.release()


def test_the_lease_of_a_driver_whose_process_is_gone_from_this_host_passes_on_at_once(tmp_path):
    clock = Clock()
    _lease(tmp_path, "r", token="old", host=socket.gethostname(), pid=2 ** 22 + 12345, expires=clock.now + 30)
    storage = RunStorage(str(tmp_path), "r", lease_s=30, clock=clock)
    storage.claim()
    storage.release()
    _lease(tmp_path, "r", token="old", host="another-host", pid=2 ** 22 + 12345, expires=clock.now + 30)
    with pytest.raises(RunIdInUse, match=r"host another-host\), whose lease in .*r/lease\.json lasts until "
                                         r"\d\d:\d\d:\d\d UTC"):
        RunStorage(str(tmp_path), "r", lease_s=30, clock=clock).claim()


def _commit(store: CommitStore, folder, key: str, seq: int, attempt: int = 0):
    path = folder / f"{key}-{seq}.pkl"
    path.write_bytes(b"state %d" % seq)
    assert store.put({"key": key, "seq": seq, "fields": {"step": seq}, "path": str(path), "sha256": "d"}, b"",
                     attempt=attempt)
    return path


def test_the_manifest_names_the_newest_keep_commits_of_each_state_and_a_new_driver_starts_from_them(tmp_path):
    storage = RunStorage(str(tmp_path), "r", lease_s=30)
    storage.claim()
    store = CommitStore(run_id="r", storage=storage, keep=2)
    folder = tmp_path / "r"
    paths = [_commit(store, folder, "0", seq) for seq in (1, 2, 3)]
    manifest = json.loads((folder / MANIFEST).read_text())["commits"]
    assert [m["seq"] for m in manifest["0"]] == [3, 2]
    assert not paths[0].exists() and paths[1].exists() and paths[2].exists()  # past keep: removed after the manifest
    store.close(succeeded=False)  # a failed run keeps its folder
    assert paths[2].exists() and not (folder / LEASE).exists()

    again = RunStorage(str(tmp_path), "r", lease_s=30)
    again.claim()
    store = CommitStore(run_id="r", storage=again, keep=0)
    assert store.inherited["0"]["seq"] == 3 and store.get("0").meta["attempt"] == -1
    _commit(store, folder, "0", 4)  # any commit of this driver's first attempt is newer than the inherited one
    assert store.get("0").meta["seq"] == 4 and [m["seq"] for m in store.kept()] == [4]
    assert not paths[2].exists()
    store.close(succeeded=True)  # keep=0: the run ended well, its folder goes
    assert not folder.exists() and store.kept() == []


def test_a_run_that_ends_well_keeps_its_newest_keep_commits_and_lists_them(tmp_path):
    storage = RunStorage(str(tmp_path), "r", lease_s=30)
    storage.claim()
    store = CommitStore(run_id="r", storage=storage, keep=1)
    _commit(store, tmp_path / "r", "0", 1)
    _commit(store, tmp_path / "r", "1", 1)
    store.close(succeeded=True)
    assert sorted(m["key"] for m in store.kept()) == ["0", "1"]
    assert sorted(json.loads((tmp_path / "r" / MANIFEST).read_text())["commits"]) == ["0", "1"]


def test_keep_best_keeps_each_states_best_commit_by_its_field_beside_the_newest(tmp_path):
    storage = RunStorage(str(tmp_path), "r", lease_s=30)
    storage.claim()
    store = CommitStore(run_id="r", storage=storage, keep=1, keep_best=("val_loss", "min"))
    folder = tmp_path / "r"
    paths = {}
    for seq, loss in enumerate((0.9, 0.3, 0.5, 0.7), 1):
        paths[seq] = folder / f"0-{seq}.pkl"
        paths[seq].write_bytes(b"x")
        store.put({"key": "0", "seq": seq, "fields": {"val_loss": loss}, "path": str(paths[seq]), "sha256": "d"}, b"")
    assert [m["seq"] for m in store.kept()] == [4, 2]  # the newest, and the best (0.3)
    assert not paths[1].exists() and paths[2].exists() and not paths[3].exists()
    store.close(succeeded=True)
    assert [m["seq"] for m in store.kept()] == [4, 2] and paths[2].exists() and paths[4].exists()
