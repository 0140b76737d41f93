"""The cluster as metrics read it: cheap, consistent reads at scrape time (metrics.ClusterReadModel)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from sqlalchemy import bindparam, case, func
from sqlalchemy import select as sa_select
from sqlmodel import select

from .. import models as m
from ..metrics import NodeInfo
from ..models import Queue
from .clock import Clock
from .links import NodeLinks
from .overview import Overview
from .scheduling import _N, _T, view_rows
from .state import StateStore, TableCache


class MetricsReadModel:
    def __init__(self, store: StateStore, links: NodeLinks, clock: Clock, team_of):
        self.store = store
        self.links = links
        self.clock = clock
        self.team_of = team_of
        self.finished_team_gpu_s: dict[str, float] = {}
        self.live_usage = lambda: None  # the leader's in-memory GPUs by node (Overview.usage)
        self.leading = lambda: False  # the leader keeps active jobs' allocations in memory (StateStore.active)
        self._infos: TableCache[dict[str, NodeInfo]] = TableCache(store, "node")  # every node's, by name

    def job_counts(self) -> Iterable[tuple[str, str, int]]:
        with self.store.read() as s:
            return self.store.job_counts(s)

    def queues(self) -> Iterable[str]:
        with self.store.read() as s:
            return list(s.exec(select(Queue.name)).all())

    def nodes(self) -> Iterable[NodeInfo]:
        return list(self._leaders_infos().values()) if self.leading() else self._node_infos()

    def node(self, name: str) -> NodeInfo | None:
        """On the leader, from every node's facts read once per change of the node table (its
        writes are the only ones); a standby reads the node's row."""
        if not self.leading():
            found = self._node_infos(name)
            return found[0] if found else None
        return self._leaders_infos().get(name)

    def _leaders_infos(self) -> dict[str, NodeInfo]:
        return self._infos.get(lambda: {n.name: n for n in self._node_infos()})

    def _node_infos(self, name: str | None = None) -> list[NodeInfo]:
        info = _N.agent_info
        query = sa_select(_N.name, _N.state, _N.gpus_total, info[("host",)].as_string().label("host"),
                          info[("driver_version",)].as_string().label("driver"))
        if name is not None:
            query = query.where(_N.name == name)
        with self.store.read() as s:  # two keys of agent_info, extracted by the database
            rows = s.connection().execute(query).all()
        return [NodeInfo(n.name, n.state, n.gpus_total, n.host or "", n.driver or "") for n in rows]

    def gpu_usage(self) -> Mapping[str, int]:
        live = self.live_usage()
        if live is not None:
            return live
        with self.store.read() as s:
            return Overview.gpu_usage(s)

    def telemetry(self) -> Mapping[str, dict]:
        return self.links.telemetry

    def gpu_jobs(self) -> Mapping[tuple[str, int], object]:
        return self._gpu_jobs()

    def gpu_jobs_on(self, name: str) -> Mapping[int, object]:
        """On the leader, from its in-memory index of the active jobs' allocations (O(jobs on
        the node)); a standby, which keeps no index, reads every active job."""
        if self.leading():
            return self.store.active.gpus_held_on(name)
        return {gpu: jid for (node, gpu), jid in self._gpu_jobs().items() if node == name}

    def _gpu_jobs(self) -> dict[tuple[str, int], object]:
        out: dict[tuple[str, int], object] = {}
        with self.store.read() as s:
            for jid, alloc in view_rows(s, (_T.id, _T.allocation), _T.state.in_(m.ACTIVE_STATES)):
                for a in alloc or ():
                    for g in a["gpus"]:
                        out[(a["node"], int(g))] = jid
        return out

    def team_gpu_seconds(self) -> Mapping[str, float]:
        """GPU-seconds per team: runs ended since the daemon started, plus running jobs up to now.
        The running jobs' part is summed by the database per (user, account), so a scrape of
        /metrics reads a row per user, not every active job (134 -> ~30 ms of the daemon's CPU
        per scrape with 10,000 active jobs on 1,250 nodes, most of what is left the per-node
        series). A job holds `gpus` on each of its `nodes` (the planner allocates exactly those)."""
        totals = dict(self.finished_team_gpu_s)
        now = self.clock.time()
        held = _T.gpus * _T.nodes * case((_T.start_time < bindparam("now"), bindparam("now") - _T.start_time),
                                         else_=0.0)
        with self.store.read() as s:
            rows = s.connection().execute(
                sa_select(_T.user, _T.account, func.sum(held))
                .where(_T.state.in_(m.ACTIVE_STATES), _T.start_time.is_not(None))
                .group_by(_T.user, _T.account), {"now": now}).all()
        for user, account, seconds in rows:
            team = account or self.team_of(user)
            totals[team] = totals.get(team, 0.0) + float(seconds or 0.0)
        return totals

    def on_job_state(self, job, old: str | None) -> None:
        if old in m.ACTIVE_STATES and job.state not in m.ACTIVE_STATES and job.start_time:
            team = job.account or self.team_of(job.user)
            end = job.end_time or self.clock.time()
            self.finished_team_gpu_s[team] = self.finished_team_gpu_s.get(team, 0.0) + \
                job.gpus * len(job.allocation or ()) * max(0.0, end - job.start_time)
