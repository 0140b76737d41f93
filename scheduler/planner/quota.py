"""Team quotas in Kueue's sense: nominal GPUs per team, borrowing and lending inside a cohort.

Each team's nominal quota splits into a guaranteed part (nominal - lending limit) that only
the team may use and a lendable part that goes into its cohort's pool. A team uses the pool
for whatever it runs beyond its guaranteed part; it may go beyond its nominal quota
(borrow) up to its borrowing limit while the pool has room. A team asking for GPUs within
its nominal quota always gets them: if borrowers hold them, they are reclaimed by preemption.

Jobs within their team's nominal quota go before jobs that borrow (Kueue orders a cycle's heads
so): a job may borrow only what the pool has beyond what the other teams' pending jobs ask for
within their own nominal quotas. Otherwise the GPUs a reclaim frees would go back to the borrower
that comes first in the order (the requeued victim itself, submitted before the job it made room
for), and the reclaim would preempt again, losing a borrower's work each time.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from .policy import PolicyConfig, TeamQuota
from .types import JobView

UNLIMITED = 1 << 60


def job_gpus(job: JobView) -> int:
    return job.gpus * job.nodes


@dataclass(frozen=True, slots=True)
class Admission:
    ok: bool
    detail: str = ""
    reclaim: int = 0  # GPUs of borrowing the cohort must give back before this job may run


class QuotaBook:
    """GPU usage per team during one planner pass, checked against the configured quotas."""

    def __init__(self, policy: PolicyConfig, running: Iterable[JobView],
                 team_of: Callable[[JobView], str], pending: Iterable[JobView] = ()):
        self.teams = policy.teams
        self.team_of = team_of
        self.running, self.pending = running, pending
        # GPUs and ids of the pending jobs that may ask for quota, by team (built when a job
        # first borrows in the pass); the jobs started in the pass; what each cohort's teams ask
        # for of the pool within their nominal quotas, until a start or a preemption there
        self._asks: dict[str, list[tuple[int, int]]] | None = None
        self._started: set[int] = set()
        self._asked: dict[str, dict[str, int]] = {}
        self.usage: dict[str, int] = {}
        for job in running:
            if job.preempted_at is None:  # a job being preempted gives its quota back now
                t = team_of(job)
                self.usage[t] = self.usage.get(t, 0) + job_gpus(job)
        self.cohorts: dict[str, list[TeamQuota]] = {}
        for t in self.teams.values():
            if t.nominal_gpus is not None and t.cohort:
                self.cohorts.setdefault(t.cohort, []).append(t)

    @staticmethod
    def lendable(t: TeamQuota) -> int:
        nominal = t.nominal_gpus or 0
        return nominal if t.lending_limit_gpus is None else min(t.lending_limit_gpus, nominal)

    def pool_used(self, cohort: str, extra_team: str = "", extra: int = 0) -> int:
        used = 0
        for t in self.cohorts[cohort]:
            u = self.usage.get(t.name, 0) + (extra if t.name == extra_team else 0)
            used += max(0, u - ((t.nominal_gpus or 0) - self.lendable(t)))
        return used

    def pool_size(self, cohort: str) -> int:
        return sum(self.lendable(t) for t in self.cohorts[cohort])

    def admit(self, team: str, gpus: int) -> Admission:
        t = self.teams.get(team)
        if t is None or t.nominal_gpus is None:
            return Admission(True)
        used = self.usage.get(team, 0)
        after = used + gpus
        nominal = t.nominal_gpus
        if not t.cohort:
            if after <= nominal:
                return Admission(True)
            return Admission(
                False, f"team {team} uses {used} of its {nominal} nominal GPUs and has no cohort to borrow from"
            )
        borrow_limit = UNLIMITED if t.borrowing_limit_gpus is None else t.borrowing_limit_gpus
        if after > nominal + borrow_limit:
            return Admission(
                False,
                f"team {team} uses {used} GPUs; {gpus} more would pass its nominal {nominal} "
                f"+ borrowing limit {borrow_limit}",
            )
        over = self.pool_used(t.cohort, team, gpus) - self.pool_size(t.cohort)
        if over <= 0 and after > nominal:
            kept = {name: g for name, g in self.asked_of(t.cohort).items() if name != team}
            if over + sum(kept.values()) > 0:
                whose = ", ".join(f"team {name} {g}" for name, g in sorted(kept.items()))
                return Admission(
                    False,
                    f"cohort {t.cohort} keeps {sum(kept.values())} GPUs for pending jobs within their "
                    f"teams' nominal quotas ({whose}); team {team} uses {used} of its {nominal} nominal GPUs",
                )
        if over <= 0:
            return Admission(True)
        if after <= nominal:
            return Admission(True, f"reclaiming {over} GPUs lent in cohort {t.cohort}", reclaim=over)
        return Admission(
            False,
            f"cohort {t.cohort} has no unused quota to lend to team {team} "
            f"(it uses {used} of its {nominal} nominal GPUs)",
        )

    def is_borrowing(self, team: str) -> bool:
        t = self.teams.get(team)
        return bool(t and t.nominal_gpus is not None and self.usage.get(team, 0) > t.nominal_gpus)

    def cohort_of(self, team: str) -> str | None:
        t = self.teams.get(team)
        return t.cohort if t and t.nominal_gpus is not None else None

    def borrowed_by(self, team: str) -> int:
        t = self.teams.get(team)
        if t is None or t.nominal_gpus is None:
            return 0
        return max(0, self.usage.get(team, 0) - t.nominal_gpus)

    def asked_of(self, cohort: str) -> dict[str, int]:
        """GPUs of the cohort's pool that each team's pending jobs ask for within its nominal
        quota: not held, without a dependency, not started in this pass (`pending` leaves out the
        stopped queues' jobs), of an array with a limit (`%N`) only as many tasks as may run
        beside its running ones, each no bigger than what is left of the quota (a bigger one
        borrows itself), in all at most what is left."""
        asked = self._asked.get(cohort)
        if asked is not None:
            return asked
        if self._asks is None:
            self._asks = {}
            # tasks an array's limit lets start, by array: its limit less its tasks running when
            # the pass began (those started since are in _started)
            may_start: dict[int, int] = {}
            array_running = Counter(j.array_parent for j in self.running if j.array_parent is not None)
            for job in self.pending:
                if job.held or job.dependency:
                    continue
                if job.array_limit and job.array_parent is not None:
                    n = may_start.get(job.array_parent)
                    if n is None:
                        n = job.array_limit - array_running[job.array_parent]
                    may_start[job.array_parent] = n - 1
                    if n <= 0:
                        continue
                self._asks.setdefault(self.team_of(job), []).append((job_gpus(job), job.id))
        asked = self._asked[cohort] = {}
        for t in self.cohorts[cohort]:
            used = self.usage.get(t.name, 0)
            left = (t.nominal_gpus or 0) - used
            if left <= 0:
                continue
            ask = min(left, sum(g for g, jid in self._asks.get(t.name, ()) if g <= left and jid not in self._started))
            guaranteed = (t.nominal_gpus or 0) - self.lendable(t)
            part = max(0, used + ask - guaranteed) - max(0, used - guaranteed)  # what comes from the pool
            if part > 0:
                asked[t.name] = part
        return asked

    def add(self, team: str, gpus: int, started: int | None = None) -> None:
        """`gpus` more (a start: the job's id as `started`) or fewer (a preemption) for `team`."""
        self.usage[team] = self.usage.get(team, 0) + gpus
        if started is not None:
            self._started.add(started)
        cohort = self.cohort_of(team)
        if cohort is not None:
            self._asked.pop(cohort, None)
