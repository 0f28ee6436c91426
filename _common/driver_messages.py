"""The driver service's messages, one definition each (as collective/_engine/messages.py for the engine), and their
codec.

Every frame between a task's agent or a rank and the driver (runner/_service/) carries one of these in its JSON
meta, and raw bytes beside it where the message says so (``blob``). Senders build the dataclass and ``encode``
it; the driver ``decode``s each request before a handler sees it, so a frame whose meta is not its kind's message
(an unknown field, a missing one, a value of the wrong type, a rank outside the run) is refused with a sentence
that says which, never half-read. Only this module spells the wire keys: they are the fields' names.

The kinds are ``protocol.Kind``'s: a request is answered with OK carrying its answer's message (``Assign`` for
REGISTER, ``Committed`` for COMMIT, ...), with ERR carrying a ``Refusal``, or with ABORT carrying an ``Aborted``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .protocol import LOG_STREAMS, MAX_PROGRESS_CHARS, Kind


class MessageError(ValueError):
    """A frame's meta that is not the message of its kind (``name``): the clause says what is wrong with it, as
    "its field 'rank' is True (bool) where a whole number was expected"."""

    def __init__(self, name: str, reason: str):
        super().__init__(reason)
        self.name = name


# ---- what the agent and the rank ask -------------------------------------------------------------------------

@dataclass(frozen=True)
class Register:
    """A task's agent joins the run (REGISTER); answered with an ``Assign`` once every task has registered."""

    KIND = Kind.REGISTER
    task: int  # the task's index in the barrier stage (its partition), 0..np-1
    host: str  # the hostname, for messages
    host_id: str  # what groups ranks by host (runner/_shared/host.py)
    pid: int  # the agent's process
    gpus: list[str]  # Spark's GPU addresses for the task
    devices: list[str]  # its GPUs as the host names them: ``gpus`` mapped through the executor's own list
    spark_task: list[int] | None = None  # (stage id, task attempt id) of its Spark task, for Spark's status store
    endpoint: list | None = None  # [address, torch port, tf port] the frameworks' servers bind (framework_env.py)


@dataclass(frozen=True)
class Assign:
    """The driver's answer to a ``Register``: the task's place in the run (OK)."""

    placement: dict  # a Placement's fields (_common/topology.py): what the rank process reads back as one
    host_gpus: list[str]  # every GPU of this job on the task's host, in local-rank order
    endpoints: list  # every rank's [address, torch port, tf port] (or None), by rank
    node: list[int]  # [this task's host index, the number of hosts] (torchrun's node rank and count)


@dataclass(frozen=True)
class Fetch:
    """A rank asks for the pickled function (FETCH); answered with OK carrying it as the blob."""

    KIND = Kind.FETCH


@dataclass(frozen=True)
class Watch:
    """A rank (or a stalled agent, rank -1) waits for the run's end (WATCH); answered with ABORT when it is aborted."""

    KIND = Kind.WATCH
    rank: int


@dataclass(frozen=True)
class Log:
    """Lines of a rank's output, one-way (LOG). ``lines`` are complete lines in order; ``progress`` is the stream's
    unfinished ``\\r``-rewritten line (a tqdm bar) as it stands after them; stream ``FILE_ONLY``'s lines go to the
    rank's log file only."""

    KIND = Kind.LOG
    rank: int
    stream: str  # one of protocol.LOG_STREAMS
    lines: list[str]
    progress: str | None = None


@dataclass(frozen=True)
class Result:
    """A rank's return value, pickled in the blob (RESULT; an empty blob: a value not shipped); answered with OK."""

    KIND = Kind.RESULT
    rank: int


@dataclass(frozen=True)
class Error:
    """A rank's exception (ERROR), its pickle in the blob where it pickles; answered with OK."""

    KIND = Kind.ERROR
    rank: int
    type: str  # the exception's type name
    message: str  # its str()
    traceback: str = ""  # without sparkhvd's frames (runner/_rank/failure.py)
    #: ``module.qualname`` of each class in the exception's MRO, by which the driver matches ``retry_on``
    classes: list[str] = dataclasses.field(default_factory=list)


@dataclass(frozen=True)
class Exit:
    """The agent saw its rank's process exit with ``code`` (EXIT); answered with OK."""

    KIND = Kind.EXIT
    rank: int
    code: int


@dataclass(frozen=True)
class Progress:
    """A rank's heartbeat, one-way (PROGRESS): what it is doing and the collectives it is in (_common/progress.py)."""

    KIND = Kind.PROGRESS
    rank: int
    state: str  # "starting", "running", "finishing"
    interval: float  # seconds between beats
    settings: dict  # the stall settings the rank's own environment sets (runner/_shared/stall_settings.py)
    done: int = 0  # finished waits
    ops: list = dataclasses.field(default_factory=list)  # in flight, oldest first
    last: dict | None = None  # the latest finished collective
    metrics: dict | None = None  # what the rank has done and where its time went (_common/metrics.py)


