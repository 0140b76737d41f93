"""Cluster-wide read models: the cluster summary, queues, teams, GPU usage and the event trail."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

from sqlalchemy import select as sa_select
from sqlmodel import Session, func, select

from .. import models as m
from ..models import Event, Queue
from ..planner import PolicyConfig, UsageLedger
from .clock import Clock
from .scheduling import _N, _T, VIEW_COLUMNS, job_view, view_rows
from .state import StateStore, event_json


class Overview:
    def __init__(self, store: StateStore, clock: Clock, policy: PolicyConfig, ledger: UsageLedger,
                 cluster_name: str, aliases: dict[str, str] | None = None):
        self.aliases = dict(aliases or {})  # partition name -> queue
        self.store = store
        self.clock = clock
        self.policy = policy
        self.ledger = ledger
        self.cluster_name = cluster_name
        # GPUs in use by node, kept in memory by the leader (None: read them from the database)
        self.live_usage: Callable[[], dict[str, int] | None] = lambda: None

    def usage(self, s: Session) -> dict[str, int]:
        """GPUs allocated to active jobs, by node: the leader's in-memory index, else the rows."""
        live = self.live_usage()
        return live if live is not None else self.gpu_usage(s)

    @staticmethod
    def gpu_usage(s: Session) -> dict[str, int]:
        used: dict[str, int] = {}
        for (alloc,) in view_rows(s, (_T.allocation,), _T.state.in_(m.ACTIVE_STATES)):
            for a in alloc or ():
                used[a["node"]] = used.get(a["node"], 0) + len(a["gpus"])
        return used

    def cluster(self, version: str) -> dict[str, Any]:
        with self.store.read() as s:
            # two columns, not Node objects (whose agent_info is large) on every TUI refresh
            nodes = s.connection().execute(sa_select(_N.state, _N.gpus_total)).all()
            used = self.usage(s)
            counts = self.store.job_counts(s)
        by_state: dict[str, int] = {}
        for state, _q, n in counts:
            by_state[state] = by_state.get(state, 0) + n
        return {
            "name": self.cluster_name, "version": version,
            "nodes_total": len(nodes), "nodes_up": sum(n.state == m.UP for n in nodes),
            "gpus_total": sum(n.gpus_total for n in nodes), "gpus_used": sum(used.values()),
            "jobs_running": sum(by_state.get(st, 0) for st in m.ACTIVE_STATES),
            "jobs_pending": sum(by_state.get(st, 0) for st in m.WAITING_STATES),
            "jobs_by_state": by_state,
        }

    def queues(self) -> list[dict[str, Any]]:
        with self.store.read() as s:
            counts = self.store.job_counts(s, final=False)  # pending and running only
            # an active job holds its GPUs per node on each of its nodes: summed by the
            # database, without decoding every running job's allocation on each refresh
            used = dict(s.connection().execute(
                sa_select(_T.queue, func.sum(_T.gpus * _T.nodes)).where(_T.state.in_(m.ACTIVE_STATES))
                .group_by(_T.queue)).all())
            out = []
            for q in s.exec(select(Queue).order_by(Queue.name)).all():
                c = {st: n for st, qn, n in counts if qn == q.name}
                qp = self.policy.queues.get(q.name)
                out.append({
                    "name": q.name, "priority": q.priority, "state": "open" if q.open else "stopped",
                    "default_time_limit": q.default_time_limit_s, "max_time_limit": q.max_time_limit_s,
                    "aliases": sorted(a for a, queue in self.aliases.items() if queue == q.name),
                    "nodes": dict(getattr(qp, "node_selector", None) or {}),
                    "pending": sum(c.get(st, 0) for st in m.WAITING_STATES),
                    "running": sum(c.get(st, 0) for st in m.ACTIVE_STATES),
                    "gpus_used": used.get(q.name, 0),
                })
            return out

    def teams(self) -> list[dict[str, Any]]:
        """Per team: quota, GPUs in use, decayed fair-share usage, pending and running jobs.

        The running jobs are read one by one (their GPUs and usage), the waiting ones counted by
        the database per user and account (what decides their team): a TUI asks this on every
        refresh, and 8,000 waiting jobs read as rows held the event loop 0.4 s each time."""
        policy = self.policy
        with self.store.read() as s:
            running = [job_view(r) for r in view_rows(s, VIEW_COLUMNS, _T.state.in_(m.ACTIVE_STATES))]
            waiting = s.connection().execute(
                sa_select(_T.user, _T.account, func.count()).where(_T.state.in_(m.WAITING_STATES))
                .group_by(_T.user, _T.account)).all()
        usage = self.ledger.decayed(self.clock.time(), running, policy.team_of)
        pending: Counter[str] = Counter()
        for user, account, n in waiting:
            pending[policy.team_of(SimpleNamespace(user=user, account=account))] += n
        names = set(policy.teams) | {policy.team_of(v) for v in running} | set(pending) | {"default"}
        out = []
        for name in sorted(names):
            quota = policy.teams.get(name)
            mine = [v for v in running if policy.team_of(v) == name]
            out.append({
                "name": name, "cohort": quota.cohort if quota else None,
                "nominal_gpus": quota.nominal_gpus if quota else None,
                "borrowing_limit_gpus": quota.borrowing_limit_gpus if quota else None,
                "lending_limit_gpus": quota.lending_limit_gpus if quota else None,
                "fairshare_shares": quota.fairshare if quota else 1.0,
                "users": list(quota.users) if quota else [],
                "gpus_used": sum(v.gpus * len(v.allocation) for v in mine),
                "running": len(mine),
                "pending": pending[name],
                "usage_gpu_hours": round(usage.get(f"team:{name}", 0.0) / 3600, 3),
            })
        return out

    def events(self, since: int | None, limit: int) -> list[dict[str, Any]]:
        """Forward from an id (`since`, 0 for the start of the trail), else the newest `limit`."""
        return list_events(self.store.engine, since, limit)


def list_events(engine, since: int | None, limit: int) -> list[dict[str, Any]]:
    """`GET /v1/events`' page: forward from an id (`since`, 0 for the start of the trail), else
    the newest `limit`, oldest first. A read of committed rows and nothing else (plain rows, not
    ORM objects: a page is up to 10,000 events), so it runs on the daemon's read threads or in a
    reader process (scheduler.daemon.readers)."""
    t = Event.__table__
    if since is not None:
        query = sa_select(t).where(t.c.id > since).order_by(t.c.id).limit(limit)
    else:
        query = sa_select(t).order_by(t.c.id.desc()).limit(limit)
    with engine.connect() as conn:
        rows = conn.execute(query).all()
    if since is None:
        rows.reverse()
    return [event_json(r) for r in rows]
