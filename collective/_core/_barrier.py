"""The ops that move no data: ``barrier``, and ``check`` (every member passed matching tensors)."""

from __future__ import annotations

from .._engine.ops import Op
from ._ops import now
from ._process_sets import global_process_set, require_member
from ._submit import describe, submit


def check(what: str, tensors: list, process_set=global_process_set, extra: str = "", problem=None) -> None:
    """Fail on every rank unless every member passes matching ``tensors`` (no data moves)."""
    require_member(process_set, what)
    desc = ", ".join(describe(t) for t in tensors)
    text = f"{extra}: {desc}" if extra else desc
    now(submit, process_set, Op(kind="check", name=what, signature=text, description=f"{what}({text})",
                                 argument_error=problem, launch=lambda answer, result: ([], None)))


def barrier(process_set=global_process_set) -> None:
    """Wait until every rank of the set has reached this call."""
    require_member(process_set, "barrier")
    now(submit, process_set, Op(kind="barrier", name=None, signature="", description="barrier()",
                                 launch=lambda answer, result: ([], None)))
