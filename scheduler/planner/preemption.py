"""Preemption: pick the running jobs whose eviction makes room for a waiting one, wasting least."""

from __future__ import annotations

import heapq
from collections.abc import Callable, Collection, Mapping, Sequence
from operator import itemgetter

from .placement import INF, ClusterState, Pool
from .types import JobView


class VictimIndex:
    """Running jobs per node, in the order they should be evicted, built once per pass.

    `on[node]` holds (rank, waste, -start, job id, job, GPUs on the node), sorted: eviction
    order is lowest rank first, then least waste (the GPU-seconds of its current run, lost if
    it is stopped now), then the latest started. A job's rank is `ranked[job id]` where
    given, else `rank(job)`; with `bound`, jobs whose rank is `bound` or more are left out.
    """

    __slots__ = ("now", "waste", "rank", "on")

    def __init__(self, running: Sequence[JobView], now: float,
                 rank: Callable[[JobView], float] | None = None, bound: float | None = None,
                 ranked: Mapping[int, float] | None = None):
        self.now = now
        wastes: dict[int, float] = {}
        ranks: dict[int, float] = {}
        on: dict[str, list[tuple]] = {}
        top = INF if bound is None else bound
        for v in running:
            r = ranked[v.id] if ranked is not None else (rank(v) if rank is not None else 0)
            if r >= top:
                continue
            start = v.start_time
            w = v.gpus * v.nodes * max(0.0, now - (start if start is not None else now))
            wastes[v.id] = w
            ranks[v.id] = r
            head = (r, w, -(start or 0.0), v.id, v)
            for name, gpus in v.allocation:
                entry = (*head, len(gpus))
                lst = on.get(name)
                if lst is None:
                    on[name] = [entry]
                else:
                    lst.append(entry)
        for lst in on.values():
            if len(lst) > 1:
                lst.sort(key=_ORDER)
        self.waste = wastes
        self.rank = ranks
        self.on = on


_ORDER = itemgetter(0, 1, 2, 3)  # rank, waste, -start, job id


def choose_victims(
    job: JobView,
    pool: Pool,
    state: ClusterState,
    index: VictimIndex,
    soon_free: Mapping[str, int],
    may_preempt: Callable[[JobView], bool] | None,
    reclaim: int = 0,
    reclaim_value: Callable[[JobView], int] | None = None,
    reclaim_pool: Sequence[JobView] = (),
    stop: Callable[[JobView], bool] | None = None,
    stop_rank: float | None = None,
    excluded: Collection[int] = (),
) -> list[JobView] | None:
    """The cheapest set of running jobs to preempt so the gang fits, or None if none will do.

    An empty list means the gang will fit once jobs already being preempted have left.
    Per node, victims are taken lowest rank first (e.g. most attained service under LAS),
    then least wasted GPU-time, until the node has room; then the k cheapest nodes are chosen.
    With `reclaim` > 0, more victims from `reclaim_pool` are added (cheapest first) until that
    many borrowed GPUs come back. `stop(v)` true means neither v nor any job after it on
    its node (in eviction order) may be evicted: the scan of that node ends there; so does a
    job whose rank in the index is `stop_rank` or more. `may_preempt` None: every job the
    scan reaches may be evicted, but those in `excluded` (the index and `stop_rank` already
    hold the policy's rule).
    """
    options: list[tuple[int, float, int, str, list[JobView]]] = []
    wastes = index.waste
    top = stop_rank if stop_rank is not None else INF
    free, totals, hidden = state.free, state.totals, state.hidden
    exclusive, need, on = job.exclusive, job.gpus, index.on
    for name in pool.names:
        if exclusive:
            need = totals[name]
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
        for rank, w, _, _, v, n in on.get(name, ()):
            if rank >= top or (stop is not None and stop(v)):
                break
            if v.id in excluded if may_preempt is None else not may_preempt(v):
                continue
            chosen.append(v)
            cost += w
            ranks += rank
            have += n + (hidden.get(name, 0) if v.exclusive else 0)
            if have >= need:
                options.append((ranks, cost, len(chosen), name, chosen))
                break
    if len(options) < job.nodes:
        return None
    best = heapq.nsmallest(job.nodes, options, key=_ORDER)  # (ranks, cost, victims, node)
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
