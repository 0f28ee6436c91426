"""The driver service's messages (_common/driver_messages.py): each one round-trips through its codec, and a meta
that is not its kind's message is refused with a sentence naming the field."""

from __future__ import annotations

import dataclasses

import pytest

from sparkhvd._common import driver_messages as dm
from sparkhvd._common.protocol import Kind

pytestmark = pytest.mark.unit

EXAMPLES = [
    dm.Register(task=1, host="h", host_id="h-1", pid=9, gpus=["0"], devices=["3"], spark_task=[4, 17],
                endpoint=["10.0.0.1", 29500, 29501]),
    dm.Assign(placement={"rank": 1, "size": 2}, host_gpus=["3"], endpoints=[None, ["10.0.0.1", 1, 2]], node=[0, 1]),
    dm.Fetch(), dm.Watch(rank=-1), dm.Log(rank=0, stream="stdout", lines=["a"], progress="5%"), dm.Result(rank=1),
    dm.Error(rank=0, type="ValueError", message="m", traceback="t"), dm.Exit(rank=1, code=-9),
    dm.Progress(rank=0, state="running", interval=1.0, settings={}, done=3, ops=[{"kind": "allreduce"}], last=None),
    dm.Timeline(rank=1, offset_us=-300, error_us=40), dm.Clock(), dm.ClockReading(now_us=1_765_000_000_000_000),
    dm.Commit(key="s", seq=2, size=2, fields={"epoch": 1}, bytes=10), dm.Committed(kept=True, hosts_updated=[1.0, 1]),
    dm.Restore(key="s", data=False), dm.Restored(found=True, commit={"key": "s"}), dm.StoreSet(key="k"),
    dm.StoreGet(key="k", timeout=None), dm.StoreAdd(key="k", amount=2), dm.StoreCheck(keys=["a", "b"]),
    dm.StoreWait(keys=["a"], timeout=3.5), dm.StoreCas(key="k", expected_len=0), dm.StoreDelete(key="k"),
    dm.StoreNumKeys(), dm.StoreValue(value=True), dm.Aborted(reason="r"), dm.Refusal(message="m", unserved=True),
]


def test_every_message_round_trips_and_every_request_kind_has_one():
    for message in EXAMPLES:
        assert dm.decode(type(message), dm.encode(message), np=2) == message
    classes = {type(m) for m in EXAMPLES}
    assert set(dm.REQUESTS.values()) <= classes
    requests = {k for k in Kind if k not in (Kind.OK, Kind.ERR, Kind.ABORT, Kind.ASSIGN)}
    assert set(dm.REQUESTS) == requests  # every request kind the protocol has is a message here


def test_every_field_type_has_a_check():
    for cls in {type(m) for m in EXAMPLES}:
        for field in dataclasses.fields(cls):
            assert field.type in dm._TYPES, f"{cls.__name__}.{field.name}: {field.type}"


@pytest.mark.parametrize("cls, meta, reason", [
    (dm.Exit, {"rank": 0, "code": True}, "its field 'code' is True (bool) where a whole number was expected"),
    (dm.Register, {}, "it lacks its field 'task'"),
    (dm.Fetch, {"rank": 0}, "it has the field 'rank', which FETCH does not have (it has none)"),
    (dm.Log, {"rank": 0, "stream": "tty", "lines": []}, "its stream 'tty' is not one of 'stdout', 'stderr', "
                                                         "'driver', 'file'"),
    (dm.Progress, {"rank": 2, "state": "running", "interval": 1, "settings": {}}, "its rank 2 is not a rank of this "
                                                                                  "run (0..1)"),
    (dm.StoreValue, "7", "its meta is a JSON str where an object was expected"),
])
def test_a_meta_that_is_not_the_message_says_which_field_and_why(cls, meta, reason):
    with pytest.raises(dm.MessageError) as info:
        dm.decode(cls, meta, np=2)
    assert str(info.value) == reason and info.value.name == dm.name_of(cls)


def test_a_frame_kind_that_is_no_request_is_refused():
    with pytest.raises(dm.MessageError, match=r"^it is no request the driver serves$"):
        dm.decode_request(Kind.ASSIGN, {})
