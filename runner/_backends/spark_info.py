"""What Spark says: its executors' resources, and its own account of a failed job."""

from __future__ import annotations

_SPARK_NOISE = ("Driver stacktrace:", "\tat ", "at org.apache.", "at java.", "at scala.")


def executor_resources(sc) -> list:
    """``(id, host, cores, gpus)`` of each active executor (in local mode, the driver's)."""
    found = []
    it = sc._jsc.sc().statusStore().executorList(True).iterator()
    while it.hasNext():
        summary = it.next()
        gpu = summary.resources().get("gpu")
        gpus = len(gpu.get().addresses()) if gpu.isDefined() else 0
        found.append((str(summary.id()), summary.hostPort().rsplit(":", 1)[0], int(summary.totalCores()), gpus))
    if any(executor_id != "driver" for executor_id, _, _, _ in found):
        found = [e for e in found if e[0] != "driver"]  # the driver runs no tasks beside executors
    return found


def spark_reason(exc: BaseException, max_lines: int = 12) -> str:
    """Spark's own account of a failed job, without the Java stack (py4j puts the reason on the
    lines after "An error occurred while calling ...")."""
    java = getattr(exc, "java_exception", None)
    text = ""
    if java is not None:
        try:
            text = str(java.getMessage() or "") or str(java.toString())
        except Exception:  # noqa: BLE001 - the gateway is gone
            text = ""
    text = text or str(exc)
    kept = []
    for line in text.splitlines():
        if line.strip().startswith(_SPARK_NOISE):
            if line.startswith("Driver stacktrace:"):
                break
            continue
        if line.strip() and not line.startswith("An error occurred while calling"):
            kept.append(line.rstrip())
    if len(kept) > max_lines:  # a Python worker's traceback: its first lines and its last, which name the error
        kept = kept[:3] + ["..."] + kept[3 - max_lines:]
    return "\n    ".join(kept)[-4000:] or type(exc).__name__
