"""The names ops are matched by across ranks, and how to show one to a user.

The engine negotiates each op by a full name (``allreduce.grads``, ``allreduce.noname.3``,
``join``); the stall report (``runner/_policy/stall_report.py``) and the engine's errors show it with ``label``.
"""

from __future__ import annotations

JOIN = "join"


def label(name: str) -> str:
    """A name as the user knows it: ``allreduce 'grads'``, or ``the 3rd unnamed allgather``."""
    kind, _, rest = name.partition(".")
    if rest.startswith("noname."):
        n = int(rest[len("noname."):]) + 1
        suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
        return f"the {n}{suffix} unnamed {kind}"
    return f"{kind} {rest!r}"
