"""Whether a rank's error is its own (a cause) or what another rank's failure did to it (collateral).

One rule, over what the driver also receives (the exception's type name and its ``str``), so that
the rank that failed and the driver read its error the same way: the rank, to decide what its
output shows (runner/_rank/worker.py), and the driver, to put the cause first in the run's error
(runner/_policy/failure_report.py). By type first; by text only where the type says nothing
(runner/_shared/error_text.py).
"""

from __future__ import annotations

from ..._common.commits import RanksChanged
from .error_text import PEER_GONE, TF_WRAPPERS, WRAPPED, read_text, says

#: The type every rank reports when it leaves at a commit for the driver to relaunch more ranks (as a name: the
#: driver receives the rank's exception's type name).
RESIZE = RanksChanged.__name__

#: Errors a rank gets because a peer went away: never the root cause while another one is known.
#: By type (ours and torch.distributed's); gloo's RuntimeError only by its text (runner/_shared/error_text.py). A user's
#: own OSError (a database that refuses connections) is a cause, whatever its text.
COLLATERAL_TYPES = frozenset({"MeshError", "DistBackendError", "DistNetworkError", "RunAborted", RESIZE})

HEADLINE_CHARS = 400  # a longer one-line summary of an error is cut to this

#: gloo's words when a process group could not connect its ranks while it was being built (``hvd.init()``,
#: ``dist.init_process_group()``): before any collective ran. Under load gloo sometimes drops a connection there
#: ("Connection closed by peer" on a rank whose peer is alive and waiting); a relaunch costs only the start-up.
MESH_SETUP = "connectFullMesh failed"
#: the words of that flake: a connection the peer dropped. Not "Connection refused" or a timeout, which a firewall or
#: a wrong interface between hosts gives every time.
MESH_DROPPED = ("Connection closed by peer", "Connection reset by peer")


def in_mesh_setup(type_name: str, message: str) -> bool:
    """Whether a collateral error is gloo's mesh, being built, losing a connection its peer dropped."""
    return (MESH_SETUP in message and any(words in message for words in MESH_DROPPED)
            and is_collateral(type_name, message))


def is_collateral(type_name: str, message: str) -> bool:
    """Whether an error is what a lost peer causes (a closed control link, gloo's read error), also where
    TensorFlow wrapped it (``UnknownError: ... MeshError: ...`` from a collective inside ``model.fit``)."""
    if type_name in COLLATERAL_TYPES:
        return True
    readings = read_text(type_name, message, COLLATERAL_TYPES)
    return says(readings, PEER_GONE) is not None or says(readings, WRAPPED) is not None


def _wrapped(type_name: str, message: str) -> str | None:
    """The line of a TensorFlow wrapper's message that carries a collateral error (``MeshError: ...``), if any."""
    if type_name not in TF_WRAPPERS:
        return None
    reading = says(read_text(type_name, message, COLLATERAL_TYPES), WRAPPED)
    return None if reading is None else reading.text


def headline(type_name: str, message: str) -> str:
    """An error in one line: ``Type: first line of its message`` (for a collateral error that TensorFlow
    wrapped, the wrapped error's line), cut to ``HEADLINE_CHARS``."""
    inner = _wrapped(type_name, message)
    if inner is not None:
        text = f"{inner} (raised inside TensorFlow's {type_name})"
    else:
        first = next((line.strip() for line in message.splitlines() if line.strip()), "")
        text = f"{type_name}: {first}" if first else type_name
    return text if len(text) <= HEADLINE_CHARS else text[:HEADLINE_CHARS - 1] + "…"


def failure_line(rank: int, type_name: str, message: str) -> str:
    """The one line a failed rank's output shows on the driver; its whole traceback goes to its log file only.

    >>> failure_line(1, "ValueError", "no rows")
    'sparkhvd: rank 1 failed: ValueError: no rows (whole traceback in rank-1.log)'
    >>> failure_line(0, "MeshError", "allreduce failed: rank 1's control link failed")
    "sparkhvd: rank 0 stopped as a consequence of another rank's failure: MeshError: allreduce failed: rank 1's \
control link failed (whole traceback in rank-0.log)"
    """
    what = "stopped as a consequence of another rank's failure" if is_collateral(type_name, message) else "failed"
    return f"sparkhvd: rank {rank} {what}: {headline(type_name, message)} (whole traceback in rank-{rank}.log)"
