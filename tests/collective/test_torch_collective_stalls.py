"""A rank that waits in one of torch.distributed's own collectives (DDP's, FSDP's, ``dist.all_reduce``) is named in
the stall report with the op, its shapes, and what the ranks that have not reached it do instead; read from torch's
flight recorder (_common/torch_ops.py), which every rank has on."""

from __future__ import annotations

import pytest

from sparkhvd import HorovodRunError, HorovodRunner
from sparkhvd._common import torch_ops

# What rank 0 of two dumped (torch 2.13, gloo) while it waited in its second all_reduce and rank 1 slept.
DUMP = {
    "entries": [
        {"collective_seq_id": 1, "input_dtypes": ["Float"], "input_sizes": [[3]], "is_p2p": False,
         "process_group": ["0", "default_pg"], "profiling_name": "gloo:all_reduce", "retired": True,
         "state": "scheduled", "time_created_ns": 1_000_000_000},
        {"collective_seq_id": 2, "input_dtypes": ["Float"], "input_sizes": [[1000]], "is_p2p": False,
         "process_group": ["0", "default_pg"], "profiling_name": "gloo:all_reduce", "retired": False,
         "state": "scheduled", "time_created_ns": 2_000_000_000},
        {"collective_seq_id": 0, "p2p_seq_id": 1, "is_p2p": True, "process_group": ["0", "default_pg"],
         "profiling_name": "gloo:send", "retired": False, "time_created_ns": 2_000_000_000},
        {"collective_seq_id": 7, "input_dtypes": ["Long"], "input_sizes": [[2, 2]], "is_p2p": False,
         "process_group": ["3", "sub"], "profiling_name": "gloo:broadcast", "retired": False,
         "time_created_ns": 4_000_000_000},
    ],
    "pg_config": {"x": {"desc": "sub", "name": "3", "ranks": "[0, 2]"}},
    "pg_status": {"0": {"last_completed_collective": "1", "last_enqueued_collective": "2"},
                  "3": {"last_completed_collective": "6"}},
}


@pytest.mark.unit
def test_a_heartbeat_while_the_main_thread_imports_torch_distributed_reads_nothing_of_it(monkeypatch):
    """A heartbeat in the middle of ``import torch`` once failed on the partly imported module ("partially initialized
    module 'torch.distributed' has no attribute 'is_initialized'"): a module still importing is not in use yet."""
    import importlib.machinery
    import sys
    import types

    half = types.ModuleType("torch.distributed")  # as the import system holds it while it runs: no functions yet
    half.__spec__ = importlib.machinery.ModuleSpec("torch.distributed", None)
    half.__spec__._initializing = True
    monkeypatch.setitem(sys.modules, "torch.distributed", half)
    assert torch_ops.snapshot() == ([], 0)


@pytest.mark.unit
def test_the_flight_recorders_unfinished_collectives_become_the_reports_records():
    ops, done = torch_ops.parse(DUMP, now_ns=5_000_000_000)
    assert done == 7  # every group's finished collectives: progress while the count moves
    assert ops == [
        {"kind": "torch.distributed.all_reduce (gloo, Float[1000])", "name": None, "set": None, "link": "torch/0",
         "seq": 2, "phase": "check", "age": 3.0},  # oldest first; the finished one and the send are left out
        {"kind": "torch.distributed.broadcast (gloo, Long[2, 2])", "name": None, "set": [0, 2], "link": "torch/3",
         "seq": 7, "phase": "check", "age": 1.0},
    ]
    torch_ops.ignore_group("0")  # hvd.init()'s group: the engine reports its ops by name
    try:
        ops, done = torch_ops.parse(DUMP, now_ns=5_000_000_000)
        assert [op["link"] for op in ops] == ["torch/3"] and done == 7  # its progress still counts
    finally:
        torch_ops.forget_ignored()


def _waits_alone_in_an_all_reduce():
    import time

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    dist.all_reduce(torch.ones(4))
    if dist.get_rank() == 0:
        dist.all_reduce(torch.ones(1000))  # rank 1 never calls it
    else:
        time.sleep(120)


def test_a_rank_waiting_in_a_torch_collective_is_reported_with_the_op_and_the_missing_rank(monkeypatch, capsys):
    monkeypatch.setenv("HOROVOD_STALL_CHECK_TIME_SECONDS", "2")
    monkeypatch.setenv("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "3")
    monkeypatch.setenv("SPARKHVD_HEARTBEAT_SECONDS", "0.5")
    with pytest.raises(HorovodRunError) as failure:
        HorovodRunner(np=-2).run(_waits_alone_in_an_all_reduce)
    text = str(failure.value)
    assert "no collective has completed for" in text
    assert ("- torch.distributed.all_reduce (gloo, Float[1000]) on all ranks: rank 0 has waited in it for" in text), text
    assert ("rank 1 has not reached it: it is running user code (its latest collective, torch.distributed's "
            "collective #1, has finished)") in text, text
