"""``sparkhvd.plot(result)``: a run's steps per second, one line per rank over time, restarts marked (matplotlib,
``pip install "sparkhvd[plot]"``)."""

from __future__ import annotations


def plot(result, path: str | None = None, *, what: str = "steps_per_s"):
    """Draw ``result.metrics``' ``what`` (default ``steps_per_s``) per rank against the run's time, with a dashed
    line where each restart's ranks began; save a PNG at ``path`` where given. Returns the matplotlib Figure."""
    try:
        from matplotlib.figure import Figure  # not pyplot: no backend chosen, no figure kept open
    except ImportError as exc:
        raise ImportError("sparkhvd.plot draws with matplotlib, which is not installed; pip install "
                          "'sparkhvd[plot]' (or matplotlib).") from exc
    metrics = getattr(result, "metrics", None)
    if not metrics:
        raise ValueError("this RunResult has no metrics to plot (the run sent none: SPARKHVD_METRICS=0, or it ended "
                         "before a heartbeat); RunResult.metrics is empty.")
    fig = Figure(figsize=(8, 4), dpi=100)
    ax = fig.subplots()
    starts: dict = {}
    for rank, rows in sorted(metrics.items()):
        points = [(row["t"], row[what]) for row in rows if isinstance(row.get(what), (int, float))]
        for row in rows:
            starts.setdefault(row["attempt"], row["t"])
        ax.plot([t for t, _ in points], [v for _, v in points], marker=".", label=f"rank {rank}")
    for attempt, t in sorted(starts.items())[1:]:
        event = result.restarts[attempt - 1] if attempt - 1 < len(result.restarts) else None
        ax.axvline(t, color="grey", linestyle="--", linewidth=1)
        ax.annotate(f"restart {attempt}" + (f": {event.kind}" if event is not None else ""), (t, 1),
                    xycoords=("data", "axes fraction"), rotation=90, va="top", ha="right", fontsize=8, color="grey")
    ax.set_xlabel("seconds since the run started")
    ax.set_ylabel(what.replace("_per_s", " per second").replace("_", " "))
    ax.set_title(f"run {result.run_id}")
    ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, format="png")
    return fig
