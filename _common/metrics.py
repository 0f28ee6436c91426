"""What this process has done and where its time went: the rank's side of ``RunResult.metrics``.

Counted where it happens, at the cost of an add: torch optimizer steps (every ``Optimizer.step``, sparkhvd's
``DistributedOptimizer`` included, through torch's global step hook: runner/_rank/steps.py), ``hvd.elastic``
commits (``collective/_core/_elastic.py``), the seconds spent waiting in collectives by phase (the check
before each op and the wait for its data: ``progress.end``) and the seconds the training loop waited on
sparkhvd's readers (``data/_reader.py``). ``snapshot`` adds what the process can tell of itself (CPU seconds,
resident memory) and, where NVML (``nvidia-ml-py``) and a GPU are there, the GPU's use, memory and temperature.
The heartbeat sends it each beat (runner/_rank/heartbeat.py); the driver keeps each rank's series
(runner/_service/metrics.py).
"""

from __future__ import annotations

import os
import time

from . import settings

#: SPARKHVD_METRICS: whether this process counts anything; a rank sets it from its own environment as it starts
#: (runner/_rank/steps.py), since a rank forked from the warm process inherits that process's modules
ON = True
_counts = {"optimizer_steps": 0, "commits": 0}
_seconds = {"check": 0.0, "data": 0.0, "loader": 0.0}
_gpu: list = []  # [handle] once NVML has one for this rank's GPU; [None] where it has none
#: SPARKHVD_MLFLOW_SYSTEM_METRICS: whether each snapshot carries MLflow's own system metrics of this host (the
#: driver's active MLflow run logs them); set per rank as ``ON`` is
SYSTEM = False
#: while a timeline records (collective/_engine/timeline.py): ``(seconds) -> None``, a data wait ending now
TIMELINE = None
_system: list = []  # [(psutil, the network's first counts)] once read; [None] without psutil


#: set on an optimizer while it steps a part of its parameters inside its own step (Adasum's per-parameter steps):
#: those are not steps of their own
INNER_STEP = "_sparkhvd_inner_step"


def optimizer_step(optimizer=None) -> None:
    if not getattr(optimizer, INNER_STEP, False):
        _counts["optimizer_steps"] += 1


def committed() -> None:
    _counts["commits"] += 1


def waited(phase: str, seconds: float) -> None:
    """A collective's wait of ``phase`` (``progress.CHECK`` or ``progress.DATA``) took ``seconds``."""
    _seconds[phase] = _seconds.get(phase, 0.0) + seconds


def loader_waited(seconds: float) -> None:
    """The training loop waited ``seconds`` for a batch from a sparkhvd reader."""
    _seconds["loader"] += seconds
    if TIMELINE is not None:
        TIMELINE(seconds)


def snapshot(collectives: int) -> dict:
    """Totals so far: ``collectives`` (finished waits, torch.distributed's included) and the counts above, the
    seconds in collectives by phase and in the readers, CPU seconds, resident bytes, ``gpu`` where NVML has it, and
    ``clock_s``, this process's monotonic clock, which times the deltas between two snapshots of one rank."""
    return {"optimizer_steps": _counts["optimizer_steps"], "commits": _counts["commits"],
            "collectives": collectives, "negotiation_s": round(_seconds["check"], 6),
            "transfer_s": round(_seconds["data"], 6), "data_wait_s": round(_seconds["loader"], 6),
            "cpu_s": round(time.process_time(), 3), "rss_bytes": _rss(), "gpu": _gpu_now(),
            "clock_s": round(time.monotonic(), 6), **({"system": _system_now()} if SYSTEM else {})}


def _system_now() -> dict | None:
    """This host's system metrics now, by the names and in the units of MLflow's own (``mlflow.system_metrics``' CPU,
    disk and network monitors), read with psutil as they are: importing mlflow in a rank would take seconds of its
    CPU (8 s on the 2-core test machine under load). The network's bytes count from the rank's first reading. None
    without psutil."""
    if not _system:
        try:
            import psutil

            net = psutil.net_io_counters()
            _system.append((psutil, net.bytes_recv, net.bytes_sent))
        except Exception:  # noqa: BLE001 - no psutil where this rank runs
            _system.append(None)
    if _system[0] is None:
        return None
    psutil, received, sent = _system[0]
    try:
        memory, disk, net = psutil.virtual_memory(), psutil.disk_usage(os.sep), psutil.net_io_counters()
        values = {"cpu_utilization_percentage": psutil.cpu_percent(),
                  "system_memory_usage_megabytes": memory.used / 1e6,
                  "system_memory_usage_percentage": memory.used / memory.total * 100,
                  "disk_usage_percentage": disk.percent, "disk_usage_megabytes": disk.used / 1e6,
                  "disk_available_megabytes": disk.free / 1e6,
                  "network_receive_megabytes": (net.bytes_recv - received) / 1e6,
                  "network_transmit_megabytes": (net.bytes_sent - sent) / 1e6}
    except Exception:  # noqa: BLE001 - a reading that fails now: none from now on, never the heartbeat's failure
        _system[0] = None
        return None
    return {name: round(float(value), 3) for name, value in values.items()}


def _rss() -> int | None:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def _gpu_now() -> dict | None:
    """This rank's GPU (CUDA_VISIBLE_DEVICES's entry at LOCAL_RANK: runner/_agent/env.py) as NVML sees it, or None
    without NVML or a GPU."""
    if not _gpu:
        _gpu.append(_gpu_handle())
    handle = _gpu[0]
    if handle is None:
        return None
    try:
        import pynvml

        use = pynvml.nvmlDeviceGetUtilizationRates(handle)
        memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
        return {"util_pct": use.gpu, "memory_bytes": memory.used,
                "temperature_c": pynvml.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU)}
    except Exception:  # noqa: BLE001 - a GPU NVML cannot read now: left out, never the heartbeat's failure
        _gpu[0] = None
        return None


def _gpu_handle():
    devices = [d.strip() for d in (settings.CUDA_VISIBLE_DEVICES.get() or "").split(",") if d.strip()]
    try:
        visible = devices[int(settings.LOCAL_RANK.get() or 0) % len(devices)] if devices else None
    except ValueError:
        visible = devices[0]
    if visible is None:
        return None
    try:
        import pynvml

        pynvml.nvmlInit()
        if visible.isdigit():
            return pynvml.nvmlDeviceGetHandleByIndex(int(visible))
        return pynvml.nvmlDeviceGetHandleByUUID(visible)
    except Exception:  # noqa: BLE001 - no nvidia-ml-py, no driver, or a device it does not know: no GPU metrics
        return None
