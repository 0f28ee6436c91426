"""The coordinator's decisions: which ops every member of a set has submitted, and what each becomes.

Horovod's controller (horovod/common/controller.cc) in a few pages of Python, with no framework in
it. Every member sends its requests (one per op: its name, kind, signature, description and
per-rank facts) to the set's coordinator, the set's lowest rank. An op is ready once every
working member (one not inside ``join()``) has submitted it; ready ops are answered in the
order they became ready, and every member carries them out in that order. That is the whole
ordering rule: ranks may submit in any order, from any thread, and still run the same
collectives in the same order.

A request is a dict:

- ``n`` name (matched across ranks), ``k`` kind ("allreduce", ...)
- ``s`` signature: must be equal on every working member (dtype, shape, op, root, ...)
- ``d`` readable description of what this rank passed, for the error when signatures differ
- ``x`` this rank's own fact that may differ (allgather's first dimension, alltoall's splits)
- ``p`` what is wrong with this rank's arguments, or None: every member then raises
- ``j`` whether a joined rank may stand in for the op (contributes zeros or nothing)
- ``i`` bytes of data that ride in the request (a small reduction), 0 for none
- ``f`` fusion key, or absent: ops ready together with equal keys (equal on every member whose
  signatures agree) may be carried out as one data op; ``b`` the op's bytes

A response item is a dict: ``n`` the names it covers (several: fused ops, carried out as one),
``a`` the action ("ok", "err" or "join"), and for "ok": ``x`` every member's fact in set order
(the first op's, when fused), ``J`` the joined ranks (who
mirror the op), ``m`` a working member's signature-bearing request (what joined ranks mirror);
for "err": ``t`` ("value" for bad arguments, "internal" for ranks that disagree) and ``e``
the message; for "join": ``x`` the rank that joined last.
"""

from __future__ import annotations

from ..._common.op_names import JOIN, label

_JOINABLE_HINT = ("only allreduce and grouped_allreduce with op=Average or Sum, DistributedOptimizer and "
                  "SyncBatchNorm take part in join (as in Horovod); the joined ranks go on waiting in join().")


class Table:
    """The coordinator's view of one set: the requests received, by name, in arrival order."""

    def __init__(self, members: list, fusion_threshold: int = 0):
        self.members = list(members)  # global ranks in set order; the coordinator is members[0]
        self.fusion_threshold = fusion_threshold  # bytes of one fused op; 0: no fusion
        self._pending: dict = {}  # name -> {rank: request}, in the order names first arrived
        self._later: dict = {}  # name -> [(rank, request)]: a rank's next op of a name, sent before this one's answer
        self._joined: list = []  # ranks inside join(), in the order they joined
        self._join_batch: list = []  # ranks that joined since the latest answered op ("together")

    def add(self, rank: int, request: dict) -> None:
        if request["k"] == JOIN:
            self._joined.append(rank)
            self._join_batch.append(rank)
            return
        name = request["n"]
        requests = self._pending.setdefault(name, {})
        if rank in requests or any(r == rank for r, _ in self._later.get(name, ())):
            self._later.setdefault(name, []).append((rank, request))  # its next op of the name, sent early
        else:
            requests[rank] = request

    def waiting_for(self, name: str) -> list:
        """The working members that have not submitted ``name`` (a diagnostic for the stall report)."""
        have = self._pending.get(name, {})
        return [r for r in self.members if r not in have and r not in self._joined]

    def submitted(self) -> dict:
        """Every name in the table and the ranks that submitted it (the stall report's facts)."""
        return {name: sorted(reqs) for name, reqs in self._pending.items()}

    def decide(self) -> list:
        """The response items for every op that is ready now, in order; the table forgets them."""
        items = []
        working = [r for r in self.members if r not in self._joined]
        names = list(self._pending)
        for name in names:  # grows while it runs: a name's next op may be ready as soon as this one is answered
            requests = self._pending[name]
            if any(r not in requests for r in working):  # every member submitted it or is inside join()
                continue
            del self._pending[name]
            items.append(self._answer(name, requests))
            self._join_batch = []
            if self._promote(name):
                names.append(name)
        items = self._fuse(items)
        if self._joined and len(self._joined) == len(self.members):
            last = max(self._join_batch) if self._join_batch else self._joined[-1]
            items.append({"n": [JOIN], "a": JOIN, "x": last})
            self._joined, self._join_batch = [], []
        return items

    def _promote(self, name: str) -> bool:
        """The next op of ``name`` from each rank that sent one early takes the answered one's place."""
        later = self._later.pop(name, None)
        if not later:
            return False
        requests, rest = {}, []
        for rank, request in later:
            if rank in requests:
                rest.append((rank, request))
            else:
                requests[rank] = request
        self._pending[name] = requests
        if rest:
            self._later[name] = rest
        return True

    def _fuse(self, items: list) -> list:
        """Ready ops with the same fusion key become one item (Horovod's tensor fusion), up to the threshold in
        bytes, at the place of the first; every member carries out the same list, so the order stays agreed."""
        fused, open_items = [], {}  # key -> the item still taking ops of that key
        for item in items:
            key, nbytes = item.pop("_f", None), item.pop("_b", 0)
            host = open_items.get(key) if key is not None else None
            if host is not None and host["_b"] + nbytes <= self.fusion_threshold:
                host["n"].extend(item["n"])
                host["_b"] += nbytes
                continue
            if host is not None:  # full: it takes no more
                del open_items[key], host["_b"]
            if key is not None and nbytes < self.fusion_threshold:
                item["_b"] = nbytes
                open_items[key] = item
            fused.append(item)
        for item in open_items.values():
            del item["_b"]
        return fused

    def _answer(self, name: str, requests: dict) -> dict:
        """Every member that submitted the op takes part in it, one that called join() afterwards too; the
        joined ones that did not submit it stand in."""
        ordered = [(r, requests[r]) for r in self.members if r in requests]
        problems = [(r, q["p"]) for r, q in ordered if q.get("p")]
        if problems:
            return _error(name, "value", _problem_text(problems, len(ordered)))
        if len({q["s"] for _, q in ordered}) > 1:
            return _error(name, "internal", _disagreement(ordered))
        standing_in = [r for r in self._joined if r not in requests]
        first = ordered[0][1]
        if standing_in and not first.get("j"):
            joined = ",".join(map(str, standing_in))
            return _error(name, "internal", f"{first['k']} cannot run while ranks {joined} have called "
                                            f"hvd.join(); {_JOINABLE_HINT}")
        facts = [requests[r].get("x") if r in requests else None for r in self.members]
        item = {"n": [name], "a": "ok", "x": facts, "_requests": [requests.get(r) for r in self.members]}
        if standing_in:
            item["J"] = standing_in
            item["m"] = first
        elif self.fusion_threshold and ordered[0][1].get("f") is not None:
            item["_f"], item["_b"] = ordered[0][1]["f"], ordered[0][1].get("b", 0)
        return item


