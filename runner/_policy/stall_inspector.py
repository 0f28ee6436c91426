"""The stall check's state across one run: Horovod's stall inspector (stall_inspector.cc) on the driver.

The supervision (``_policy/supervise.py``) calls ``StallInspector.check`` on each poll. It copies what the
driver service knows (``observe``), keeps what the copies do not say (when progress was last
seen, when each rank returned), prints the stall report (``_policy/stall_report.py``) to the driver's stderr,
at the check time and then at twice, four times, ... that, and returns the error to fail the
run with: a stall past its shutdown time, or a rank not heard from.
"""

from __future__ import annotations

import math
import sys
import time
import warnings
from dataclasses import dataclass

from ..._common import settings
from .._shared.errors import HorovodRunError
from .stall_report import (
    ALIVE,
    EXITED,
    FAILED,
    FORWARDED_SETTINGS,
    RETURNED,
    SILENT,
    RankState,
    StallSettings,
    StallView,
    _ranks,
    _s,
    doing,
    report,
)

_CHECK_EVERY_S = 0.2  # the supervise loop polls faster than this matters


@dataclass(frozen=True)
class Observation:
    """What the driver service knows, copied at one moment (``observe``)."""

    placed: bool
    progress: dict  # rank -> (heartbeat meta, arrival time)
    returned: frozenset
    failed: frozenset
    exited: frozenset
    hosts: dict  # rank -> host name
    where: dict  # rank -> "host h (address a)"


def observe(service) -> Observation:
    """Copy what the stall check needs from the driver service (under its lock)."""
    with service.cv:
        placements = service.placements
        regs = dict(service.registrations)
        progress = dict(service.progress)
        returned, exited = frozenset(service.results), frozenset(service.exits)
        failed = frozenset(f.rank for f in service.failures)
    hosts, where = {}, {}
    # hosts named alike (network namespaces, cloned images) are told apart by their address
    by_rank = {p.rank: regs[t] for t, p in enumerate(placements or ()) if t in regs}
    ambiguous = len({r.host for r in by_rank.values()}) < len({r.host_id for r in by_rank.values()})
    for rank, reg in by_rank.items():
        hosts[rank] = f"{reg.host} ({reg.peer})" if ambiguous else reg.host
        where[rank] = f"host {reg.host} ({reg.peer})"
    return Observation(placements is not None, progress, returned, failed, exited, hosts, where)