@dataclass(frozen=True)
class Clock:
    """A rank asks for the driver's wall clock (CLOCK); answered with a ``ClockReading``. The rank measures the
    trip around it, so it knows its clock's offset within half of it (``Timeline``)."""

    KIND = Kind.CLOCK


@dataclass(frozen=True)
class ClockReading:
    """The driver's answer to a ``Clock`` (OK): its wall clock, microseconds since the epoch."""

    now_us: int


@dataclass(frozen=True)
class Timeline:
    """The timeline traces a rank recorded (TIMELINE), as JSON in the blob: a list of ``{"start_us", "events"}``
    (``_common/traces.py``); answered with OK. ``offset_us``: what to add to the rank's wall clock to have the
    driver's, measured with ``Clock`` round trips, within ``error_us`` (half the shortest trip)."""

    KIND = Kind.TIMELINE
    rank: int
    offset_us: int
    error_us: int


@dataclass(frozen=True)
class Commit:
    """Rank 0's newest commit of an elastic state (COMMIT): the pickled snapshot in the blob, or, with a commit
    folder, its ``path`` and ``sha256``; answered with a ``Committed``."""

    KIND = Kind.COMMIT
    key: str  # the state's name
    seq: int  # counts the state's commits
    size: int = 0  # the ranks at the commit
    fields: dict = dataclasses.field(default_factory=dict)  # the state's small fields (epoch, batch, ...)
    bytes: int = 0  # the pickled snapshot's size
    sha256: str | None = None  # with ``path``: the file's digest, checked before it is loaded
    path: str | None = None  # the snapshot's file in the commit folder (then the blob is empty)
    shards: dict | None = None  # a sharded state's folder of every rank's shard: path, sha256 (file -> [digest, bytes])
    # made before the rank resumed the state (a commit before hvd.elastic.run): in a restarted attempt it must not
    # replace an earlier attempt's commit, which the state has yet to load
    before_resume: bool = False


@dataclass(frozen=True)
class Committed:
    """The driver's answer to a ``Commit`` (OK): whether it was kept, and ``[timestamp, HostUpdateResult]`` when the
    run can grow."""

    kept: bool
    hosts_updated: list | None = None


@dataclass(frozen=True)
class Restore:
    """A rank asks for the newest commit of ``key`` (RESTORE); answered with a ``Restored``, its blob the snapshot
    where ``data``."""

    KIND = Kind.RESTORE
    key: str
    data: bool = True


@dataclass(frozen=True)
class Restored:
    """The driver's answer to a ``Restore`` (OK): the commit's meta (a ``Commit``'s fields and the driver's own),
    or ``found`` False."""

    found: bool
    commit: dict | None = None


# ---- the rendezvous store (_common/rendezvous.py, served by runner/_service/store_requests.py) -----------------

@dataclass(frozen=True)
class StoreSet:
    """Set ``key`` to the blob; answered with OK."""

    KIND = Kind.STORE_SET
    key: str


@dataclass(frozen=True)
class StoreGet:
    """``key``'s value once it is set, waiting up to ``timeout`` seconds; answered with OK carrying it as the blob."""

    KIND = Kind.STORE_GET
    key: str
    timeout: float | None = None


@dataclass(frozen=True)
class StoreAdd:
    """Add ``amount`` to the counter ``key``; answered with a ``StoreValue`` (the new count)."""

    KIND = Kind.STORE_ADD
    key: str
    amount: int


@dataclass(frozen=True)
class StoreCheck:
    """Whether every one of ``keys`` is set; answered with a ``StoreValue``."""

    KIND = Kind.STORE_CHECK
    keys: list[str]


@dataclass(frozen=True)
class StoreWait:
    """Wait until every one of ``keys`` is set, up to ``timeout`` seconds; answered with OK."""

    KIND = Kind.STORE_WAIT
    keys: list[str]
    timeout: float | None = None


@dataclass(frozen=True)
class StoreCas:
    """Compare and set ``key``: the blob is the expected value's ``expected_len`` bytes, then the new value's;
    answered with OK carrying the value now as the blob."""

    KIND = Kind.STORE_CAS
    key: str
    expected_len: int


@dataclass(frozen=True)
class StoreDelete:
    """Delete ``key``; answered with a ``StoreValue`` (whether it was there)."""

    KIND = Kind.STORE_DELETE
    key: str


@dataclass(frozen=True)
class StoreNumKeys:
    """How many keys are set; answered with a ``StoreValue``."""

    KIND = Kind.STORE_NUM_KEYS


@dataclass(frozen=True)
class StoreValue:
    """A store request's answer (OK): a count, or a yes or no."""

    value: int | bool


# ---- what the driver says besides answers ----------------------------------------------------------------------

@dataclass(frozen=True)
class Aborted:
    """The run was aborted, or has finished (ABORT): the answer to a WATCH, and to a request the run's end cut off."""

    reason: str = "the run was aborted"


