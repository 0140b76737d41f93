"""Fair share: a decayed GPU-usage ledger per user and team, and Slurm's classic fair-share factor."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping

from .changes import changes, serial_of
from .types import JobView

LN2 = math.log(2.0)


def user_key(user: str) -> str:
    return f"user:{user}"


def team_key(team: str) -> str:
    return f"team:{team}"


class UsageLedger:
    """GPU-seconds charged per user and team, decaying with a half-life; the snapshot's `usage`.

    Pure bookkeeping: the caller says what time it is. Usage charged at time t is worth
    2 ** (-(now - t) / half_life) of itself at `now`, as in Slurm's PriorityDecayHalfLife.
    """

    def __init__(self, half_life_s: float = 7 * 86400.0):
        if half_life_s <= 0:
            raise ValueError(f"half_life_s: must be > 0, got {half_life_s!r}")
        self.half_life_s = half_life_s
        # values are kept as of a reference time, so decaying them all costs one power
        self._ref: float | None = None
        self._value: dict[str, float] = {}
        # The running jobs' use so far, summed per key in closed form. A run of c = GPUs x h / ln 2
        # since `start` is worth c * (1 - 2^-((now - start) / h)) at `now`, which is
        # c - 2^-((now - r) / h) * c * 2^((start - r) / h) for any reference time r: each key
        # keeps the sums of c and of c * 2^((start - r) / h) over its running jobs, and a call
        # adds and takes away only the jobs that came or went since the last one.
        self._running: dict[int, tuple] = {}  # id(view) -> (view, start, c, w, user key, team key)
        self._later: dict[int, tuple] = {}  # the same, for runs that start after the last call's `now`
        self._sums: dict[str, list] = {}  # key -> [sum of c, sum of w, running jobs]
        self._run_ref: float | None = None  # r, for the sums of w
        self._team_of: Callable[[JobView], str] | None = None
        self._last: object = None  # the running jobs of the last call
        self._seen: int | None = None  # their serial, when they were a `Views`

    def _scale(self, now: float) -> float:
        """What a unit stored at the reference time is worth at `now` (>= 1 for later charges)."""
        return 2.0 ** (-(now - self._ref) / self.half_life_s)

    def _add(self, key: str, amount: float, now: float) -> None:
        if self._ref is None:
            self._ref = now
        elif (now - self._ref) / self.half_life_s > 256:  # keep the numbers in range
            k = self._scale(now)
            self._value = {key: v * k for key, v in self._value.items()}
            self._ref = now
        self._value[key] = self._value.get(key, 0.0) + amount / self._scale(now)

    def charge(self, user: str, team: str, gpu_seconds: float, now: float) -> None:
        """Charge `gpu_seconds` of use at time `now` to the user and to the team."""
        if gpu_seconds < 0:
            raise ValueError(f"gpu_seconds: must be >= 0, got {gpu_seconds!r}")
        self._add(user_key(user), gpu_seconds, now)
        self._add(team_key(team), gpu_seconds, now)

    def run_value(self, gpus: int, start: float, end: float) -> float:
        """What a run of `gpus` GPUs from start to end is worth at `end`, decayed continuously."""
        if end <= start or gpus <= 0:
            return 0.0
        h = self.half_life_s
        return gpus * h / LN2 * (1.0 - 2.0 ** (-(end - start) / h))

    def charge_run(self, user: str, team: str, gpus: int, start: float, end: float) -> None:
        """Charge a finished (or preempted) run, each second decayed from when it was used."""
        self.charge(user, team, self.run_value(gpus, start, end), end)

    def decayed(
        self,
        now: float,
        running: Iterable[JobView] = (),
        team_of: Callable[[JobView], str] | None = None,
        keys: Iterable[str] | None = None,
    ) -> dict[str, float]:
        """The `usage` mapping for a Snapshot at `now`, including what `running` jobs used so far.

        `keys` limits the answer to those keys (plus the running jobs' own).
        """
        k = self._scale(now) if self._ref is not None else 1.0
        if keys is None:
            out = {key: value * k for key, value in self._value.items()}
        else:
            get = self._value.get
            out = {key: get(key, 0.0) * k for key in keys}
        if team_of != self._team_of:
            self._team_of = team_of
            self._running, self._later, self._sums, self._last, self._seen = {}, {}, {}, None, None
        if not isinstance(running, (list, tuple)):
            running = list(running)
        if running is not self._last or not isinstance(running, tuple):
            # (a caller that hands over the same tuple again skips this)
            self._follow(running, now, team_of)
            self._last = running
        if self._later:
            for key in [key for key, e in self._later.items() if e[1] < now]:  # their runs began
                e = self._running[key] = self._later.pop(key)
                self._sum(e, +1)
        if self._sums:
            k = 2.0 ** (-(now - self._run_ref) / self.half_life_s)
            get = out.get
            for key, (c, w, _) in self._sums.items():
                v = c - k * w
                if v > 0:
                    out[key] = get(key, 0.0) + v
        return out

    def _follow(self, running: list | tuple, now: float, team_of: Callable[[JobView], str] | None) -> None:
        """Bring the per-key sums from the last call's running jobs to these (by identity)."""
        known, later = self._running, self._later
        gone, new = changes(running, lambda: known.keys() | later.keys(), self._seen)
        self._seen = None  # (until the change is applied, as the other planner states do)
        for key in gone:
            e = later.pop(key, None)
            if e is None:
                self._sum(known.pop(key), -1)
        if new:
            self._started(new, now, team_of)
        self._seen = serial_of(running)

    def _started(self, new: list[JobView], now: float, team_of: Callable[[JobView], str] | None) -> None:
        """Count the jobs that started running since the last call."""
        known, later = self._running, self._later
        h = self.half_life_s
        if self._run_ref is None:
            self._run_ref = now
        elif (now - self._run_ref) / h > 64:  # keep 2^((start - r) / h) in range
            self._rebase(now)
        for job in new:
            gpus = job.gpus * job.nodes
            if job.start_time is None or gpus <= 0:
                known[id(job)] = (job, None, 0.0, 0.0, "", "")  # uses nothing
                continue
            team = team_of(job) if team_of else (job.account or "default")
            c = gpus * h / LN2
            e = (job, job.start_time, c, c * 2.0 ** ((job.start_time - self._run_ref) / h),
                 user_key(job.user), team_key(team))
            if job.start_time < now:
                known[id(job)] = e
                self._sum(e, +1)
            else:  # it uses nothing before its start
                later[id(job)] = e

    def _sum(self, e: tuple, sign: int) -> None:
        _, start, c, w, uk, tk = e
        if start is None:
            return
        for key in (uk, tk):
            s = self._sums.get(key)
            if s is None:
                s = self._sums[key] = [0.0, 0.0, 0]
            s[2] += sign
            if s[2] == 0:  # no run left: exactly nothing, whatever the rounding of the sums
                del self._sums[key]
            else:
                s[0] += sign * c
                s[1] += sign * w

    def _rebase(self, now: float) -> None:
        """Move the reference time of the sums of w to `now`."""
        h = self.half_life_s
        f = 2.0 ** (-(now - self._run_ref) / h)
        self._run_ref = now
        for table in (self._running, self._later):
            for key, (job, start, c, w, uk, tk) in list(table.items()):
                table[key] = (job, start, c, w * f, uk, tk)
        for s in self._sums.values():
            s[1] *= f


def fairshare_factor(usage: float, total_usage: float, shares: float, total_shares: float) -> float:
    """Slurm's classic factor 2^(-U/S): 1.0 for no use, 0.5 at exactly the fair share, toward 0 above."""
    if total_usage <= 0 or usage <= 0:
        return 1.0
    s = shares / total_shares if total_shares > 0 else 1.0
    return 2.0 ** (-(usage / total_usage) / s)


class FairShare:
    """Fair-share factors for one planner pass: the team's factor times the user's within the team."""

    def __init__(self, usage: Mapping[str, float], team_shares: Mapping[str, float],
                 team_members: Mapping[str, int]):
        self.usage = usage
        self.team_shares = team_shares  # team -> shares, for every team with pending or usage
        self.total_shares = sum(team_shares.values())
        self.team_total = sum([v for k, v in usage.items() if k[:5] == "team:"])
        self.team_members = team_members  # team -> number of users sharing it equally
        self._cache: dict[tuple[str, str], float] = {}

    def factor(self, user: str, team: str) -> float:
        key = (user, team)
        f = self._cache.get(key)
        if f is None:
            tu = self.usage.get(team_key(team), 0.0)
            f_team = fairshare_factor(
                tu, self.team_total, self.team_shares.get(team, 1.0), self.total_shares
            )
            members = max(1, self.team_members.get(team, 1))
            f_user = fairshare_factor(self.usage.get(user_key(user), 0.0), tu, 1.0, members)
            f = f_team * f_user
            self._cache[key] = f
        return f