class StallInspector:
    """Watches one run's heartbeats; ``check`` prints stall reports and returns an error to fail the run with."""

    def __init__(self, *, np: int, run_id: str, log_dir: str, driver_env=None, out=None, clock=time.monotonic):
        self.np = np
        self.run_id = run_id
        self.log_dir = log_dir
        self.abort_reason = ""  # with an error from check(): what the ranks are told when they are stopped
        self._driver_env = (dict(driver_env) if driver_env is not None else
                            {s.name: s.raw() for s in FORWARDED_SETTINGS if s.raw() is not None})
        self._out = out
        self._clock = clock
        self._settings_key = None
        self.settings, problems = StallSettings.resolve(self._driver_env, {})
        self._warned: set = set()
        self._warn(problems)
        self._checked_at = -math.inf
        self._placed_at = None
        self._progress_total = None
        self._progress_at = clock()
        self._ended_at: dict = {}  # rank -> when the driver first saw its result or error
        self._next_report = None  # during a stall: the stalled-for seconds at which the next report is due
        self._stall_began = None
        self._reported = False  # this stall has been reported
        self.reports = 0  # reports printed in this run
        self._broken = False  # the check failed once (a bug): it is off

    def check(self, service) -> HorovodRunError | None:
        """Called on each supervise poll: maybe print a report; an error means: fail the run with it."""
        now = self._clock()
        if self._broken or now - self._checked_at < _CHECK_EVERY_S:
            return None
        self._checked_at = now
        try:
            return self.check_observation(observe(service), now)
        except Exception as exc:  # noqa: BLE001 - a diagnostic must not take the run down
            self._broken = True
            warnings.warn(f"sparkhvd run {self.run_id}: the stall check failed ({type(exc).__name__}: {exc}) and is "
                          "off for the rest of this run; please report it with the run's logs.", RuntimeWarning,
                          stacklevel=2)
            return None

    def check_observation(self, seen: Observation, now: float) -> HorovodRunError | None:
        """One check on ``seen``: the error to fail the run with (a rank lost, or a stall past its shutdown
        time), else None, having printed the stall report when one is due."""
        if not seen.placed:
            return None
        self._note(seen, now)
        view = self.view(seen, now)
        lost = self._lost(view, seen, now)
        if lost is not None:
            return lost
        if self.settings.disabled:
            return None
        stalled_for = self._stalled_for(view, now)
        if stalled_for is None or stalled_for < self.settings.check_time:
            self.over(now)
            return None
        view = StallView(view.np, view.ranks, stalled_for)
        if self._next_report is None:
            self._next_report, self._stall_began = self.settings.check_time, now - stalled_for
        headline, lines = report(view, self.settings)
        if 0 < self.settings.shutdown_time <= stalled_for:
            return self._shutdown_error(stalled_for, headline, lines)
        if stalled_for >= self._next_report:
            self._print_report(stalled_for, headline, lines)
        return None

    def _note(self, seen: Observation, now: float) -> None:
        """Keep what ``seen`` says that the next copies will not: when the ranks were placed, when each rank
        ended, when progress was last made; and take up the settings the ranks sent."""
        self._placed_at = self._placed_at or now
        self._update_settings(seen)
        for rank in seen.returned | seen.failed:
            self._ended_at.setdefault(rank, now)
        total = sum(int(meta.get("done", 0)) for meta, _ in seen.progress.values()) + len(self._ended_at)
        if total != self._progress_total:
            self._progress_total, self._progress_at = total, now

    def _shutdown_error(self, stalled_for: float, headline: str, lines: list) -> HorovodRunError:
        """The error that fails a run stalled past ``HOROVOD_STALL_SHUTDOWN_TIME_SECONDS``."""
        shutdown = settings.STALL_SHUTDOWN_TIME.name
        self.abort_reason = f"the run stalled for {_s(stalled_for)}, past {shutdown}"
        return HorovodRunError(
            f"HorovodRunner run {self.run_id} failed after a stall of {_s(stalled_for)} "
            f"({shutdown}={self.settings.shutdown_time:g}): {headline}\n" + "\n".join(lines)
            + f"\n\nEach rank's full output is in {self.log_dir}/rank-<rank>.log.",
            log_dir=self.log_dir, run_id=self.run_id, retryable=True,
            cause=f"the run stalled for {_s(stalled_for)}: {headline}")

    def _print_report(self, stalled_for: float, headline: str, lines: list) -> None:
        """Print the stall report, and set when the next one is due: at twice, four times, ... the check time."""
        self._print(f"[sparkhvd] run {self.run_id} stalled: {headline}\n" + "\n".join(lines)
                    + f"\nEach rank's output is in {self.log_dir}/rank-<rank>.log.")
        self.reports += 1
        self._reported = True
        self._next_report *= 2
        while self._next_report <= stalled_for:
            self._next_report *= 2

    def view(self, seen: Observation, now: float) -> StallView:
        states = []
        for rank in range(self.np):
            host = seen.hosts.get(rank, "")
            if rank in seen.returned or rank in seen.failed:
                status = RETURNED if rank in seen.returned else FAILED
                states.append(RankState(rank, status, host, ended_ago=now - self._ended_at.get(rank, now)))
                continue
            if rank in seen.exited:
                states.append(RankState(rank, EXITED, host))
                continue
            if rank not in seen.progress:
                states.append(RankState(rank, SILENT, host))
                continue
            meta, arrived = seen.progress[rank]
            late = now - arrived
            ops = tuple({**op, "age": float(op.get("age", 0)) + late} for op in meta.get("ops") or ())
            last = meta.get("last")
            if last:
                last = {**last, "ago": None if last.get("ago") is None else float(last["ago"]) + late}
            status = meta.get("state") if meta.get("state") in ALIVE else "running"
            states.append(RankState(rank, status, host, ops, last, late, float(meta.get("interval") or
                                                                              settings.HEARTBEAT.default)))
        return StallView(self.np, tuple(states), now - self._progress_at)

    def _stalled_for(self, view: StallView, now: float):
        """How long the run has been stalled, or None if nothing waits (every rank computing is no stall)."""
        starts = [now - op["age"] for s in view.ranks if s.status in ALIVE for op in s.ops]
        running = any(s.status in ALIVE for s in view.ranks)  # one never heard from: _lost() speaks for it
        returned = [now - s.ended_ago for s in view.ranks if s.status == RETURNED]
        if returned and running:
            starts.append(max(returned))
        if not starts:
            return None
        return now - max(self._progress_at, min(starts))

    def _lost(self, view: StallView, seen: Observation, now: float) -> HorovodRunError | None:
        timeout = self.settings.heartbeat_timeout
        if timeout <= 0:
            return None
        since_placed = now - self._placed_at
        # three heartbeats at least: a rank set to beat more slowly than the timeout is not lost for it
        silent = [s for s in view.ranks if (s.status in ALIVE and s.heard_ago >= max(timeout, 3 * s.interval))
                  or (s.status == SILENT and since_placed >= timeout)]
        if not silent:
            return None
        by_host: dict = {}
        for s in silent:
            by_host.setdefault(seen.where.get(s.rank, "an unknown host"), []).append(s)
        parts = []
        for where, states in by_host.items():
            heard = [s.heard_ago for s in states if s.heard_ago is not None]
            since = f"for {_s(min(heard))}" if heard else f"since the ranks started {_s(since_placed)} ago"
            parts.append(f"{_ranks(s.rank for s in states)} on {where} {'has' if len(states) == 1 else 'have'} not "
                         f"been heard from {since}")
            parts += [f"rank {s.rank}'s last heartbeat said: {doing(s, self.np, heard=False)}"
                      for s in states if s.heard_ago is not None]
        origin = self.settings.origin.get(settings.HEARTBEAT_TIMEOUT.name)
        self.abort_reason = f"{_ranks(s.rank for s in silent)} stopped sending heartbeats to the driver"
        error = HorovodRunError(
            f"HorovodRunner run {self.run_id} failed: " + "; ".join(parts) + ". A rank that stops sending "
            f"heartbeats has lost its host or the network to the driver, or its process is frozen (stopped, or in a "
            f"native call that holds Python's GIL). A rank sends a "
            f"heartbeat every {silent[0].interval:g} s ({settings.HEARTBEAT.name}); raise "
            f"{settings.HEARTBEAT_TIMEOUT.name} (now "
            f"{timeout:g}{f', from {origin}' if origin else ''}) if a rank can be busy that long, or set it to 0 to "
            f"turn this check off.\n\nEach rank's full output is in {self.log_dir}/rank-<rank>.log.",
            log_dir=self.log_dir, run_id=self.run_id, retryable=True, cause=parts[0])
        error.silent_ranks = sorted(s.rank for s in silent)  # their executors are cut off: a restart replaces them
        return error

    def _update_settings(self, seen: Observation) -> None:
        ranks = {r: meta.get("settings") or {} for r, (meta, _) in seen.progress.items()}
        key = tuple(sorted((r, tuple(sorted(s.items()))) for r, s in ranks.items()))
        if key == self._settings_key:
            return
        self._settings_key = key
        self.settings, problems = StallSettings.resolve(self._driver_env, ranks)
        self._warn(problems)

    def _warn(self, problems) -> None:
        for problem in problems:
            if problem not in self._warned:
                self._warned.add(problem)
                warnings.warn(problem, RuntimeWarning, stacklevel=2)

    def over(self, now: float | None = None) -> None:
        """Say that a reported stall is over (the ranks progress again, or the run finished before the next check)."""
        if self._reported:
            now = self._clock() if now is None else now
            self._print(f"[sparkhvd] run {self.run_id}: the stall is over after {_s(now - self._stall_began)}; "
                        "the ranks make progress again.")
        self._next_report, self._reported = None, False

    def _print(self, text: str) -> None:
        out = self._out or sys.stderr
        out.write(text + "\n")
        out.flush()
