"""Preemption: pick the running jobs whose eviction makes room for a waiting one, wasting least."""

from __future__ import annotations

import bisect
import heapq
import math
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from operator import itemgetter

from .changes import changes, serial_of
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
        top = INF if bound is None else bound
        if ranked is not None:
            pairs = ((r, v) for v in running if (r := ranked[v.id]) < top)
        elif rank is not None:
            pairs = ((r, v) for v in running if (r := rank(v)) < top)
        else:
            pairs = ((0, v) for v in running) if top > 0 else iter(())
        self._build(pairs, now)

    @classmethod
    def from_ranked(cls, ranked: Iterable[tuple[float, JobView]], now: float) -> VictimIndex:
        """The index of jobs whose ranks the caller has already worked out (and filtered by
        its bound): (rank, job) pairs. Saves a second pass over the running jobs."""
        self = cls.__new__(cls)
        self._build(ranked, now)
        return self

    def _build(self, ranked: Iterable[tuple[float, JobView]], now: float) -> None:
        self.now = now
        wastes: dict[int, float] = {}
        ranks: dict[int, float] = {}
        on: dict[str, list[tuple]] = {}
        get = on.get
        for r, v in ranked:
            start = v.start_time
            w = v.gpus * v.nodes * max(0.0, now - (start if start is not None else now))
            jid = v.id
            wastes[jid] = w
            ranks[jid] = r
            for name, gpus in v.allocation:
                entry = (r, w, -(start or 0.0), jid, v, len(gpus))
                lst = get(name)
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


class ServiceIndex:
    """The running jobs a policy may evict, by their service, kept between passes by the caller
    (in `PendingOrder`): a pass looks only at the few whose service passes its threshold (more
    left than a waiting job needs under SRSF, a higher LAS level), not at every running job.

    A running job's service is, up to rounding, A + rate x GPUs x now, with A fixed by its
    (immutable) view and the policy, and rate -1 (service left) or +1 (service attained):
    among jobs holding the same number of GPUs the order by A never changes. Each such group
    is kept sorted by A, and a pass scans a group only while A + rate x GPUs x now can reach
    the threshold (with a margin for rounding); the caller then computes the exact service of
    those, so it keeps exactly the jobs a sweep over every running job would. Only jobs that
    started, left or changed since the last pass are looked at again. A cache: a fresh one
    gives the same answer as a warm one.
    """

    __slots__ = ("_sig", "_seen", "_views", "_groups", "_always", "_starts")

    def __init__(self):
        self._sig: object = None
        self._seen: int | None = None  # the serial of the last `running`, when it was a `Views`
        self._views: dict[int, tuple[JobView, int, tuple | None]] = {}  # by id(view)
        self._groups: dict[int, list[tuple[float, int, int]]] = {}  # GPUs -> sorted (-A, id, key)
        self._always: dict[int, JobView] = {}  # jobs whose A is not a finite number
        self._starts: dict[int, float] = {}  # the start of every job in the groups

    def candidates(self, running: Sequence[JobView], sig: object, now: float, rate: int,
                   at_least: float, constant: Callable[[JobView], float | None]
                   ) -> list[JobView]:
        """The running jobs whose service may be `at_least` or more at `now` (a superset of
        those whose service is); `-inf`: every job that may be evicted. `constant(job)` is the
        job's A, or None if it may never be evicted; `sig` names how A and `rate` are chosen."""
        if sig != self._sig:
            self._sig = sig
            self._seen = None
            self._views = {}
            self._groups = {}
            self._always = {}
            self._starts = {}
        known, groups, starts = self._views, self._groups, self._starts
        gone, new = changes(running, known.keys(), self._seen)
        self._seen = None  # (until the change is applied)
        for key in gone:
            _, gpus, entry = known.pop(key)
            if entry is not None:
                lst = groups[gpus]
                del lst[bisect.bisect_left(lst, entry)]
            self._always.pop(key, None)
            starts.pop(key, None)
        for job in new:
            key = id(job)
            a = constant(job)
            start = job.start_time
            gpus = job.gpus * job.nodes if start is not None else 0
            entry = None
            if a is not None:
                if math.isfinite(a):
                    entry = (-a, job.id, key)
                    bisect.insort(groups.setdefault(gpus, []), entry)
                    if start is not None:
                        starts[key] = start
                else:
                    self._always[key] = job
            known[key] = (job, gpus, entry)  # holds the view, so its id is not reused
        self._seen = serial_of(running)
        out = list(self._always.values())
        # a job started after `now` (clocks apart) has had no run yet, not a negative one:
        # the line does not hold for it, so every job is looked at
        if at_least == -INF or (starts and max(starts.values()) > now):
            out += [known[key][0] for lst in groups.values() for _, _, key in lst]
            return out
        for gpus, lst in groups.items():
            slope = rate * gpus * now
            for neg_a, _, key in lst:
                approx = slope - neg_a
                if approx + 1e-6 * (abs(neg_a) + abs(slope)) + 1.0 < at_least:
                    break
                out.append(known[key][0])
        return out


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
