"""Time as a collaborator: the daemon reads the clock only through here, so tests set it."""

from __future__ import annotations

import time


class Clock:
    """Wall-clock seconds since the epoch (what is stored) and a monotonic timer (what is waited on)."""

    def time(self) -> float:
        return time.time()

    def monotonic(self) -> float:
        return time.monotonic()


class ManualClock(Clock):
    """A clock that moves only when told: timeouts and grace periods tested without sleeping."""

    def __init__(self, start: float = 1_700_000_000.0):
        self.now = start
        self._mono = 0.0

    def time(self) -> float:
        return self.now

    def monotonic(self) -> float:
        return self._mono

    def advance(self, seconds: float) -> None:
        self.now += seconds
        self._mono += seconds
