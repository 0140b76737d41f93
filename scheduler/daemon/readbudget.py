"""Each caller's share of the daemon's read threads: a token bucket in seconds of CPU, per user.

A page of 2,000 jobs costs the daemon ~0.15 s of CPU; a script that asks for it back to back
takes a whole core from the one that answers every submission and agent report (a submitter's
p99 went from ~50 to ~100 ms on the busy demo; tests/bench/bench_tui_busy.py). Slurm answers the
same problem with a per-user RPC rate limit (slurm.conf `SlurmctldParameters=rl_enable`); reads
here differ too much in cost for a count of calls to be fair, so what is counted is the CPU each
read took. A user may spend `burst_s` at once and then `share` of a second per second; a read
asked for with the bucket empty is refused (429, Retry-After) before anything is read, so a
client that keeps asking costs the daemon only the refusals. The TUI, which paces itself to a
fifth of the daemon's time per source, and the CLI stay under the default share.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from .errors import Throttled


@dataclass
class _Bucket:
    level: float  # seconds of read CPU the user may still spend now (negative: in debt)
    at: float  # the monotonic time `level` was computed for


@dataclass
class ReadBudget:
    """`share`: seconds of read CPU a user earns per second (0 turns the budget off);
    `burst_s`: what a user may spend at once, and the most a quiet user saves up."""

    share: float
    burst_s: float
    on_refused: Callable[[str], None] | None = None  # a read of this user's was refused
    buckets: dict[str, _Bucket] = field(default_factory=dict)

    @property
    def on(self) -> bool:
        return self.share > 0

    def _bucket(self, user: str, now: float) -> _Bucket:
        b = self.buckets.get(user)
        if b is None:
            if len(self.buckets) > 10_000:  # a full bucket is what a user has when absent
                self._forget_full(now)
            b = self.buckets[user] = _Bucket(self.burst_s, now)
        else:
            b.level = min(self.burst_s, b.level + (now - b.at) * self.share)
            b.at = now
        return b

    def _forget_full(self, now: float) -> None:
        for user in [u for u, b in self.buckets.items()
                     if b.level + (now - b.at) * self.share >= self.burst_s]:
            del self.buckets[user]

    def admit(self, user: str, now: float | None = None) -> None:
        """Raises Throttled when `user` has spent their budget: how long until it allows a read.
        `now` is real monotonic time (not the daemon's clock, which tests stop): what is
        measured against it is CPU really spent."""
        if not self.on:
            return
        now = time.monotonic() if now is None else now
        b = self._bucket(user, now)
        if b.level > 0:
            return
        if self.on_refused is not None:
            self.on_refused(user)
        wait = max(1, math.ceil(-b.level / self.share + 1e-9))
        raise Throttled(
            f"{user} has used their share of the daemon's reads ({self.share:g} s of CPU per second, "
            f"{self.burst_s:g} s at once; [daemon] read_share and read_burst_s): retry in {wait} s, "
            f"or ask for smaller pages (limit, state, user)", wait)

    def charge(self, user: str, cost_s: float, now: float | None = None) -> None:
        """`user`'s read took `cost_s` seconds of CPU (the level may go below zero: one read is
        never cut short; the next waits until the debt is paid)."""
        if self.on:
            self._bucket(user, time.monotonic() if now is None else now).level -= cost_s
