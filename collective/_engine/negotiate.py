"""The coordinator's decisions: which ops every member of a set has submitted, and what each becomes.

Horovod's controller (horovod/common/controller.cc) in a few pages of Python, with no framework in
it. Every member sends its ``Request``s (``messages.py``) to the set's coordinator, the set's lowest
rank. An op is ready once every working member (one not inside ``join()``) has submitted it; ready
ops are answered in the order they became ready, and every member carries them out in that order.
That is the whole ordering rule: ranks may submit in any order, from any thread, and still run the
same collectives in the same order.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..._common.op_names import JOIN, label
from .fusion import fuse
from .join import Joined, refusal
from .messages import ERROR, INTERNAL, OK, VALUE, Answer, Request


@dataclass(slots=True)
class Ready:
    """An answer as the coordinator holds it until it has sent it: with what each member asked for it."""

    answer: Answer
    requests: list  # each member's Request in set order; None for a joined rank that stands in
    payloads: list  # each member's inline bytes in set order (None: none, or the rank stood in)
    fusion_key: str | None = None  # the requests' fusion key where the op may be fused (``fusion.fuse``)
    nbytes: int = 0  # the op's bytes (with fusion_key), counted against the fusion threshold
    ready_at: float | None = None  # when its last request came (wall clock, microseconds), where ``add`` was told


class Table:
    """The coordinator's view of one set: the requests received, by name, in arrival order."""

    def __init__(self, members: list, fusion_threshold: int = 0):
        self.members = list(members)  # global ranks in set order; the coordinator is members[0]
        self.fusion_threshold = fusion_threshold  # bytes of one fused op; 0: no fusion
        self._pending: dict = {}  # name -> {rank: (request, payload)}, in the order names first arrived
        self._later: dict = {}  # name -> [(rank, (request, payload))]: a rank's next op of a name, sent early
        self._arrived: dict = {}  # name -> when its latest request came, while the requests are timed (``add``)
        self.joined = Joined()  # the ranks inside join()

    def add(self, rank: int, request: Request, payload=None, at: float | None = None) -> None:
        """``rank``'s request, with the bytes that rode with it (a small reduction's data); ``at``: when it came (a
        timeline records), which the op's ``Ready`` keeps for its last."""
        if request.kind == JOIN:
            self.joined.add(rank)
            return
        name = request.name
        requests = self._pending.setdefault(name, {})
        if rank in requests or any(r == rank for r, _ in self._later.get(name, ())):
            self._later.setdefault(name, []).append((rank, (request, payload)))  # its next op of the name, early
        else:
            requests[rank] = (request, payload)
            if at is not None:
                self._arrived[name] = at

    def lone(self, name: str) -> bool:
        """Whether the table holds nothing, or only requests for ``name``, with no rank inside join()."""
        return (not self._pending or (len(self._pending) == 1 and name in self._pending)) and not self._later \
            and not self.joined.ranks

    def held(self, name: str, rank: int):
        """``rank``'s (request, payload) for ``name``, if the table holds it."""
        return self._pending.get(name, {}).get(rank)

    def forget(self, name: str) -> None:
        """``name`` was worked out without the table (``Engine.pair_now``): as if answered."""
        del self._pending[name]
        self._arrived.pop(name, None)
        self.joined.op_answered()

    def waiting_for(self, name: str) -> list:
        """The working members that have not submitted ``name`` (a diagnostic for the stall report)."""
        have = self._pending.get(name, {})
        return [r for r in self.members if r not in have and r not in self.joined.ranks]

    def submitted(self) -> dict:
        """Every name in the table and the ranks that submitted it (the stall report's facts)."""
        return {name: sorted(reqs) for name, reqs in self._pending.items()}

    def decide(self) -> list:
        """The ``Ready`` answers for every op that is ready now, in order; the table forgets them."""
        ready = []
        working = [r for r in self.members if r not in self.joined.ranks]
        names = list(self._pending)
        for name in names:  # grows while it runs: a name's next op may be ready as soon as this one is answered
            requests = self._pending[name]
            if any(r not in requests for r in working):  # every member submitted it or is inside join()
                continue
            del self._pending[name]
            ready.append(self._answer(name, requests))
            ready[-1].ready_at = self._arrived.pop(name, None)
            self.joined.op_answered()
            if self._promote(name):
                names.append(name)
        if self.fusion_threshold:
            ready = fuse(ready, self.fusion_threshold)
        if self.joined.all_in(self.members):
            ready.append(Ready(self.joined.end(), [], []))
        return ready

    def _promote(self, name: str) -> bool:
        """The next op of ``name`` from each rank that sent one early takes the answered one's place."""
        later = self._later.pop(name, None)
        if not later:
            return False
        requests, rest = {}, []
        for rank, submitted in later:
            if rank in requests:
                rest.append((rank, submitted))
            else:
                requests[rank] = submitted
        self._pending[name] = requests
        if rest:
            self._later[name] = rest
        return True

    def _answer(self, name: str, submitted: dict) -> Ready:
        """Every member that submitted the op takes part in it, one that called join() afterwards too; the
        joined ones that did not submit it stand in."""
        ordered = [(r, submitted[r][0]) for r in self.members if r in submitted]
        problems = [(r, q.argument_error) for r, q in ordered if q.argument_error]
        if problems:
            return _error(name, VALUE, _problem_text(problems, len(ordered)))
        if len({q.signature for _, q in ordered}) > 1:
            return _error(name, INTERNAL, _disagreement(ordered))
        standing_in = [r for r in self.joined.ranks if r not in submitted]
        first = ordered[0][1]
        if standing_in and not first.joinable:
            return _error(name, INTERNAL, refusal(first.kind, standing_in))
        values, requests, payloads = [], [], []
        for r in self.members:
            request, payload = submitted.get(r, (None, None))
            values.append(None if request is None else request.rank_value)
            requests.append(request)
            payloads.append(payload)
        ready = Ready(Answer([name], OK, values), requests, payloads)
        if standing_in:
            ready.answer.joined, ready.answer.joined_layout = standing_in, first.layout
        elif first.fusion_key is not None:
            ready.fusion_key, ready.nbytes = first.fusion_key, first.nbytes
        return ready


def _error(name: str, error_type: str, text: str) -> Ready:
    return Ready(Answer([name], ERROR, error_type=error_type, error=text), [], [])


def _problem_text(problems: list, members: int) -> str:
    """One message if every member hit the same problem, else each rank's."""
    texts = {p for _, p in problems}
    if len(texts) == 1 and len(problems) == members:
        return texts.pop()
    return "; ".join(f"rank {r}: {p}" for r, p in problems)


def _disagreement(ordered: list) -> str:
    groups: dict = {}
    for rank, request in ordered:
        groups.setdefault(request.description, []).append(rank)
    listing = "; ".join(f"rank{'s' if len(ranks) > 1 else ''} {','.join(map(str, ranks))}: {text}"
                        for text, ranks in groups.items())
    first = ordered[0][1]
    rule = ("the same dtype, device and dimensions after the first" if first.kind in ("allgather", "alltoall")
            else "the same dtype, device and shape")
    hint = ""
    if any(text.startswith("DistributedOptimizer") for text in groups):
        hint = (" Each DistributedOptimizer bucket is matched by its name: two ranks whose models or bucket sizes "
                "differ cut different buckets; build the same model and optimizer on every rank.")
    return (f"ranks disagree on {label(first.name)}: {listing}. Every rank must call the ops of a name (unnamed "
            f"ops are matched in the order each rank calls them) with {rule} (and the same op and root_rank).{hint}")
