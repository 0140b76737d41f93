"""The daemon's own load, as Slurm's `sdiag` shows the controller's: how late its event loop runs,
its scheduling cycles, the jobs it took in and ran, the agents' messages and the API's callers.

Everything the daemon does runs on one event loop, so the loop's lag (how late a timer due now
fires) is the single figure that says whether the control plane keeps up: a submission, an
agent's report or a page of jobs waits at least that long. It is sampled every LAG_EVERY_S and
kept as `trainyard_event_loop_lag_seconds` for Prometheus, and here as last, mean, the p99 of the
last LAG_WINDOW samples and the worst since the statistics were reset. Counting costs a few
integer additions per event; nothing here reads the database.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

LAG_EVERY_S = 0.1  # the probe's timer: ten samples a second
LAG_WINDOW = 600  # samples the p99 is taken over: the last minute
SLOW_LAG_S = 0.1  # a lag at or over this is counted apart: requests waited that long


@dataclass
class LagStats:
    """Lag samples of the event loop, in seconds."""

    last: float = 0.0
    total: float = 0.0
    count: int = 0
    worst: float = 0.0
    slow: int = 0  # samples at or over SLOW_LAG_S
    recent: deque = field(default_factory=lambda: deque(maxlen=LAG_WINDOW))

    def add(self, lag: float) -> None:
        self.last = lag
        self.total += lag
        self.count += 1
        self.worst = max(self.worst, lag)
        self.slow += lag >= SLOW_LAG_S
        self.recent.append(lag)

    def p99(self, need: int = 1) -> float | None:
        """The 99th percentile of the recent samples; None with fewer than `need` of them (of
        fewer than 100, it is the worst: the start's first sample would stand for a minute)."""
        if len(self.recent) < max(need, 1):
            return None if need > 1 else 0.0
        ordered = sorted(self.recent)
        return ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]

    def summary(self) -> dict[str, Any]:
        return {"last_ms": _ms(self.last), "mean_ms": _ms(self.total / self.count if self.count else 0.0),
                "p99_ms": _ms(self.p99()), "max_ms": _ms(self.worst), "samples": self.count,
                f"over_{int(SLOW_LAG_S * 1000)}ms": self.slow, "window_samples": len(self.recent),
                "every_ms": _ms(LAG_EVERY_S)}


@dataclass
class CycleStats:
    """The scheduling cycles (Slurm's "Main schedule statistics")."""

    count: int = 0
    total: float = 0.0
    last: float = 0.0
    worst: float = 0.0
    last_at: float | None = None
    queue_length: int = 0  # pending jobs the last cycle planned
    started: int = 0  # jobs the cycles started

    def add(self, seconds: float, pending: int, started: int, at: float) -> None:
        self.count += 1
        self.total += seconds
        self.last = seconds
        self.worst = max(self.worst, seconds)
        self.last_at = at
        self.queue_length = pending
        self.started += started

    def summary(self) -> dict[str, Any]:
        return {"cycles": self.count, "last_ms": _ms(self.last),
                "mean_ms": _ms(self.total / self.count if self.count else 0.0), "max_ms": _ms(self.worst),
                "last_cycle_at": self.last_at, "last_queue_length": self.queue_length,
                "jobs_started": self.started}


class Diag:
    """What `GET /v1/diag` answers about the daemon's load, since its start or the last reset."""

    def __init__(self, clock: Callable[[], float] = time.time, lag_metric=None):
        self.clock = clock
        self.lag_metric = lag_metric  # a prometheus_client Histogram, or None
        self.started_at = clock()
        self._reset()

    def _reset(self) -> None:
        self.since = self.clock()
        self.lag = LagStats()
        self.cycles = CycleStats()
        self.agent_messages = 0
        self.requests: dict[str, int] = {}  # user -> authenticated API requests
        self.reads: dict[str, list] = {}  # user -> [long reads, their CPU seconds, refused (429)]

    def reset(self) -> None:
        """Counts and worst cases start again from now (`sdiag --reset`)."""
        self._reset()

    # --- what the daemon calls
    def request(self, user: str) -> None:
        self.requests[user] = self.requests.get(user, 0) + 1

    def read(self, user: str, cpu_s: float) -> None:
        """A read charged to `user`'s share (a page of jobs, a sacct window): what it cost."""
        r = self.reads.setdefault(user, [0, 0.0, 0])
        r[0] += 1
        r[1] += cpu_s

    def refused(self, user: str) -> None:
        self.reads.setdefault(user, [0, 0.0, 0])[2] += 1

    def cycle(self, seconds: float, pending: int, started: int) -> None:
        self.cycles.add(seconds, pending, started, self.clock())

    def observe_lag(self, lag: float) -> None:
        self.lag.add(lag)
        if self.lag_metric is not None:
            self.lag_metric.observe(lag)

    async def probe(self, running: Callable[[], bool], every_s: float = LAG_EVERY_S) -> None:
        """Sleep `every_s` again and again; how much later than due each wake-up came is the lag."""
        while running():
            # the clock, not loop.time(): uvloop's is in whole milliseconds. Its timers are too,
            # so a sample may read up to about 1 ms late on an idle loop
            due = time.perf_counter() + every_s
            await asyncio.sleep(every_s)
            self.observe_lag(max(0.0, time.perf_counter() - due))

    def summary(self, now: float | None = None) -> dict[str, Any]:
        now = self.clock() if now is None else now
        return {"since": self.since, "uptime_s": round(now - self.started_at, 3),
                "window_s": round(now - self.since, 3), "loop": self.lag.summary(),
                "scheduler": self.cycles.summary()}


def _ms(seconds: float) -> float:
    return round(seconds * 1000, 3)


__all__ = ["LAG_EVERY_S", "LAG_WINDOW", "SLOW_LAG_S", "CycleStats", "Diag", "LagStats"]
