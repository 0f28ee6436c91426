"""Process sets: subgroups of ranks that run collectives among themselves."""

from __future__ import annotations

import torch.distributed as dist

from ..._common import torch_ops as _torch_ops
from .._engine import communicator as _engine


class ProcessSet:
    """A set of ranks. ``global_process_set`` holds every rank.

    Collectives take ``process_set=``. ``rank()`` counts from 0 in the order of ``ranks`` (useful
    to find this rank's part of an allgather), but ``root_rank`` arguments stay job-wide ranks
    (``hvd.rank()``), as in Horovod. A set is usable once ``add_process_set`` (or
    ``init(process_sets=...)``) registered it on every rank.
    """

    def __init__(self, ranks):
        self.ranks = sorted(set(int(r) for r in ranks)) if ranks is not None else None
        if ranks is not None and len(self.ranks) != len(list(ranks)):
            raise ValueError(f"process set ranks {list(ranks)} contain duplicates; list each rank once.")
        self.process_set_id: int | None = None
        self.group = None  # the c10d group; None means the default (global) group
        self.link_id = 0  # names the set's control links (``collective/_engine/mesh.py``); never reused within a job

    def _check(self) -> None:
        """Raise unless the job is initialized and this set is registered."""
        _engine.topology()
        if self.process_set_id is None:
            raise ValueError(f"process set {self.ranks} has not been added; call hvd.add_process_set() on "
                             "every rank first (or pass it to hvd.init(process_sets=...)).")

    def size(self) -> int | None:
        """The number of ranks in the set; None until it is registered (as in Horovod)."""
        if self.process_set_id is None:
            return None
        return _engine.topology().size if self.ranks is None else len(self.ranks)

    def rank(self) -> int | None:
        """This process's rank within the set; None until it is registered (as in Horovod)."""
        if self.process_set_id is None:
            return None
        me = _engine.topology().rank
        if self.ranks is None:
            return me
        if me not in self.ranks:
            raise ValueError(f"rank {me} is not a member of process set {self.ranks}, so it has no rank in it; "
                             "check process_set.included() first.")
        return self.ranks.index(me)

    def included(self) -> bool | None:
        """Whether this process is a member; None while the set's ranks are unknown (as in Horovod)."""
        if self.ranks is None:
            return None if self.process_set_id is None else True
        return _engine.topology().rank in self.ranks

    def __repr__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks or 'all'})"


global_process_set = ProcessSet(None)
global_process_set.process_set_id = 0
_sets: dict[int, ProcessSet] = {0: global_process_set}
_links_made = 0  # sets added so far: every rank counts alike, as every rank adds every set


def add_process_set(process_set) -> ProcessSet:
    """Register a process set (a ProcessSet or a list of ranks). Call it on every rank, in the same order."""
    ps = process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set)
    size = _engine.topology().size
    bad = [r for r in ps.ranks or [] if not 0 <= r < size]
    if bad or not ps.ranks:
        raise ValueError(f"process set ranks {ps.ranks} must be a non-empty list of ranks in 0..{size - 1}.")
    for existing in _sets.values():
        if existing.ranks == ps.ranks:
            raise ValueError(f"a process set with ranks {ps.ranks} already exists (id {existing.process_set_id}).")
    global _links_made
    ps.group = dist.new_group(ps.ranks)  # collective over every rank, members or not
    if ps.group not in (None, dist.GroupMember.NON_GROUP_MEMBER):  # the engine names its ops: the stall report
        _torch_ops.ignore_group(ps.group.group_name)  # takes them from it, not from torch's flight recorder
    _links_made += 1
    ps.link_id = _links_made
    ps.process_set_id = max(_sets) + 1
    _sets[ps.process_set_id] = ps
    if _engine.topology().rank in ps.ranks and len(ps.ranks) > 1:
        _engine.add_links(ps.link_id, ps.ranks, ps.group)  # every member makes them here, together
    return ps


def require_member(process_set: ProcessSet, what: str) -> None:
    """Raise unless this process is a member of ``process_set``."""
    if not isinstance(process_set, ProcessSet):
        raise ValueError(f"process_set must be a ProcessSet, got {type(process_set).__name__}.")
    process_set._check()
    if not process_set.included():
        raise ValueError(f"{what}: rank {_engine.topology().rank} is not in process set {process_set.ranks}; "
                         "call a process set's collectives only on its members.")


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregister a process set on this rank. Returns False if it was not registered, and for
    the global set, which cannot be removed (as in Horovod)."""
    if process_set is global_process_set:
        return False
    if _sets.pop(process_set.process_set_id, None) is None:
        return False
    if process_set.group is not None and process_set.included():
        dist.destroy_process_group(process_set.group)
        _engine.forget_links(process_set.link_id)
    process_set.group = None
    process_set.process_set_id = None
    return True


def _reset() -> None:
    """Forget every set but the global one (at shutdown)."""
    for ps in list(_sets.values()):
        if ps is not global_process_set:
            ps.group, ps.process_set_id = None, None
    global_process_set.ranks = None  # known again at the next init
    _sets.clear()
    _sets[0] = global_process_set
