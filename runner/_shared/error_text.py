"""The one place where sparkhvd reads an error's text, because no exception type says what happened.

Errors are classified by type wherever there is one. The driver receives a rank's exception as
its type's name and its ``str`` (runner/_rank/worker.py), so "by type" means by those names:
runner/_shared/collateral.py's ``COLLATERAL_TYPES`` holds ours and torch.distributed's
(``DistBackendError``, ``DistNetworkError``). Three errors say what they mean only in their text,
and ``read_text`` matches every such pattern; nothing else in sparkhvd matches error text:

- gloo raises a plain ``RuntimeError`` when a peer's process dies, not a ``DistError``
  (``[.../gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:22923. ... GLHF!``);
- TensorFlow wraps an exception raised inside an op's Python function in its ``UnknownError`` or
  ``InternalError``, whose message keeps the original's ``Type: message`` line;
- Spark ends a job that ``spark.stop()`` cut short with a generic ``SparkException`` whose text
  says ``SparkContext was shut down``.
"""

from __future__ import annotations

from dataclasses import dataclass

#: What a text says (``Reading.says``).
PEER_GONE = "peer gone"  # gloo lost the connection to a peer: its process or host went away
WRAPPED = "wrapped"  # a TensorFlow wrapper carries an error of one of the given types
SPARK_STOPPED = "spark stopped"  # the SparkContext was stopped under a running job

#: gloo's words, in a RuntimeError, for a peer that went away.
GLOO_PEER_GONE = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "GLHF", "pair.cc")
#: TensorFlow's types for an error raised inside an op's Python function.
TF_WRAPPERS = frozenset({"UnknownError", "InternalError"})
SPARK_STOPPED_TEXT = "SparkContext was shut down"


@dataclass(frozen=True)
class Reading:
    """What an error's text says, and the text that says it."""

    says: str  # PEER_GONE, WRAPPED or SPARK_STOPPED
    text: str  # the pattern that matched; for WRAPPED, the wrapped error's line from its ``Type: `` on


def read_text(type_name: str, message: str, wrapped_types=frozenset()) -> tuple[Reading, ...]:
    """What an error of type ``type_name`` says in its ``message``, where its type does not say it: one
    ``Reading`` for each kind of text found, none for most errors.

    ``wrapped_types``: the type names to look for inside a TensorFlow wrapper's message.

    >>> read_text("RuntimeError", "[pair.cc:537] Read error [127.0.0.1]:52902: Connection reset by peer.")
    (Reading(says='peer gone', text='Connection reset by peer'),)
    >>> read_text("UnknownError", "Graph execution error: ... MeshError: allreduce failed", {"MeshError"})
    (Reading(says='wrapped', text='MeshError: allreduce failed'),)
    >>> read_text("ValueError", "Connection reset by peer")  # a user's own error: its type says enough
    ()
    """
    found = []
    if type_name == "RuntimeError":
        pattern = next((p for p in GLOO_PEER_GONE if p in message), None)
        if pattern is not None:
            found.append(Reading(PEER_GONE, pattern))
    if type_name in TF_WRAPPERS:
        line = next((line[line.find(f"{kind}: "):] for line in message.splitlines() for kind in wrapped_types
                     if f"{kind}: " in line), None)
        if line is not None:
            found.append(Reading(WRAPPED, line))
    if SPARK_STOPPED_TEXT in message:
        found.append(Reading(SPARK_STOPPED, SPARK_STOPPED_TEXT))
    return tuple(found)


def says(readings: tuple[Reading, ...], what: str) -> Reading | None:
    """The reading that says ``what``, if any."""
    return next((r for r in readings if r.says == what), None)
