"""Idle reclaim: a job whose allocated GPUs sit idle is warned, then cancelled or requeued per its queue."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from sqlmodel import Session

from .. import models as m
from ..models import Job
from .clock import Clock
from .lifecycle import JobLifecycle
from .state import StateStore


@dataclass(frozen=True)
class IdlePolicy:
    """[queues.NAME] idle_* keys: under util_pct on every allocated GPU for idle_s, then grace_s."""

    util_pct: float
    idle_s: float
    grace_s: float
    action: str  # "cancel" or "requeue"
    allow_opt_out: bool = False

    @classmethod
    def from_queues(cls, queues: Mapping) -> dict[str, IdlePolicy]:
        """The queues of trainyard.toml that reclaim idle GPUs (those with idle_minutes set)."""
        return {name: cls(q.idle_util_pct, q.idle_minutes * 60, q.idle_grace_minutes * 60, q.idle_action,
                          q.allow_opt_out)
                for name, q in queues.items() if q.idle_minutes}


def busiest_per_job(sample: dict) -> dict[int, float]:
    """Job id -> the highest utilisation among its GPUs in one node's telemetry sample."""
    out: dict[int, float] = {}
    for g in sample.get("gpus", []):
        job, util = g.get("job_id"), g.get("util_gpu")
        if isinstance(job, int) and isinstance(util, int | float):
            out[job] = max(out.get(job, 0.0), float(util))
    return out


class IdleReclaimer:
    """Tracks since when each running job's GPUs are idle on each of its nodes and acts on policy."""

    def __init__(self, store: StateStore, lifecycle: JobLifecycle, clock: Clock,
                 policies: Mapping[str, IdlePolicy],
                 on_reclaimed: Callable[[str, float], None] | None = None):
        self.store = store
        self.lifecycle = lifecycle
        self.clock = clock
        self.policies = dict(policies)
        self.on_reclaimed = on_reclaimed  # (queue, GPU-hours) -> None: the metric
        self.idle_since: dict[int, dict[str, float]] = {}  # job -> node -> idle since
        self.warned: set[int] = set()
        self.threshold = {}  # job -> its queue's util_pct, learnt in enforce()

    def observe(self, node: str, sample: dict) -> None:
        """One telemetry sample: a job busy on this node is no longer idle; an idle one may start to be."""
        if not self.policies:
            return
        now = self.clock.time()
        for job_id, util in busiest_per_job(sample).items():
            limit = self.threshold.get(job_id, min(p.util_pct for p in self.policies.values()))
            per_node = self.idle_since.setdefault(job_id, {})
            if util >= limit:
                per_node.pop(node, None)
                self.warned.discard(job_id)
            else:
                per_node.setdefault(node, now)

    def enforce(self, s: Session, now: float) -> None:
        """Warn jobs idle for idle_minutes; after the grace, cancel or requeue them."""
        for job_id in list(self.idle_since):
            job = s.get(Job, job_id)
            if job is None or job.state != m.RUNNING or job.kill_reason:
                self.forget(job_id)
                continue
            policy = self.policies.get(job.queue)
            if policy is None or (job.idle_opt_out and policy.allow_opt_out):
                continue
            self.threshold[job_id] = policy.util_pct
            per_node = self.idle_since[job_id]
            nodes = [a["node"] for a in job.allocation]
            if not nodes or any(n not in per_node for n in nodes):
                continue  # idle only when idle on every node of the allocation
            idle_for = now - max(per_node[n] for n in nodes)
            if idle_for >= policy.idle_s and job_id not in self.warned:
                self.warned.add(job_id)
                self.store.record(s, "trainyard", "job.idle_warning", str(job_id), {
                    "user": job.user, "queue": job.queue, "util_pct": policy.util_pct,
                    "idle_s": round(idle_for), "action": policy.action,
                    "at": max(per_node[n] for n in nodes) + policy.idle_s + policy.grace_s})
            if idle_for >= policy.idle_s + policy.grace_s:
                self._reclaim(s, job, policy, idle_for)

    def _reclaim(self, s: Session, job: Job, policy: IdlePolicy, idle_for: float) -> None:
        gpu_hours = job.gpus * len(job.allocation) * idle_for / 3600
        why = (f"GPUs idle under {policy.util_pct:g}% for {idle_for / 60:.0f} min "
               f"(queue {job.queue} reclaims idle GPUs)")
        if policy.action == "cancel":
            job.reason = f"cancelled: {why}"
            self.lifecycle.kill(s, job, "cancel")
        else:
            self.lifecycle.kill(s, job, "requeue")
        self.store.record(s, "trainyard", "job.idle_reclaim", str(job.id), {
            "user": job.user, "queue": job.queue, "action": policy.action, "reason": why,
            "gpu_hours": round(gpu_hours, 3)})
        if self.on_reclaimed is not None:
            hook, queue = self.on_reclaimed, job.queue
            self.store.after_commit(s, lambda: hook(queue, gpu_hours))
        self.forget(job.id)

    def forget(self, job_id: int) -> None:
        self.idle_since.pop(job_id, None)
        self.warned.discard(job_id)
        self.threshold.pop(job_id, None)
