"""``hvd.join()``: a rank out of data stands in for itself, with zeros, in the others' reductions.

On the coordinator, ``Joined`` counts the ranks inside ``join()``: an op is ready once every member
not inside it has submitted it, the joined ranks that did not submit it stand in (``Answer.joined``),
and ``join()`` ends, on every member at once, when every member is inside it. On a joined member,
``stand_in`` starts its part in such an op (the core's ``zeros_for_joined_rank``: zeros of the data
op's ``Layout``), and ``finish_join`` answers its ``join()`` once those are done.
"""

from __future__ import annotations

from ..._common.op_names import JOIN
from .messages import Answer
from .ops import settle

_JOINABLE_HINT = ("only allreduce and grouped_allreduce with op=Average or Sum, DistributedOptimizer and "
                  "SyncBatchNorm take part in join (as in Horovod); the joined ranks go on waiting in join().")


class Joined:
    """The coordinator's count of one set's ranks inside ``join()``."""

    def __init__(self):
        self.ranks: list = []  # ranks inside join(), in the order they joined
        self._together: list = []  # ranks that joined since the latest answered op

    def add(self, rank: int) -> None:
        self.ranks.append(rank)
        self._together.append(rank)

    def op_answered(self) -> None:
        """An op was answered: ranks that join from now on joined after it."""
        self._together = []

    def all_in(self, members: list) -> bool:
        return bool(self.ranks) and len(self.ranks) == len(members)

    def end(self) -> Answer:
        """Every member is inside join(): it returns the rank that joined last (the highest of those that joined
        together last, as Horovod's), and the count starts afresh."""
        last = max(self._together) if self._together else self.ranks[-1]
        self.ranks, self._together = [], []
        return Answer([JOIN], JOIN, last_joined=last)


def refusal(kind: str, standing_in: list) -> str:
    """The error of an op that ranks inside join() cannot stand in for."""
    joined = ",".join(map(str, standing_in))
    return f"{kind} cannot run while ranks {joined} have called hvd.join(); {_JOINABLE_HINT}"


def stand_in(link, answer: Answer, zeros_for_joined_rank) -> None:
    """This rank is inside join() and did not submit the op ``answer`` runs: start its zeros in it."""
    link.joined_works.extend(zeros_for_joined_rank(answer.joined_layout, link.group))


def finish_join(link, answer: Answer) -> None:
    """Every member is inside join(): once this rank's zeros are done, its join() returns the last rank."""
    handle = link.waiting.pop(JOIN, None)
    for work in link.joined_works:
        work.wait()
    link.joined_works = []
    if handle is not None:
        settle(handle, [], lambda last=answer.last_joined: last)
