"""EASY backfill: reserve the earliest start for the top waiting job from running jobs' time limits."""

from __future__ import annotations

import bisect
from dataclasses import dataclass

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
