"""The negotiating engine: ops matched by name across ranks, real async, dtypes gloo lacks, join.

The coordinator's decisions (``collective/_engine/negotiate.py``) are pure logic and are tested here
directly; everything else runs in real rank processes over real gloo.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from sparkhvd import HorovodRunner
from sparkhvd._common import settings
from sparkhvd._common.op_names import JOIN, label
from sparkhvd.collective._engine.messages import (
    ALL_REDUCE,
    INLINE,
    Answer,
    Layout,
    Request,
    RequestCache,
    decode_answer,
    decode_frame,
    decode_request,
    encode_answer,
    encode_frame,
    encode_request,
)
from sparkhvd.collective._engine.negotiate import Table
from sparkhvd.collective._engine.pair import pairable


def _request(name, signature="float32[4]", problem=None, fact=None, joinable=False, kind="allreduce", **more):
    return Request(name, kind, signature, f"{kind}({signature})", rank_value=fact, argument_error=problem,
                   joinable=joinable, **more)


_JOINS = Request(JOIN, JOIN, description="join()")


@pytest.mark.unit
def test_an_op_is_ready_once_every_member_submitted_it_in_any_order():
    table = Table([0, 1, 2])
    table.add(1, _request("b", fact=10))
    table.add(0, _request("a"))
    table.add(2, _request("b", fact=12))
    assert table.decide() == []
    assert table.waiting_for("b") == [0] and table.submitted() == {"b": [1, 2], "a": [0]}
    table.add(0, _request("b", fact=11))
    items = table.decide()
    assert [(i.answer.names, i.answer.action, i.answer.rank_values) for i in items] == [(["b"], "ok", [11, 10, 12])]
    table.add(1, _request("a"))
    table.add(2, _request("a"))
    assert [i.answer.names for i in table.decide()] == [["a"]]


@pytest.mark.unit
def test_disagreements_and_problems_become_errors_for_every_member():
    table = Table([0, 1])
    table.add(0, _request("allreduce.noname.0", "float32[4]"))
    table.add(1, _request("allreduce.noname.0", "float32[5]"))
    table.add(0, _request("x", problem="bad root"))
    table.add(1, _request("x", problem="bad root"))
    mismatch, problem = (i.answer for i in table.decide())
    assert mismatch.action == "err" and mismatch.error_type == "internal"
    assert mismatch.error.startswith("ranks disagree on the 1st unnamed allreduce: rank 0: allreduce(float32[4]); "
                                     "rank 1: allreduce(float32[5]).")
    assert (problem.error_type, problem.error) == ("value", "bad root")  # every rank had it: said once
    table.add(0, _request("y", problem="bad root"))
    table.add(1, _request("y", problem="root 7 is outside"))
    assert table.decide()[0].answer.error == "rank 0: bad root; rank 1: root 7 is outside"  # each rank's own


@pytest.mark.unit
def test_joined_ranks_are_stood_in_for_and_join_ends_when_all_have_joined():
    layout = Layout(ALL_REDUCE, buckets=(("float32", 4),))
    table = Table([0, 1, 2])
    table.add(2, _JOINS)
    table.add(0, _request("g", joinable=True, layout=layout))
    table.add(1, _request("g", joinable=True, layout=layout))
    (item,) = table.decide()
    assert item.answer.action == "ok" and item.answer.joined == [2] and item.answer.joined_layout == layout
    table.add(0, _request("h"))  # not joinable: fails on the working ranks; rank 2 stays joined
    table.add(1, _request("h"))
    (item,) = table.decide()
    assert item.answer.action == "err" and item.answer.error_type == "internal"
    assert "cannot run while ranks 2 have called hvd.join()" in item.answer.error
    for r in (0, 1):
        table.add(r, _JOINS)
    # 0 and 1 joined together last: the highest
    assert [i.answer for i in table.decide()] == [Answer([JOIN], JOIN, last_joined=1)]


@pytest.mark.unit
def test_a_ranks_next_op_of_a_name_waits_for_the_answer_to_its_first():
    # in a set of two the other member pairs small reductions itself and may send a name's next op early
    table = Table([0, 1])
    table.add(1, _request("a", fact=1))
    table.add(1, _request("a", fact=2))
    table.add(0, _request("a", fact=10))
    assert [i.answer.rank_values for i in table.decide()] == [[10, 1]]
    assert table.submitted() == {"a": [1]}
    table.add(0, _request("a", fact=20))
    table.add(1, _request("a", fact=3))
    table.add(0, _request("a", fact=30))  # both ahead: answered in turn within one decision
    assert [i.answer.rank_values for i in table.decide()] == [[20, 2], [30, 3]]
    assert table.submitted() == {}


@pytest.mark.unit
def test_a_rank_that_joins_after_submitting_an_op_takes_part_in_it():
    table = Table([0, 1, 2])
    table.add(0, _request("g", joinable=True), b"0")
    table.add(0, _JOINS)
    table.add(1, _request("g", joinable=True), b"1")
    table.add(2, _JOINS)
    (item,) = table.decide()  # rank 2 stands in; rank 0 submitted it before joining, so its data counts
    assert item.answer.action == "ok" and item.answer.joined == [2]
    assert [q is not None for q in item.requests] == [True, True, False] and item.payloads == [b"0", b"1", None]
    table.add(0, _request("h"))
    table.add(1, _request("h"))
    (item,) = table.decide()  # not joinable, and rank 2 would have to stand in
    assert item.answer.action == "err" and "cannot run while ranks 2 have called hvd.join()" in item.answer.error
    table.add(0, _request("k"))
    table.add(1, _request("k"))
    table.add(2, _request("k"))  # every member submitted it: nobody stands in
    assert [i.answer.action for i in table.decide()] == ["ok"]
    table.add(0, _request("m", joinable=True))
    table.add(1, _JOINS)  # now every member is inside join(): "m" is answered before the join
    assert [(i.answer.names, i.answer.action, i.answer.joined) for i in table.decide()] == [
        (["m"], "ok", [2, 1]), ([JOIN], JOIN, None)]


@pytest.mark.unit
def test_a_pair_works_out_a_small_reduction_only_where_the_two_requests_agree():
    small = _request("a", inline=16)
    assert pairable(small, replace(small))
    assert not pairable(small, replace(small, signature="float32[5]"))
    assert not pairable(small, replace(small, argument_error="bad")) and not pairable(
        replace(small, argument_error="bad"), small)
    assert not pairable(small, replace(small, inline=0)) and not pairable(_request("a"), _request("a"))
    assert not pairable(small, replace(small, kind="grouped_allreduce")) and not pairable(small, None)


@pytest.mark.unit
def test_ops_ready_together_fuse_by_key_up_to_the_threshold_in_place_of_the_first():
    table = Table([0, 1], fusion_threshold=100)
    keyed = [("a", "k32", 40), ("b", "k64", 40), ("c", "k32", 40), ("d", None, 0), ("e", "k32", 40),
             ("f", "k32", 100)]
    for rank in (1, 0):
        for name, key, nbytes in keyed:
            table.add(rank, _request(name, fusion_key=key, nbytes=nbytes))
    items = table.decide()
    # a and c fill one op (e would pass 100 bytes: it opens the next); f alone is at the threshold already
    assert [item.answer.names for item in items] == [["a", "c"], ["b"], ["d"], ["e"], ["f"]]
    assert all(encode_answer(item.answer).keys() == {"n", "a", "x"} for item in items)  # nothing else travels
    table.add(0, _request("g", fusion_key="k32", nbytes=8))  # no fusion while a rank is joined
    table.add(0, _request("h", fusion_key="k32", nbytes=8))
    table.add(1, _JOINS)
    assert [item.answer.names for item in table.decide()] == [["g"], ["h"]]
    unfused = Table([0, 1])  # threshold 0: every op alone
    for rank in (0, 1):
        for name in "xy":
            unfused.add(rank, _request(name, fusion_key="k32", nbytes=8))
    assert [item.answer.names for item in unfused.decide()] == [["x"], ["y"]]


@pytest.mark.unit
def test_a_request_seen_before_travels_as_its_name_and_number():
    worker, coordinator = RequestCache(2), RequestCache(2)
    first = _request("allreduce.noname.0", layout=Layout(INLINE, "float32", "Sum"), inline=16)
    sent = worker.encode(first)
    assert sent == {**encode_request(first), "c": 0}  # defined whole
    assert coordinator.decode(1, sent) == first
    again = replace(first, name="allreduce.noname.1", rank_value=[3], inline=8)
    assert worker.encode(again) == {"n": "allreduce.noname.1", "c": 0, "x": [3], "i": 8}
    assert coordinator.decode(1, worker.encode(again)) == again
    bad = replace(first, argument_error="bad root")  # a problem always goes whole
    assert worker.encode(bad) == encode_request(bad)
    worker.encode(_request("a", "float32[5]"))
    third = _request("b", "float32[6]")  # over capacity: whole, and no number
    assert worker.encode(third) == encode_request(third) and coordinator.decode(1, worker.encode(third)) == third
    assert RequestCache(0).encode(first) == encode_request(first)


@pytest.mark.unit
def test_every_field_of_a_request_and_an_answer_crosses_the_wire():
    import json

    request = Request("allreduce.g", "allreduce", "Sum|float32[4]", "allreduce(float32[4])", rank_value=[1, 2],
                      argument_error="bad", joinable=True, inline=16, fusion_key="k", nbytes=16,
                      layout=Layout(ALL_REDUCE, cuda=True, buckets=(("float32", 4), ("int32", 2))))
    answers = [Answer(["a", "b"], "ok", [3, None], joined=[1], joined_layout=Layout(INLINE, "float16", "Max"),
                      result=8),
               Answer(["c"], "err", error_type="value", error="bad"), Answer([JOIN], JOIN, last_joined=2)]
    wire = json.loads(json.dumps(encode_frame([encode_request(request)], answers)))  # as a channel carries it
    frame = decode_frame(wire)
    assert [decode_request(r) for r in frame.requests] == [request] and frame.answers == answers
    assert frame.abort is None and decode_frame(encode_frame(abort="why")).abort == "why"
    assert decode_request(encode_request(_JOINS)) == _JOINS and decode_answer(encode_answer(answers[1])) == answers[1]
    assert encode_request(_request("a")) == {"n": "a", "k": "allreduce", "s": "float32[4]",
                                             "d": "allreduce(float32[4])"}  # defaults stay off the wire


@pytest.mark.unit
def test_cache_capacity_is_read_from_horovods_variable(monkeypatch):
    monkeypatch.delenv("HOROVOD_CACHE_CAPACITY", raising=False)
    assert settings.CACHE_CAPACITY.get() == 1024
    monkeypatch.setenv("HOROVOD_CACHE_CAPACITY", "0")
    assert settings.CACHE_CAPACITY.get() == 0
    monkeypatch.setenv("HOROVOD_CACHE_CAPACITY", "lots")
    with pytest.raises(ValueError, match=r"HOROVOD_CACHE_CAPACITY='lots' is not a count of 0 or more; set it to e.g. 1024"):
        settings.CACHE_CAPACITY.get()


@pytest.mark.unit
def test_labels_name_ops_as_users_know_them():
    assert label("allreduce.grads") == "allreduce 'grads'"
    assert label("allgather.noname.21") == "the 22nd unnamed allgather"
    assert label("broadcast.noname.10") == "the 11th unnamed broadcast"


def _engine_cases():
    import time

    import torch

    import sparkhvd.collective.torch as hvd

    hvd.init()
    r = hvd.rank()
    out = {}
    # named async ops submitted in opposite orders on the two ranks pair by name
    if r == 0:
        a = hvd.allreduce_async(torch.ones(3), name="a", op=hvd.Sum)
        b = hvd.allgather_async(torch.full((2,), r), name="b")
    else:
        b = hvd.allgather_async(torch.full((2,), r), name="b")
        a = hvd.allreduce_async(torch.ones(3), name="a", op=hvd.Sum)
    out["opposite"] = (hvd.synchronize(a), hvd.synchronize(b))
    # poll() is False while the peer has not submitted; a barrier in between does not need the op
    h = hvd.allreduce_async(torch.ones(1 << 18), name="late", op=hvd.Sum) if r == 0 else None
    hvd.barrier()
    if r == 0:
        time.sleep(0.3)
        out["polled_before"] = hvd.poll(h)
    hvd.barrier()
    if r == 1:
        h = hvd.allreduce_async(torch.ones(1 << 18), name="late", op=hvd.Sum)
    out["late"] = hvd.synchronize(h)[:2]
    out["polled_after"] = hvd.poll(h)
    # dtypes gloo does not carry travel as bytes, or are reduced through int32
    for dtype in (torch.bool, torch.int8, torch.uint8, torch.int16):
        key = str(dtype).replace("torch.", "")
        value = torch.tensor([r, 1, 0, 1], dtype=torch.int64).to(dtype)
        out[f"broadcast_{key}"] = hvd.broadcast(value, root_rank=1)
        out[f"allgather_{key}"] = hvd.allgather(value[: r + 1])
        out[f"alltoall_{key}"] = hvd.alltoall(value)
        if dtype != torch.bool:
            out[f"allreduce_{key}"] = hvd.allreduce(value, op=hvd.Sum)
        empty = torch.empty(0, 3, dtype=dtype)  # no bytes to view
        out[f"empty_{key}"] = (hvd.alltoall(empty).shape, hvd.allgather(empty).shape, hvd.broadcast(empty, 0).shape)
    empty = torch.empty(0, 3, dtype=torch.uint16)  # a byte view of no bytes cannot be viewed back
    out["empty_uint16"] = (hvd.alltoall(empty).shape, hvd.allgather(empty).shape, hvd.broadcast(empty, 0).shape)
    # a joined rank stands in for a large reduction with zeros; an allgather fails on the working rank only
    if r == 1:
        out["last"] = hvd.join()
    else:
        out["joined_sum"] = hvd.allreduce(torch.full((300_000,), 2.0), op=hvd.Sum)[:2]
        try:
            hvd.allgather(torch.ones(2))
        except hvd.HorovodInternalError as exc:
            out["joined_allgather"] = str(exc)
        out["last"] = hvd.join()
    out["objects"] = hvd.allgather_object(r)  # named by type, as Horovod: not shifted by rank 0's failed allgather
    return out


def test_engine_pairs_by_name_is_truly_async_and_carries_every_dtype():
    v0, v1 = HorovodRunner(np=-2).run_all(_engine_cases).values
    for v in (v0, v1):
        assert torch.equal(v["opposite"][0], torch.full((3,), 2.0))
        assert torch.equal(v["opposite"][1], torch.tensor([0, 0, 1, 1]))
        assert torch.equal(v["late"], torch.full((2,), 2.0)) and v["polled_after"] is True
        for dtype in (torch.bool, torch.int8, torch.uint8, torch.int16):
            key = str(dtype).replace("torch.", "")
            one = torch.tensor([1, 1, 0, 1]).to(dtype)
            assert torch.equal(v[f"broadcast_{key}"], one), key
            assert torch.equal(v[f"allgather_{key}"], torch.tensor([0, 1, 1]).to(dtype)), key
            if dtype != torch.bool:
                assert torch.equal(v[f"allreduce_{key}"], torch.tensor([1, 2, 0, 2]).to(dtype)), key
            assert v[f"empty_{key}"] == (torch.Size([0, 3]),) * 3, key
        assert v["last"] == 0  # rank 1 joined first, rank 0 last
    assert v0["polled_before"] is False
    assert torch.equal(v0["alltoall_int16"], torch.tensor([0, 1, 1, 1], dtype=torch.int16))
    assert torch.equal(v1["alltoall_int8"], torch.tensor([0, 1, 0, 1], dtype=torch.int8))
    assert torch.equal(v0["joined_sum"], torch.full((2,), 2.0))
    assert v0["joined_allgather"].startswith("allgather cannot run while ranks 1 have called hvd.join()")
    assert v0["objects"] == v1["objects"] == [0, 1]
    assert v0["empty_uint16"] == v1["empty_uint16"] == (torch.Size([0, 3]),) * 3


def _pair_cases(fast_path=True):
    import time

    import torch

    import sparkhvd.collective.torch as hvd
    from sparkhvd.collective._engine import communicator as _engine

    hvd.init()
    r = hvd.rank()
    out = {}
    _engine.engine().fast_path = fast_path
    paired, now = _engine.engine().paired_reductions, _engine.engine().reduced_now
    t = torch.zeros(4)
    sums = []
    for i in range(200):  # one name, reused at once: the other member is often an op ahead of the coordinator
        if i % 50 == 0:
            time.sleep(0.05 * r)  # each rank in turn is the one that submits last
        t.fill_(r + i)
        sums.append(hvd.allreduce_(t, op=hvd.Sum, name="same")[0].item())
    out["sums"] = sums
    out["ops"] = [hvd.allreduce(torch.tensor([r + 1.0, -r]), op=op).tolist() for op in (hvd.Average, hvd.Min, hvd.Max,
                                                                                         hvd.Product)]
    out["ints"] = hvd.allreduce(torch.tensor([7, r], dtype=torch.int32), op=hvd.Average).tolist()
    handles = [hvd.allreduce_async(torch.full((3,), float(r * 10 + k)), op=hvd.Sum, name=f"n{k}")
               for k in (range(5) if r == 0 else reversed(range(5)))]
    out["async"] = sorted(hvd.synchronize(h)[0].item() for h in handles)
    try:
        hvd.allreduce(torch.ones(2 + r), name="shapes")
    except hvd.HorovodInternalError as exc:
        out["mismatch"] = str(exc)
    out["paired"] = _engine.engine().paired_reductions - paired
    out["now"] = _engine.engine().reduced_now - now
    # a rank that joins after submitting an op takes part in it with its data
    h = hvd.allreduce_async(torch.tensor([r + 1.0]), op=hvd.Sum, name="before_join")
    if r == 1:
        time.sleep(0.2)  # rank 0 is inside join() when this rank submits the op
        out["before_join"] = hvd.synchronize(h).item()
        out["last"] = hvd.join()
    else:
        out["last"] = hvd.join()
        out["before_join"] = hvd.synchronize(h).item()
    # both submit an op, then join: it is answered before the join, with both ranks' data
    h = hvd.allreduce_async(torch.tensor([r + 1.0]), op=hvd.Sum, name="both_join")
    out["both_last"] = hvd.join()
    out["both_join"] = hvd.synchronize(h).item()
    links = _engine.engine()._links.values()
    out["left"] = [(len(link.waiting), len(link.peer_in), len(link.pair_now), len(link.peer_out)) for link in links]
    return out


@pytest.mark.parametrize("fast_path", [True, False], ids=["in_the_calling_thread", "through_the_turns"])
def test_a_set_of_two_pairs_small_reductions_without_an_answer_and_stays_exact(fast_path):
    v0, v1 = HorovodRunner(np=-2).run_all(_pair_cases, fast_path=fast_path).values
    for v in (v0, v1):
        assert v["sums"] == [float(2 * i + 1) for i in range(200)]
        assert v["ops"] == [[1.5, -0.5], [1.0, -1.0], [2.0, 0.0], [2.0, 0.0]]
        assert v["ints"] == [7, 0]
        assert v["async"] == [10.0, 12.0, 14.0, 16.0, 18.0]
        assert v["mismatch"].startswith("ranks disagree on allreduce 'shapes': rank 0: allreduce(op=Average: "
                                        "float32[2] on cpu); rank 1: allreduce(op=Average: float32[3] on cpu).")
        assert v["before_join"] == 3.0 and v["last"] == 1
        assert v["both_join"] == 3.0 and v["both_last"] in (0, 1)
        assert v["left"] == [(0, 0, 0, 0)]
    # the other member worked out every small reduction itself (the coordinator answered none of them), but not
    # the one the two disagreed on; the coordinator pairs nothing. Blocking ones went mostly without the turns
    # (``Engine.pair_now``), on both members: not the async ones, nor those whose frame came with the next op's
    assert v1["paired"] + v1["now"] == 200 + 4 + 1 + 5 and v0["paired"] == 0
    if fast_path:
        assert v0["now"] > 0 and v1["now"] > 0  # most, on an idle machine (3184 of 3200 in bench/allreduce.py)
    else:
        assert v0["now"] == v1["now"] == 0


def _calling_thread_cases():
    import socket
    import threading
    import time
    import warnings

    import torch

    import sparkhvd.collective.torch as hvd
    from sparkhvd.collective._engine import communicator as _engine
    from sparkhvd.collective._engine import pair

    hvd.init()
    r = hvd.rank()
    engine = _engine.engine()
    pair.WAIT = 0.05  # the engine takes an op over after 50 ms without the other member's frame
    out = {}
    # the other member comes 0.3 s late: the engine takes the op over, with the request already sent
    now = engine.reduced_now
    if r == 1:
        time.sleep(0.3)
    out["late"] = hvd.allreduce_(torch.tensor([r + 1.0, 10.0 * r]), op=hvd.Sum, name="late").tolist()
    out["late_now"] = engine.reduced_now - now
    # another thread submits while this one waits for its peer (who sends nothing for 0.5 s): this one hands its op
    # to the engine at once, which sends the other thread's request, rather than holding the engine for its wait
    hvd.barrier()
    pair.WAIT = 30.0
    if r == 0:
        started = threading.Event()
        link = next(iter(engine._links.values()))

        def background():
            started.wait()
            time.sleep(0.05)
            handle = hvd.allreduce_async(torch.tensor([1.0]), op=hvd.Sum, name="bg")
            time.sleep(0.15)
            out["handed_over"] = "allreduce.fg" in link.waiting
            out["bg"] = hvd.synchronize(handle).item()

        thread = threading.Thread(target=background)
        thread.start()
        started.set()
        out["fg"] = hvd.allreduce(torch.tensor([2.0]), op=hvd.Sum, name="fg").item()
        thread.join()
    else:
        time.sleep(0.5)
        out["fg"] = hvd.allreduce(torch.tensor([2.0]), op=hvd.Sum, name="fg").item()
        out["bg"] = hvd.allreduce(torch.tensor([1.0]), op=hvd.Sum, name="bg").item()
    pair.WAIT = 0.5
    # a frame the socket takes only part of: the engine's turns send the rest, and carry the op on
    link = next(iter(engine._links.values()))
    peer = next(iter(link.channels.values()))
    buffers = [peer.sock.getsockopt(socket.SOL_SOCKET, b) for b in (socket.SO_SNDBUF, socket.SO_RCVBUF)]
    for b in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        peer.sock.setsockopt(socket.SOL_SOCKET, b, 4096)
    hvd.barrier()
    if r == 1:
        time.sleep(0.1)  # rank 0's frame (64 KB) waits in its queue
    now = engine.reduced_now
    out["partial"] = hvd.allreduce_(torch.full((1 << 14,), 1.0 + r), op=hvd.Sum)[[0, -1]].tolist()
    out["partial_now"] = engine.reduced_now - now
    for b, size in zip((socket.SO_SNDBUF, socket.SO_RCVBUF), buffers):
        peer.sock.setsockopt(socket.SOL_SOCKET, b, size // 2)  # Linux reports twice what was set
    hvd.barrier()
    time.sleep(0.05)  # the engine thread done with the turns of the barrier (else the next op goes by the turns)
    # what numpy carries for torch, in every form: dtypes, a strided view, a 0-d tensor, scaling, integer average;
    # rank 1 comes 50 ms after rank 0 each time, so each op goes the calling thread's way on both
    def paced(fn, *args, **kwargs):
        if r == 1:
            time.sleep(0.05)
        return fn(*args, **kwargs)

    now = engine.reduced_now
    base = torch.arange(12, dtype=torch.float64).reshape(3, 4) + r
    paced(hvd.allreduce_, base.t(), op=hvd.Sum)  # not contiguous: reduced in place all the same
    out["strided"] = base.tolist()
    out["int8"] = paced(hvd.allreduce_, torch.tensor([100, -100, 7], dtype=torch.int8), op=hvd.Sum).tolist()
    out["scalar"] = paced(hvd.allreduce_, torch.tensor(3.5 + r), op=hvd.Max).item()
    out["scaled"] = paced(hvd.allreduce_, torch.tensor([1.0, 2.0]), op=hvd.Sum, prescale_factor=2.0,
                          postscale_factor=0.5).tolist()
    out["int_average"] = paced(hvd.allreduce_, torch.tensor([3, -3, 4 + r], dtype=torch.int32)).tolist()
    out["half"] = paced(hvd.allreduce_, torch.tensor([0.1, 1000.0], dtype=torch.float16), op=hvd.Sum).tolist()
    out["bf16"] = paced(hvd.allreduce, torch.tensor([0.1, 3.0], dtype=torch.bfloat16), op=hvd.Average).tolist()
    x = torch.ones(3, requires_grad=True)
    y = paced(hvd.allreduce, x * (r + 1), op=hvd.Sum)
    out["forms_now"] = engine.reduced_now - now
    out["grad"] = torch.autograd.grad(y.sum(), x)[0].tolist()  # its backward is an allreduce too, not paced
    w = torch.ones(2)
    version = w._version
    hvd.allreduce_(w, op=hvd.Sum)
    out["version_bumped"] = w._version > version  # autograd sees the in-place write, as for any in-place op
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an overflow to inf is no warning (numpy's would be), as in torch
        out["overflow"] = hvd.allreduce_(torch.tensor([3e38, -3e38]), op=hvd.Sum).tolist()
    return out


def test_a_blocking_small_reduction_in_the_calling_thread_hands_over_to_the_engine_when_it_must():
    v0, v1 = HorovodRunner(np=-2).run_all(_calling_thread_cases).values
    for r, v in enumerate((v0, v1)):
        assert v["late"] == [3.0, 10.0]
        assert v["fg"] == 4.0 and v["bg"] == 2.0
        assert v["strided"] == (2 * torch.arange(12, dtype=torch.float64).reshape(3, 4) + 1).tolist()
        assert v["int8"] == [-56, 56, 14]  # wrapped, as torch's and gloo's int8 sums wrap
        assert v["scalar"] == 4.5
        assert v["scaled"] == [2.0, 4.0]
        assert v["int_average"] == [3, -3, 4]  # (4 + 5) / 2, truncated
        assert v["half"] == torch.tensor([0.1, 1000.0], dtype=torch.float16).mul(2).tolist()
        assert v["bf16"] == torch.tensor([0.1, 3.0], dtype=torch.bfloat16).tolist()
        assert v["version_bumped"] is True
        assert v["overflow"] == [float("inf"), float("-inf")]
        assert v["grad"] == [2.0 * (r + 1)] * 3  # (the summed gradient of the sum: 2) times this rank's factor
    # the member that came on time waited, then the engine took its op over; the late one found the frame there
    assert v0["late_now"] == 0 and v1["late_now"] == 1
    assert v0["handed_over"] is True
    assert v0["partial"] == v1["partial"] == [3.0, 3.0] and v0["partial_now"] == 0
    # each of the 8 paced forms went the calling thread's way on both ranks, but for the odd one that found the
    # engine thread still inside the turns of the op before (it then goes by the turns)
    assert v0["forms_now"] + v1["forms_now"] >= 12, (v0["forms_now"], v1["forms_now"])


def _claimed_op_and_later_requests(folder):
    import os
    import time

    import torch

    import sparkhvd.collective.torch as hvd

    hvd.init()
    r = hvd.rank()
    done = os.path.join(folder, "a-done")
    if r == 1:  # "a", then 64 MB of later requests that outgrow the socket buffers (32 MB here), then waits for "a" alone
        a = hvd.allreduce_async(torch.ones(4), op=hvd.Sum, name="a")
        later = [hvd.allreduce_async(torch.full((1 << 18,), 1.0), op=hvd.Sum, name=f"b{i}") for i in range(64)]
        value = hvd.synchronize(a).tolist()
        open(done, "w").close()
        return value, [hvd.synchronize(h)[0].item() for h in later]
    value = hvd.allreduce(torch.ones(4), op=hvd.Sum, name="a").tolist()
    deadline = time.monotonic() + 20
    while not os.path.exists(done) and time.monotonic() < deadline:  # blocked outside sparkhvd: nothing read
        time.sleep(0.05)
    in_time = os.path.exists(done)
    later = [hvd.allreduce_async(torch.full((1 << 18,), 1.0), op=hvd.Sum, name=f"b{i}") for i in range(64)]
    return value, [hvd.synchronize(h)[0].item() for h in later], in_time


def test_a_rank_that_finishes_first_still_sends_what_its_peer_is_owed(tmp_path):
    # rank 0 returns while 64 MB of its own requests for rank 1 are still queued: the drain at the rank's exit must
    # send them, or rank 1 fails ("rank 0 closed its control link"). Rank 1's paired "a" waits only for its own request
    # to leave, not for the 64 MB behind it, which rank 0 need not read while it waits outside sparkhvd (whether
    # waiting for them would hang depends on the sockets' buffers, so the test guards the drain above all)
    v0, v1 = HorovodRunner(np=-2).run_all(_claimed_op_and_later_requests, folder=str(tmp_path)).values
    assert v0 == ([2.0] * 4, [2.0] * 64, True) and v1 == ([2.0] * 4, [2.0] * 64)


def _fusion_cases():
    import os

    import torch

    import sparkhvd.collective.torch as hvd
    from sparkhvd.collective._engine import communicator as _engine

    os.environ.update(HOROVOD_CYCLE_TIME="1000", HOROVOD_FUSION_THRESHOLD=str(3 << 20))  # read by init()
    try:
        hvd.init()
    finally:
        del os.environ["HOROVOD_CYCLE_TIME"], os.environ["HOROVOD_FUSION_THRESHOLD"]
    r = hvd.rank()
    n = 300_000  # 1.2 MB: over the inline size at np=2, so each is a gloo op
    hvd.allreduce(torch.ones(1), name="opens_a_cycle")  # answered at once; the next answer waits for the cycle
    handles = [hvd.allreduce_async_(torch.full((n,), float(r + i)), op=op, name=f"t{i}")
               for i, op in enumerate([hvd.Sum, hvd.Sum, hvd.Sum, hvd.Average])]
    handles.append(hvd.allreduce_async_(torch.full((n,), r + 10.0, dtype=torch.float64), op=hvd.Sum, name="t64"))
    results = [hvd.synchronize(h)[:2].tolist() for h in handles]
    works = [id(h._works[0]) for h in handles]
    return {"results": results, "same_op": [works[i] == works[0] for i in range(len(works))],
            "pairs": works[1] == works[0] and works[2] != works[1], "cycle": _engine.engine()._cycle}


def test_separate_allreduces_ready_in_one_cycle_run_as_one_gloo_op():
    for v in HorovodRunner(np=-2).run_all(_fusion_cases).values:
        # t0..t2 (Sum) fill 3 MB in two ops; t3 (Average) and t64 (float64) have keys of their own
        assert v["results"] == [[1.0, 1.0], [3.0, 3.0], [5.0, 5.0], [3.5, 3.5], [21.0, 21.0]]
        assert v["same_op"] == [True, True, False, False, False] and v["pairs"]
        assert v["cycle"] == 1.0


@pytest.mark.unit
def test_cycle_time_is_read_in_milliseconds_and_bad_values_say_what_to_set(monkeypatch):
    monkeypatch.delenv("HOROVOD_CYCLE_TIME", raising=False)
    assert settings.CYCLE_TIME.get() == 0.0
    monkeypatch.setenv("HOROVOD_CYCLE_TIME", "2.5")
    assert settings.CYCLE_TIME.get() == 0.0025
    monkeypatch.setenv("HOROVOD_CYCLE_TIME", "fast")
    with pytest.raises(ValueError, match=r"HOROVOD_CYCLE_TIME='fast' is not a number of milliseconds; set it to e.g. 1"):
        settings.CYCLE_TIME.get()
    monkeypatch.setenv("HOROVOD_CYCLE_TIME", "-1")
    with pytest.raises(ValueError, match=r"HOROVOD_CYCLE_TIME=-1 must be 0 or more milliseconds."):
        settings.CYCLE_TIME.get()


def _answers_larger_than_the_socket(folder):
    import os
    import time

    import torch

    import sparkhvd.collective.torch as hvd

    hvd.init()
    r = hvd.rank()
    # 48 reductions of 512 KB ride inline: the coordinator's answers (24 MB) outgrow the socket's buffer
    handles = [hvd.allreduce_async_(torch.full((1 << 17,), float(r + i)), op=hvd.Sum, name=f"big{i}")
               for i in range(48)]
    sums = [hvd.synchronize(h)[0].item() for h in handles]
    done = os.path.join(folder, "rank1-done")
    if r == 1:
        open(done, "w").close()
        return sums
    # Rank 0's own ops are all answered now, its answers to rank 1 still going out; it submits nothing
    # more, so only its engine can finish sending them.
    deadline = time.monotonic() + 60
    while not os.path.exists(done) and time.monotonic() < deadline:
        time.sleep(0.05)
    return sums if os.path.exists(done) else "rank 1 never got its answers"


def test_the_coordinator_finishes_sending_answers_after_its_own_ops_are_answered(tmp_path):
    for sums in HorovodRunner(np=-2).run_all(_answers_larger_than_the_socket, folder=str(tmp_path)).values:
        assert sums == [float(2 * i + 1) for i in range(48)]


def _waits_interrupted_shared_and_failed():
    import signal
    import threading
    import time

    import torch

    import sparkhvd.collective.torch as hvd

    hvd.init()
    r = hvd.rank()
    out = {}
    # two threads synchronize one handle: finish (the Average's division) runs once
    for n in (4, 300_000):  # inline, then a gloo op
        t = torch.full((n,), 2.0 * (r + 1))  # the average of 2 and 4 is 3
        h = hvd.allreduce_async_(t, name=f"shared{n}")
        if r == 1:
            time.sleep(0.3)
        got = []
        threads = [threading.Thread(target=lambda: got.append(hvd.synchronize(h)[0].item())) for _ in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        out[f"shared{n}"] = (t[0].item(), got)

    # a synchronize interrupted before the answer (Ctrl-C) leaves the name taken: the op is still in flight
    if r == 0:
        class Interrupted(Exception):
            pass

        def interrupt(*_):
            raise Interrupted()

        signal.signal(signal.SIGALRM, interrupt)
        h = hvd.allreduce_async_(torch.ones(4), name="x", op=hvd.Sum)
        signal.setitimer(signal.ITIMER_REAL, 0.3)
        try:
            hvd.synchronize(h)
        except Interrupted:
            pass
        try:
            hvd.allreduce_async_(torch.ones(4), name="x", op=hvd.Sum)
        except ValueError as exc:
            out["reused"] = str(exc)
        waiter = threading.Thread(target=lambda: out.__setitem__("x", hvd.synchronize(h).tolist()), daemon=True)
        waiter.start()
        waiter.join(timeout=60)  # an orphaned handle would never be answered
    else:
        time.sleep(1.0)
        out["x"] = hvd.allreduce_(torch.ones(4), name="x", op=hvd.Sum).tolist()

    # a grouped op that fails frees all its names: the same name works again
    try:
        hvd.synchronize(hvd.grouped_allgather_async([torch.ones(2, 3 + r), torch.ones(2, 3)], name="g"))
    except hvd.HorovodInternalError:
        out["group_failed"] = True
    out["group_again"] = [t.shape[0] for t in hvd.synchronize(
        hvd.grouped_allgather_async([torch.ones(2, 3), torch.ones(2, 3)], name="g"))]
    return out


def test_shared_interrupted_and_failed_waits_leave_names_and_results_right():
    v0, v1 = HorovodRunner(np=-2).run_all(_waits_interrupted_shared_and_failed).values
    for v in (v0, v1):
        assert v["shared4"] == (3.0, [3.0, 3.0]) and v["shared300000"] == (3.0, [3.0, 3.0])
        assert v["x"] == [2.0] * 4
        assert v["group_failed"] is True and v["group_again"] == [4, 4]
    assert v0["reused"].startswith("another allreduce named 'x' is already in flight on this rank")


def _shutdown_while_a_call_blocks(folder):
    import os
    import threading
    import time

    import torch

    import sparkhvd.collective.torch as hvd
    from sparkhvd.collective._engine import communicator as _engine

    hvd.init()
    hvd.allreduce(torch.ones(2), name="warm")
    done = os.path.join(folder, "rank0-done")
    if hvd.rank() == 1:  # never submits "never", and keeps its links open until rank 0 has looked
        deadline = time.monotonic() + 60
        while not os.path.exists(done) and time.monotonic() < deadline:
            time.sleep(0.05)
        return None
    errors = []

    def blocked():
        try:
            hvd.allreduce(torch.ones(4), name="never")
        except Exception as exc:  # noqa: BLE001 - the test reads its type
            errors.append(type(exc).__name__)

    thread = threading.Thread(target=blocked)
    thread.start()
    time.sleep(1)
    engine = _engine.engine()
    hvd.shutdown()  # the blocked call holds the engine's turn; the engine thread must still end
    thread.join(timeout=30)
    alive = engine._thread.is_alive()
    open(done, "w").close()
    return alive, errors


def test_shutdown_while_a_call_blocks_stops_the_engine_thread(tmp_path):
    alive, errors = HorovodRunner(np=-2).run_all(_shutdown_while_a_call_blocks, folder=str(tmp_path)).values[0]
    assert alive is False and errors == ["MeshError"]


def _engine_bug():
    import time

    import torch

    import sparkhvd.collective.torch as hvd
    from sparkhvd.collective._engine import communicator as _engine

    hvd.init()
    r = hvd.rank()
    if r == 0:
        def boom(request, payloads):
            raise RuntimeError("boom")

        _engine.engine()._reduce = boom  # the coordinator's inline reduction: a bug in the engine thread
    h = hvd.allreduce_async_(torch.ones(4), name="first")
    time.sleep(0.5)  # the engine thread, not this one, does the turn that fails
    errors = []
    for start in (lambda: h, lambda: hvd.allreduce_async_(torch.ones(4), name="second")):
        try:
            hvd.synchronize(start())
        except Exception as exc:  # noqa: BLE001 - the test reads type and text
            errors.append((type(exc).__name__, str(exc)))
    return errors


def test_a_bug_in_the_engine_thread_fails_every_op_with_its_cause():
    v0, v1 = HorovodRunner(np=-2).run_all(_engine_bug).values
    assert v0 == [("MeshError", "allreduce failed: the sparkhvd engine thread failed (RuntimeError: boom)"),
                  ("MeshError", "allreduce cannot run: the sparkhvd engine thread failed (RuntimeError: boom)")]
    # rank 1 may have worked out "first" itself from rank 0's bytes (a set of two pairs small reductions) before
    # rank 0's engine failed; "second" fails, naming rank 0
    assert [kind for kind, _ in v1] in (["MeshError"], ["MeshError", "MeshError"])
    assert "rank 0 closed its control link" in v1[-1][1]
