"""Every environment variable sparkhvd reads, sparkhvd's and Horovod's: its name, default, parser and meaning.

Code reads a setting through its entry here (``settings.WARM.get()``) and writes one for a child
process by its name (``env[settings.WARM.name] = ...``); nothing else names a variable.
docs/settings.md is made from this list (``python -m sparkhvd._common.settings``), and a test keeps
the two equal.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Generic, Mapping, TypeVar

T = TypeVar("T")

_ALL: list[Setting] = []


@dataclass(frozen=True)
class Setting(Generic[T]):
    """One environment variable: ``get()`` is its parsed value, or ``default`` where it is unset or empty."""

    name: str
    default: T
    parse: Callable[[str], T]  # raises ValueError with a sentence that names the variable and the fix
    doc: str  # one line, for docs/settings.md
    internal: bool = False  # set by sparkhvd for the processes it starts; users do not set it

    def __post_init__(self) -> None:
        _ALL.append(self)

    def get(self, environ: Mapping[str, str] | None = None) -> T:
        raw = (os.environ if environ is None else environ).get(self.name)
        if raw is None or raw == "":
            return self.default
        return self.parse(raw)

    def raw(self, environ: Mapping[str, str] | None = None) -> str | None:
        """The variable's text as set, or None."""
        return (os.environ if environ is None else environ).get(self.name)


def text(raw: str) -> str:
    return raw


# ---- the warm process (runner/_zygote.py) ------------------------------------------------------

WARM_FORKED = "forked"  # WARM's value in a rank forked by the zygote
WARM = Setting("SPARKHVD_WARM", "1", text,
               'Ranks fork from a warm process that has imported torch; "0" starts a fresh Python for each '
               f'rank. Set to "{WARM_FORKED}" by the warm process in the ranks it forks.')


# ---- what the agent tells the rank process it starts (runner/_agent.py -> runner/_worker.py) ---------------

DRIVER = Setting("SPARKHVD_DRIVER", None, text, "The driver service's host:port.", internal=True)
RUN_ID = Setting("SPARKHVD_RUN_ID", None, text, "The run this rank belongs to.", internal=True)
PLACEMENT = Setting("SPARKHVD_PLACEMENT", None, text, "The rank's place in the run (JSON).", internal=True)
PARENT_PID = Setting("SPARKHVD_PARENT_PID", None, text, "The agent's pid: the rank exits when it is gone.",
                     internal=True)
NETWORK_INTERFACE = Setting("SPARKHVD_NETWORK_INTERFACE", None, text,
                            "HorovodRunner(network_interface=): where the rank listens for its peers.",
                            internal=True)
RETURN = Setting("SPARKHVD_RETURN", "all", text,
                 '"all": every rank ships its return value to the driver; "0": only rank 0 does.', internal=True)


def all_settings() -> list[Setting]:
    """Every setting, in the order this module defines them."""
    return list(_ALL)


def markdown() -> str:
    """docs/settings.md."""
    lines = ["# Settings", "",
             "Environment variables sparkhvd reads, made from `_common/settings.py` "
             "(`python -m sparkhvd._common.settings > docs/settings.md`).", "",
             "| variable | default | meaning |", "|---|---|---|"]
    for s in _ALL:
        if not s.internal:
            default = "unset" if s.default is None else f"`{s.default}`"
            lines.append(f"| `{s.name}` | {default} | {s.doc} |")
    internal = [s for s in _ALL if s.internal]
    if internal:
        lines += ["", "Set by sparkhvd for the processes it starts (not for users):", "",
                  "| variable | meaning |", "|---|---|"]
        lines += [f"| `{s.name}` | {s.doc} |" for s in internal]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(markdown(), end="")
