"""Preemption: pick the running jobs whose eviction makes room for a waiting one, wasting least."""

from __future__ import annotations

import heapq
from collections.abc import Callable, Mapping, Sequence

from .placement import ClusterState, Pool
from .types import JobView


def waste(job: JobView, now: float) -> float:
    """GPU-seconds of work at risk if the job is stopped now (all of its current run)."""
    start = job.start_time if job.start_time is not None else now
    return job.gpus * job.nodes * max(0.0, now - start)


class VictimIndex:
    """Running jobs per node, in the order they should be evicted, built once per pass."""

    def __init__(self, running: Sequence[JobView], now: float,
                 rank: Callable[[JobView], float] | None = None):
        rank = rank or (lambda v: 0)
        self.now = now
        self.waste = {v.id: waste(v, now) for v in running}
        self.rank = {v.id: rank(v) for v in running}
        on: dict[str, list[tuple[JobView, int]]] = {}
        for v in running:
            for name, gpus in v.allocation:
                on.setdefault(name, []).append((v, len(gpus)))
        key = self._key
        self.on = {name: sorted(vs, key=key) for name, vs in on.items()}

    def _key(self, item):
        v = item[0]
        return (self.rank[v.id], self.waste[v.id], -(v.start_time or 0.0), v.id)


def choose_victims(
    job: JobView,
    pool: Pool,
    state: ClusterState,
    index: VictimIndex,
    soon_free: Mapping[str, int],
    may_preempt: Callable[[JobView], bool],
    reclaim: int = 0,
    reclaim_value: Callable[[JobView], int] | None = None,
    reclaim_pool: Sequence[JobView] = (),
    stop: Callable[[JobView], bool] | None = None,
) -> list[JobView] | None:
    """The cheapest set of running jobs to preempt so the gang fits, or None if none will do.

    An empty list means the gang will fit once jobs already being preempted have left.
    Per node, victims are taken lowest rank first (e.g. most attained service under LAS),
    then least wasted GPU-time, until the node has room; then the k cheapest nodes are chosen.
    With `reclaim` > 0, more victims from `reclaim_pool` are added (cheapest first) until that
    many borrowed GPUs come back. `stop(v)` true means neither v nor any job after it on
    its node (in eviction order) may be evicted: the scan of that node ends there.
    """
    options: list[tuple[int, float, int, str, list[JobView]]] = []
    wastes, ranks_of = index.waste, index.rank
    free, totals, hidden = state.free, state.totals, state.hidden
    for name in pool.names:
        need = totals[name] if job.exclusive else job.gpus
        have = len(free[name])
        if have >= need:
            continue  # GPUs are free but the node is held back otherwise; evictions won't help
        have += soon_free.get(name, 0)
        if have >= need:
            options.append((0, 0.0, 0, name, []))
            continue
        chosen: list[JobView] = []
        cost = 0.0
        ranks = 0
        for v, n in index.on.get(name, ()):
            if stop is not None and stop(v):
                break
            if not may_preempt(v):
                continue
            chosen.append(v)
            cost += wastes[v.id]
            ranks += ranks_of[v.id]
            have += n + (hidden.get(name, 0) if v.exclusive else 0)
            if have >= need:
                options.append((ranks, cost, len(chosen), name, chosen))
                break
    if len(options) < job.nodes:
        return None
    best = heapq.nsmallest(job.nodes, options, key=lambda o: o[:4])
    victims: dict[int, JobView] = {}
    for *_, vs in best:
        for v in vs:
            victims[v.id] = v
    if reclaim > 0 and reclaim_value is not None:
        back = sum(reclaim_value(v) for v in victims.values())
        for v in sorted(reclaim_pool, key=lambda v: (wastes[v.id], v.id)):
            if back >= reclaim:
                break
            if v.id not in victims:
                victims[v.id] = v
                back += reclaim_value(v)
        if back < reclaim:
            return None
    return list(victims.values())