class RequestCache:
    """Horovod's response cache, on the request side: a steady-state op travels as its name and a number.

    A worker's first request of a kind, signature and description goes whole, with a number (``c``);
    later ones carry only ``n``, ``c`` and what may differ (``x``, ``i``), and the coordinator fills in
    the rest from what that worker defined. Links keep frames in order, so a definition always arrives
    before its first use. A backend must keep the rest of a request equal for equal kind, signature and
    description; a request with a problem (``p``) always goes whole. At most ``capacity`` definitions
    per link (``HOROVOD_CACHE_CAPACITY``; 0: none).
    """

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._numbers: dict = {}  # on a worker: (kind, signature, description) -> number
        self._defined: dict = {}  # on the coordinator: (peer, number) -> that peer's whole request

    def shorten(self, request: dict) -> dict:
        """What a worker sends for ``request``."""
        if request.get("p") is not None or not self.capacity:
            return request
        key = (request["k"], request["s"], request["d"])
        number = self._numbers.get(key)
        if number is None:
            if len(self._numbers) >= self.capacity:
                return request
            number = self._numbers[key] = len(self._numbers)
            return {**request, "c": number}
        short = {"n": request["n"], "c": number}
        if request.get("x") is not None:
            short["x"] = request["x"]
        if request.get("i"):
            short["i"] = request["i"]
        return short

    def expand(self, peer: int, request: dict) -> dict:
        """The whole request from what ``peer`` sent."""
        number = request.get("c")
        if number is None:
            return request
        if "k" in request:
            self._defined[(peer, number)] = request
            return dict(request)
        whole = dict(self._defined[(peer, number)])
        whole.update(n=request["n"], x=request.get("x"), i=request.get("i", 0))
        return whole


def _error(name: str, kind: str, text: str) -> dict:
    return {"n": [name], "a": "err", "t": kind, "e": text}


def _problem_text(problems: list, members: int) -> str:
    """One message if every member hit the same problem, else each rank's."""
    texts = {p for _, p in problems}
    if len(texts) == 1 and len(problems) == members:
        return texts.pop()
    return "; ".join(f"rank {r}: {p}" for r, p in problems)


def _disagreement(ordered: list) -> str:
    groups: dict = {}
    for rank, request in ordered:
        groups.setdefault(request["d"], []).append(rank)
    listing = "; ".join(f"rank{'s' if len(ranks) > 1 else ''} {','.join(map(str, ranks))}: {text}"
                        for text, ranks in groups.items())
    kind = ordered[0][1]["k"]
    rule = ("the same dtype, device and dimensions after the first" if kind in ("allgather", "alltoall")
            else "the same dtype, device and shape")
    hint = ""
    if any(text.startswith("DistributedOptimizer") for text in groups):
        hint = (" Each DistributedOptimizer bucket is matched by its name: two ranks whose models or bucket sizes "
                "differ cut different buckets; build the same model and optimizer on every rank.")
    return (f"ranks disagree on {label(ordered[0][1]['n'])}: {listing}. Every rank must call the ops of a name (unnamed "
            f"ops are matched in the order each rank calls them) with {rule} (and the same op and root_rank).{hint}")




def pairable(first: dict | None, second: dict | None) -> bool:
    """Whether two requests of a set of two make a small reduction that each member can work out alone
    (``_background``'s pair path): both inline, of one kind and signature, without a problem. Then the
    coordinator's answer, once it has both, is "ok" with both payloads in set order, and it sends none."""
    return (first is not None and second is not None and bool(first.get("i")) and bool(second.get("i"))
            and first["k"] == second["k"] and first["s"] == second["s"] and not first.get("p")
            and not second.get("p"))
