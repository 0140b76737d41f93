"""Job order: FIFO, Slurm's multifactor priority, or least attained service (Tiresias' LAS)."""

from __future__ import annotations

import bisect
from collections.abc import Callable, Mapping, Sequence

from .fairshare import FairShare
from .policy import PolicyConfig
from .types import JobView, QueueView


def queue_priority(queues: Mapping[str, QueueView], policy: PolicyConfig, name: str) -> int:
    q = queues.get(name)
    return q.priority if q is not None else policy.queue(name).priority


def attained(job: JobView, now: float) -> float:
    """GPU-seconds of service the job has had, counting its current run."""
    run = (now - job.start_time) * job.gpus * job.nodes if job.start_time is not None else 0.0
    return job.attained_gpu_s + max(0.0, run)


def las_level(service_gpu_s: float, thresholds: Sequence[float]) -> int:
    """Tiresias' discretised LAS: 0 until the first threshold of GPU-seconds, then 1, ..."""
    return bisect.bisect_right(thresholds, service_gpu_s)


def order_key(policy: PolicyConfig, queues: Mapping[str, QueueView], now: float,
              usage: Mapping[str, float], cluster_gpus: int,
              pending: Sequence[JobView], team_of: Callable[[JobView], str]):
    """A sort key for pending jobs, best first.

    multifactor is Slurm's job priority: the weighted sum of age, fair-share, job size and
    queue factors (each in [0, 1]), plus the job's own priority, minus its nice value.
    """
    qprio: dict[str, int] = {}

    def qp(name: str) -> int:
        v = qprio.get(name)
        if v is None:
            v = qprio[name] = queue_priority(queues, policy, name)
        return v

    if policy.order == "fifo":
        return lambda j: (-qp(j.queue), -j.priority, j.submit_time, j.id)
    if policy.order == "las":
        th = policy.las_thresholds_gpu_s
        return lambda j: (-qp(j.queue), las_level(j.attained_gpu_s, th), -j.priority,
                          j.submit_time, j.id)

    top = max([qp(j.queue) for j in pending] + [1])
    fs: FairShare | None = None
    if policy.weights.fairshare:
        teams: dict[str, set[str]] = {}
        for j in pending:
            teams.setdefault(team_of(j), set()).add(j.user)
        for key in usage:
            if key.startswith("team:"):
                teams.setdefault(key[5:], set())
        shares = {t: (policy.teams[t].fairshare if t in policy.teams else 1.0) for t in teams}
        members = {t: len(u) for t, u in teams.items()}
        for t, tq in policy.teams.items():
            if tq.users:
                members[t] = max(members.get(t, 0), len(tq.users))
        fs = FairShare(usage, shares, members)

    w = policy.weights
    max_age = w.max_age_s
    qfactor = {}
    team_cache: dict[str, str] = {}

    def key(j: JobView):
        q = qfactor.get(j.queue)
        if q is None:
            q = qfactor[j.queue] = w.queue * max(qp(j.queue), 0) / top
        p = q + j.priority - j.nice
        if w.age:
            age = now - j.submit_time
            p += w.age * (1.0 if age >= max_age else (age / max_age if age > 0 else 0.0))
        if fs is not None:
            team = j.account or team_cache.get(j.user)
            if team is None:
                team = team_cache[j.user] = team_of(j)
            p += w.fairshare * fs.factor(j.user, team)
        if w.job_size and cluster_gpus:
            size = min(1.0, j.gpus * j.nodes / cluster_gpus)
            p += w.job_size * (1.0 - size if w.favor_small else size)
        return (-p, j.submit_time, j.id)

    return key
