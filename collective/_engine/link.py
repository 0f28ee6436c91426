"""One process set as this rank negotiates it: its channels, its ops awaiting answers, and on the
coordinator the table (``negotiate.Table``). The engine thread alone changes a ``Link`` once it is added,
but for ``in_flight`` (names taken, freed by whichever thread waits for the op)."""

from __future__ import annotations

import collections

from .messages import RequestCache
from .negotiate import Table


class Link:
    """This rank's side of one set's negotiation."""

    def __init__(self, link_id: int, members: list, me: int, channels: dict, ranks, fusion_threshold: int,
                 cache_capacity: int):
        self.link_id = link_id
        self.members = members
        self.me = me
        self.ranks = ranks  # the set's ranks for the stall report (None: every rank)
        self.channels = channels  # peer -> PeerChannel: every worker on the coordinator, the coordinator elsewhere
        self.coordinator = members[0]
        self.table = Table(members, fusion_threshold) if me == self.coordinator else None
        self.cache = RequestCache(cache_capacity)  # encodes this worker's requests, or decodes the workers'
        self.waiting: dict = {}  # name -> Handle, submitted and not answered yet
        self.outbox: list = []  # on a worker: handles whose requests are still to send to the coordinator
        self.joined_works: list = []  # works this rank started while joined (its zeros in the others' reductions)
        self.broken: str | None = None
        self.group = None
        self.registered = False  # its channels are in the engine's selector (the engine thread's next turn)
        self._unnamed = collections.defaultdict(int)  # kind -> the number of its next unnamed op
        self.in_flight: set = set()  # names submitted and not yet synchronized (a name is one op at a time)
        self.next_answer = 0.0  # on the coordinator with a cycle time: the earliest time of its next answer
        self.is_pair = len(members) == 2  # both members work out small reductions themselves (``pair.py``)
        self.peer_out: list = []  # on the coordinator of a pair: (request, inline bytes) of its own, to send
        self.peer_in: dict = {}  # on the other member: name -> (coordinator's request, bytes) not yet claimed
        self.pair_now: list = []  # on the other member: (handle, request, bytes) to work out once its request is out
        self.peer_cache = RequestCache(cache_capacity)  # the coordinator's own requests to the other member of a pair
        self.poll = None  # in a pair: the poll object the calling thread waits on (``pair.await_other``)

    def unnamed(self, kind: str, take: bool = True) -> str:
        """The name of this set's next unnamed op of ``kind`` (the n-th gets ``kind.noname.n``); ``take``: it is
        used (the engine's lock held)."""
        number = self._unnamed[kind]
        if take:
            self._unnamed[kind] = number + 1
        return f"{kind}.noname.{number}"

    def missing(self, name: str):
        return self.table.waiting_for(name) if self.table is not None else None


class Missing:
    """The stall report's ``waiting_for``: the members the coordinator has not heard from for a name."""

    __slots__ = ("_link", "_name")

    def __init__(self, link: Link, name: str):
        self._link, self._name = link, name

    def waiting_for(self):
        return self._link.missing(self._name)
