"""torch.distributed's own collectives in this process, as the stall report sees them: read from torch's flight
recorder (``TORCH_FR_BUFFER_SIZE``, which the runner sets in every rank's environment, runner/_agent/env.py).

A function that calls ``dist.all_reduce`` or trains under DDP, FSDP, Lightning or Hugging Face never calls
sparkhvd's collectives, so ``progress.py`` sees nothing of it. The flight recorder keeps each process group's
collectives with their sequence number (alike on every member: c10d matches them in call order), their op, shapes
and dtypes, and whether they finished; ``snapshot`` turns the unfinished ones into the same records as
``progress.py``'s, so the driver's report says which ranks wait in which op and what the others do instead.

Groups sparkhvd's engine made (``hvd.init()``'s) are left out (``ignore_group``): the engine reports its ops by
name. torch is imported by the function, never here: without ``torch.distributed`` loaded there is nothing to read.
"""

from __future__ import annotations

import json
import sys
import time

BUFFER_SIZE = 256  # flight-recorder entries per process; the stalled op is the newest, so a small ring keeps it
_DUMPS = ("_dump_fr_trace_json", "_dump_nccl_trace_json")  # gloo's (and the generic) recorder, NCCL's own
_last_done = None  # the finished count at the previous snapshot
_ignored: set = set()  # process-group names whose ops the engine reports itself


def ignore_group(name: str) -> None:
    """Leave the process group ``name``'s collectives out: sparkhvd's engine reports them by their names."""
    _ignored.add(str(name))


def forget_ignored() -> None:
    """``hvd.shutdown()``: the engine's groups are gone; a later group may reuse their names."""
    _ignored.clear()


def snapshot() -> tuple[list, int]:
    """``(ops, done)``: this process's unfinished torch.distributed collectives as ``progress.snapshot``'s ops
    (oldest first), and how many it has finished (a count that grows while collectives complete); nothing where
    torch.distributed is not in use. gloo's and NCCL's recorders are read (NCCL keeps its own). While the count
    moves, only each group's counts are read (cheap); the unfinished ops, only once it stands still."""
    global _last_done
    dist = sys.modules.get("torch.distributed")
    if dist is None or getattr(getattr(dist, "__spec__", None), "_initializing", False):
        return [], 0  # not imported, or being imported on the main thread now: not yet in use either
    if not dist.is_available() or not dist.is_initialized():
        return [], 0
    try:
        import torch._C._distributed_c10d as c10d

        dumps = [f for f in (getattr(c10d, name, None) for name in _DUMPS) if f is not None]
        done = sum(parse(json.loads(dump(includeCollectives=False)), 0)[1] for dump in dumps)
        if done != _last_done:  # progress since the last heartbeat: nothing stalls
            _last_done = done
            return [], done
        ops = []
        now = time.time_ns()
        for dump in dumps:
            ops += parse(json.loads(dump(includeCollectives=True, onlyActive=True)), now)[0]
    except Exception:  # noqa: BLE001 - a diagnostic: a torch whose recorder differs reports nothing, never fails
        return [], 0
    ops.sort(key=lambda op: -op["age"])
    return ops, done


def parse(trace: dict, now_ns: int) -> tuple[list, int]:
    """``snapshot``'s answer from a flight-recorder dump (``_dump_fr_trace_json``) taken at ``now_ns``."""
    done = 0  # every group's, the engine's too: any finished collective is progress
    for status in (trace.get("pg_status") or {}).values():
        done += max(0, _int(status.get("last_completed_collective"), -1))
    members = {str(c.get("name")): c.get("ranks") for c in (trace.get("pg_config") or {}).values()
               if isinstance(c, dict) and c.get("name")}
    ops = []
    for entry in trace.get("entries") or ():
        group = (entry.get("process_group") or [""])[0]
        if entry.get("retired") or entry.get("state") == "completed" or entry.get("is_p2p") or group in _ignored:
            continue
        backend, _, op = str(entry.get("profiling_name") or "collective").rpartition(":")
        shapes = ", ".join(f"{dtype}{list(size)}" for dtype, size in zip(entry.get("input_dtypes") or (),
                                                                        entry.get("input_sizes") or ()))
        detail = ", ".join(p for p in (backend, shapes[:200]) if p)
        ops.append({"kind": f"torch.distributed.{op}" + (f" ({detail})" if detail else ""), "name": None,
                    "set": _ranks(members.get(group)), "link": f"torch/{group}", "seq": _int(entry.get("collective_seq_id"), 0),
                    "phase": "check", "age": round(max(0, now_ns - _int(entry.get("time_created_ns"), now_ns)) / 1e9, 3)})
    ops.sort(key=lambda op: -op["age"])
    return ops, done


def _ranks(text) -> list | None:
    """A group's members as the dump writes them ("[0, 1]"); None (every rank) where it does not say."""
    try:
        ranks = json.loads(text) if isinstance(text, str) else text
    except ValueError:
        return None
    return [int(r) for r in ranks] if isinstance(ranks, list) and ranks else None


def _int(value, default: int) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return default
