"""``start_timeline`` / ``stop_timeline`` for torch: Horovod's timeline of this rank's ops (``collective/_engine/timeline.py``)."""

from __future__ import annotations

from .._engine import communicator as _engine
from .._engine import timeline as _timeline


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Record this rank's collectives in Horovod's timeline format until ``stop_timeline``.

    Rank 0 writes ``file_path``; rank r > 0 writes ``file_path`` with ``.rank<r>`` before the
    extension (``trace.json`` -> ``trace.rank1.json``), so ranks that pass the same path do
    not overwrite each other. ``mark_cycles`` marks each batch of answers the engine carries out.
    """
    rank = _engine.topology().rank if _engine.is_initialized() else 0
    _timeline.start_timeline(file_path, mark_cycles, rank)


stop_timeline = _timeline.stop_timeline
