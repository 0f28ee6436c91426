"""Tensor fusion (Horovod's): ready ops of one fusion key run as one data op.

The coordinator fuses the ops that became ready together whose requests carry the same
``fusion_key`` (one backend's kind, dtype, device, op and scaling, on one set) into one answer, up to
``HOROVOD_FUSION_THRESHOLD`` bytes, at the place of the first (``fuse``). Every member carries out the
same answers, so the order stays agreed; each calls the backend's ``launch_fused`` once for them all
(``carry_out_fused``).
"""

from __future__ import annotations

from .ops import fail, settle


def fuse(ready: list, threshold: int) -> list:
    """``ready`` (the coordinator's ``Ready`` answers, in order) with the fusable ones of equal keys joined, each
    at most ``threshold`` bytes: an op that would pass it starts the next."""
    fused, open_by_key, filled = [], {}, {}  # key -> the Ready still taking ops of that key, and its bytes
    for item in ready:
        key = item.fusion_key
        host = open_by_key.get(key) if key is not None else None
        if host is not None and filled[key] + item.nbytes <= threshold:
            host.answer.names.extend(item.answer.names)
            filled[key] += item.nbytes
            if item.ready_at is not None:  # the fused op waited for its last
                host.ready_at = max(host.ready_at or 0.0, item.ready_at)
            continue
        if host is not None:  # full: it takes no more
            del open_by_key[key]
        if key is not None and item.nbytes < threshold:
            open_by_key[key], filled[key] = item, item.nbytes
        fused.append(item)
    return fused


def carry_out_fused(link, answer) -> None:
    """Ops the coordinator fused (one key, so one backend's kind): one data op for them all."""
    handles = [link.waiting.pop(name) for name in answer.names]
    try:
        launched = handles[0].op.launch_fused([h.op for h in handles], answer)
    except BaseException as exc:  # noqa: BLE001 - each caller's synchronize raises it
        for handle in handles:
            fail(handle, exc)
        return
    for handle, (works, finish) in zip(handles, launched):
        settle(handle, works, finish)
