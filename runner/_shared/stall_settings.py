"""The stall check's settings that a rank's heartbeat forwards and the driver reads: which, and how a bad value is read.

The rank (runner/_rank/heartbeat.py) sends what its own environment sets; the driver's stall report
(runner/_policy/stall_report.py) resolves them against its own.
"""

from __future__ import annotations

from ..._common import settings

# What each rank's heartbeat carries when its environment sets it, and what the driver reads of its own.
FORWARDED_SETTINGS = (settings.STALL_CHECK_TIME, settings.STALL_CHECK_DISABLE, settings.STALL_SHUTDOWN_TIME,
                      settings.HEARTBEAT_TIMEOUT)


def lenient(setting: settings.Setting, raw, where: str):
    """``(value, problem)``: ``raw`` (the variable's text in ``where``) parsed, or the setting's default and a
    sentence saying why not; a bad stall setting is a warning, never the run's end."""
    try:
        return setting.value_of(None if raw is None else str(raw)), None
    except settings.SettingError as exc:
        return setting.default, f"{setting.name}={raw!r} in {where} {exc.problem}; {exc.fix}"