@dataclass(frozen=True)
class Refusal:
    """A refused request (ERR): the sentence says why. ``unserved``: the connection was dropped before its first
    request was read (a flooded listener), so the client connects again."""

    message: str = "the driver service refused the request"
    unserved: bool = False


#: Every request the driver serves, by its frame kind.
REQUESTS = {m.KIND: m for m in (Register, Fetch, Watch, Log, Result, Error, Exit, Progress, Timeline, Clock, Commit,
                                Restore, StoreSet, StoreGet, StoreAdd, StoreCheck, StoreWait, StoreCas, StoreDelete,
                                StoreNumKeys)}
#: The one-way ones: never answered, so a bad one is dropped and logged, not refused.
ONE_WAY = (Kind.LOG, Kind.PROGRESS)
#: The ranks' own reports, whose ``rank`` must be a rank of the run.
_RANKED = (Kind.LOG, Kind.RESULT, Kind.ERROR, Kind.EXIT, Kind.PROGRESS, Kind.TIMELINE)


# ---- the codec ----------------------------------------------------------------------------------------------

def _whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _strings(value) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


#: Each field annotation this module uses: (its check, how a sentence names it).
_TYPES = {
    "int": (_whole, "a whole number"),
    "str": (lambda v: isinstance(v, str), "a string"),
    "bool": (lambda v: isinstance(v, bool), "true or false"),
    "float": (lambda v: _whole(v) or isinstance(v, float), "a number"),
    "float | None": (lambda v: v is None or _whole(v) or isinstance(v, float), "a number or null"),
    "str | None": (lambda v: v is None or isinstance(v, str), "a string or null"),
    "dict": (lambda v: isinstance(v, dict), "an object"),
    "dict | None": (lambda v: v is None or isinstance(v, dict), "an object or null"),
    "list": (lambda v: isinstance(v, list), "a list"),
    "list | None": (lambda v: v is None or isinstance(v, list), "a list or null"),
    "list[str]": (_strings, "a list of strings"),
    "list[int]": (lambda v: isinstance(v, list) and all(_whole(x) for x in v), "a list of whole numbers"),
    "list[int] | None": (lambda v: v is None or (isinstance(v, list) and all(_whole(x) for x in v)),
                         "a list of whole numbers or null"),
    "int | bool": (lambda v: isinstance(v, int), "a whole number or true or false"),
}


def name_of(cls) -> str:
    """How sentences name a message: its frame kind ("REGISTER"), or its class for answers ("Assign")."""
    kind = getattr(cls, "KIND", None)
    return kind.name if kind is not None else cls.__name__


def encode(message) -> dict:
    """A message's wire meta: its fields by name (tuples as lists)."""
    return {f.name: list(v) if isinstance(v := getattr(message, f.name), tuple) else v
            for f in dataclasses.fields(message)}


def decode(cls, meta, *, np: int | None = None):
    """``meta`` as a ``cls`` message, or MessageError with a sentence; ``np``: the run's ranks, which a rank's own
    report's ``rank`` must be one of."""
    what = name_of(cls)
    if not isinstance(meta, dict):
        raise MessageError(what, f"its meta is a JSON {type(meta).__name__} where an object was expected")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(meta) - set(fields))
    if unknown:
        raise MessageError(what, f"it has the field{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}, "
                                 f"which {what} does not have ({', '.join(map(repr, fields)) or 'it has none'})")
    for name, f in fields.items():
        if name not in meta:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise MessageError(what, f"it lacks its field {name!r}")
            continue
        check, expected = _TYPES[f.type]
        if not check(meta[name]):
            raise MessageError(what, f"its field {name!r} is {meta[name]!r:.60} ({type(meta[name]).__name__}) where "
                                     f"{expected} was expected")
    message = cls(**meta)
    if np is not None and getattr(cls, "KIND", None) in _RANKED and not 0 <= message.rank < np:
        raise MessageError(what, f"its rank {message.rank} is not a rank of this run (0..{np - 1})")
    if cls is Log:
        _check_log(message)
    return message


def decode_request(kind: int, meta, *, np: int | None = None):
    """The request a frame of ``kind`` carries; MessageError where its meta is not that request's."""
    cls = REQUESTS.get(kind)
    if cls is None:
        raise MessageError(f"kind {kind}", "it is no request the driver serves")
    return decode(cls, meta, np=np)


def _check_log(message: Log) -> None:
    if message.stream not in LOG_STREAMS:
        raise MessageError("LOG", f"its stream {message.stream!r} is not one of {', '.join(map(repr, LOG_STREAMS))}")
    if message.progress is not None and len(message.progress) > MAX_PROGRESS_CHARS:
        raise MessageError("LOG", f"its progress is {len(message.progress)} characters long, over the "
                                  f"{MAX_PROGRESS_CHARS}-character limit")
