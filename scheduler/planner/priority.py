"""Job order: FIFO, Slurm's multifactor priority, least attained service (Tiresias' LAS) or
shortest remaining service first (SRSF, Helios' QSSF when the run times are predicted)."""

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


# a job with neither a predicted run time nor a time limit counts as this long under SRSF
UNKNOWN_RUNTIME_S = 86400.0


def runtime_estimate(job: JobView, policy: PolicyConfig) -> float:
    """The run time SRSF counts on: predicted, else the time limit, else the default."""
    runtime = job.predicted_runtime_s
    if runtime is None:
        runtime = job.time_limit_s
        if runtime is None:
            runtime = policy.default_time_limit_s or UNKNOWN_RUNTIME_S
    return runtime


def remaining_service(job: JobView, now: float, policy: PolicyConfig,
                      outlived: bool = True) -> float:
    """GPU-seconds the job still needs: its predicted (else limited) run time less its service,
    or, once it has outlived that, as much again as it has had (with `outlived`; else none)."""
    total, done = runtime_estimate(job, policy) * job.gpus * job.nodes, attained(job, now)
    if done >= total > 0 and outlived:
        # it has outlived its estimate: with heavy-tailed run times, a job is expected to run
        # about as long again as it already has
        return done
    return max(0.0, total - done)


def order_runs(policy: PolicyConfig, queues: Mapping[str, QueueView]):
    """How `PendingOrder` splits the order: (signature, class_of, seq_of, needs_full_key).

    fifo, las and srsf keys never change while a job waits, so all jobs form one run in key
    order. Multifactor keys move with age and fair share, but not inside a class of jobs with
    the same queue, priority, nice, user, account and size: there, older is always first.
    """
    qprio: dict[str, int] = {}

    def qp(name: str) -> int:
        v = qprio.get(name)
        if v is None:
            v = qprio[name] = queue_priority(queues, policy, name)
        return v

    sig = (policy, tuple(sorted((k, v.priority) for k, v in queues.items())))

    def one(j: JobView) -> tuple:
        return ()

    if policy.order == "fifo":
        return sig, one, lambda j: (-qp(j.queue), -j.priority, j.submit_time), False
    if policy.order == "las":
        th = policy.las_thresholds_gpu_s
        return sig, one, lambda j: (-qp(j.queue), las_level(j.attained_gpu_s, th), -j.priority,
                                    j.submit_time), False
    if policy.order == "srsf":
        # remaining - aging * (now - submit) orders like remaining + aging * submit: static
        aging = policy.srsf_aging
        return sig, one, lambda j: (-qp(j.queue), -j.priority,
                                    remaining_service(j, j.submit_time, policy)
                                    + aging * j.submit_time, j.submit_time), False
    return sig, (lambda j: (j.queue, j.priority, j.nice, j.user, j.account, j.gpus * j.nodes)), \
        (lambda j: (j.submit_time,)), True


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
    if policy.order == "srsf":
        aging = policy.srsf_aging
        return lambda j: (-qp(j.queue), -j.priority,
                          remaining_service(j, j.submit_time, policy) + aging * j.submit_time,
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
