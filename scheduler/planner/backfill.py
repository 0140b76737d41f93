"""EASY backfill: reserve the earliest start for the top waiting job from running jobs' time limits."""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .changes import changes, serial_of
from .placement import INF, ClusterState, Pool
from .types import JobView


@dataclass(frozen=True, slots=True)
class Reservation:
    job_id: int
    start: float
    nodes: tuple[str, ...]


class Releases:
    """When GPUs come back: (expected end, node, GPUs) for every running job, kept sorted."""

    def __init__(self):
        self.events: list[tuple[float, str, int]] = []

    def add(self, end: float, allocation, exclusive: bool, state: ClusterState) -> None:
        if end == INF:
            return  # no time limit: never counted on
        for name, gpus in allocation:
            n = len(gpus)
            if exclusive:
                n += state.hidden.get(name, 0)
            bisect.insort(self.events, (end, name, n))

    def extend_sorted(self, items) -> None:
        self.events = sorted(self.events + list(items))


class RunningEnds:
    """The release events of running jobs, kept between passes by the caller (in `PendingOrder`).

    A running job's expected end depends only on its (immutable) view, the policy and its
    queue's rules, so only the jobs that started, left or changed since the last pass are
    looked at again; the events stay sorted by expected end. Exclusive jobs are left out
    (what they give back depends on the pass's node state). A cache: a pass with a fresh one
    gives the same events as with a warm one.
    """

    __slots__ = ("_sig", "_seen", "_views", "_events", "exclusive")

    def __init__(self):
        self._sig: object = None
        self._seen: int | None = None  # the serial of the last `running`, when it was a `Views`
        self._views: dict[int, tuple[JobView, list[tuple[float, str, int]]]] = {}  # by id(view)
        self._events: list[tuple[float, str, int]] = []  # (expected end, node, GPUs), sorted
        self.exclusive: dict[int, JobView] = {}  # the running exclusive jobs, left to the pass

    def events(self, running: Sequence[JobView], sig: object, now: float,
               end_of: Callable[[JobView], float]) -> list[tuple[float, str, int]]:
        """(max(expected end, now), node, GPUs) of every non-exclusive running job with an
        end, sorted; `end_of` gives a job's expected end (INF: none); `sig` names how."""
        if sig != self._sig:
            self._sig = sig
            self._seen = None
            self._views = {}
            self._events = []
            self.exclusive = {}
        known, events = self._views, self._events
        gone, new = changes(running, known.keys(), self._seen)
        self._seen = None  # (until the change is applied)
        for key in gone:
            for e in known.pop(key)[1]:
                del events[bisect.bisect_left(events, e)]
            self.exclusive.pop(key, None)
        for job in new:
            key = id(job)
            mine: list[tuple[float, str, int]] = []
            if job.exclusive:
                self.exclusive[key] = job
            else:
                end = end_of(job)
                if end != INF:
                    mine = [(end, name, len(gpus)) for name, gpus in job.allocation]
                    for e in mine:
                        bisect.insort(events, e)
            known[key] = (job, mine)  # holds the view, so its id is not reused
        self._seen = serial_of(running)
        # a job past its expected end gives its GPUs back now (ordered as of now)
        k = bisect.bisect_right(events, now, key=_end)
        if k == 0:
            return list(events)
        return sorted((now, name, n) for _, name, n in events[:k]) + events[k:]


def _end(event: tuple[float, str, int]) -> float:
    return event[0]


def reserve(job: JobView, pool: Pool, state: ClusterState, releases: Releases,
            now: float) -> Reservation | None:
    """The earliest time the job's gang fits on GPUs alone as running jobs end; book it in `state`.

    Earlier reservations keep their GPUs for good in this computation, so a later
    reservation never counts on them. Returns None when no time can be promised (some
    running jobs have no time limit, or the gang never fits).
    """
    k = job.nodes
    names = pool.names
    totals = state.totals
    need = {n: (totals[n] if job.exclusive else job.gpus) for n in names}
    free_at = {n: len(state.free[n]) - state.reserved_need.get(n, 0) for n in names}
    fitting = sum(1 for n in names if free_at[n] >= need[n])
    start = now
    if fitting < k:
        start = None
        for end, name, gpus in releases.events:
            before = free_at.get(name)
            if before is None:
                continue
            free_at[name] = before + gpus
            if before < need[name] <= before + gpus:
                fitting += 1
                if fitting >= k:
                    start = max(end, now)
                    break
        if start is None:
            return None
    chosen = sorted((n for n in names if free_at[n] >= need[n]), key=lambda n: (free_at[n], n))[:k]
    needs = {n: need[n] for n in chosen}
    spare = {n: (free_at[n] - need[n]) if not job.exclusive else -1 for n in chosen}
    state.reserve(job.id, start, needs, spare)
    return Reservation(job.id, start, tuple(chosen))
