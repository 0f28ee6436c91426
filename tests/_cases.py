"""One test per case: the ranks run a table of named cases once per module (a module-scoped fixture), and each
test reads its own case by name, so a broken op fails its own test alone, and a case that raises is recorded
(with its traceback) for its own test while the next cases still run.

    OPS = {}
    case = add_to(OPS)

    @case
    def allreduce_sum(hvd, r, n):
        return hvd.allreduce(torch.tensor([r + 1.0]), op=hvd.Sum)

    def _ops():  # the rank function
        import sparkhvd.collective.torch as hvd

        hvd.init()
        return run_cases(OPS, hvd, hvd.rank(), hvd.size())

    def test_allreduce_sum(ranks):
        assert all(torch.equal(v, torch.tensor([3.0])) for v in values(ranks, "allreduce_sum"))
"""

from __future__ import annotations

import sys
import traceback

import cloudpickle
import pytest

# The ranks call run_cases and message_of without importing tests/ (not on their path): send this module's code
# with the training function, as HorovodRunner sends the test module's own.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def add_to(table: dict):
    """A decorator that adds a function to ``table`` under its name; the ranks run the cases in that order."""
    def add(fn):
        table[fn.__name__] = fn
        return fn
    return add


def run_cases(cases: dict, *args) -> dict:
    """On a rank: every case of ``cases`` in order, each called with ``args``; what each returned, or raised."""
    returned, raised = {}, {}
    for name, case in cases.items():
        try:
            returned[name] = case(*args)
        except Exception:  # noqa: BLE001 - recorded: the case's own test fails with the traceback
            raised[name] = traceback.format_exc()
    return {"returned": returned, "raised": raised}


def values(ranks: list, name: str) -> list:
    """Each rank's value of the case ``name``; the test fails with the rank's traceback where it raised."""
    for rank, result in enumerate(ranks):
        if name in result["raised"]:
            pytest.fail(f"the case {name} raised on rank {rank}:\n{result['raised'][name]}", pytrace=False)
    return [result["returned"][name] for result in ranks]


def message_of(call, kind: type = Exception) -> str:
    """On a rank: the message of the ``kind`` error that ``call()`` raises, or "no error"."""
    try:
        call()
    except kind as exc:
        return str(exc)
    return "no error"


def error_of(call):
    """On a rank: the type and message of what ``call()`` raises, or "no error"."""
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - the test compares type and message
        return type(exc).__name__, str(exc)
    return "no error"


def rows_to_each(n: int) -> list:
    """Rows each rank sends to rank k in the alltoall cases: k + 1."""
    return [k + 1 for k in range(n)]


def named(*cases: tuple) -> list:
    """Parameters for pytest.mark.parametrize, each with its first item (the case's name) as its id."""
    return [pytest.param(*case, id=case[0]) for case in cases]
