"""What is new in a pass's snapshot against the last one.

A consumer that keeps state across passes (the pending order, the running jobs' expected
ends, ...) keys it by the views' identities. It finds what changed either from the snapshot
itself, when the caller built it as `Views` saying what came and went since the snapshot the
consumer last saw (the daemon does: O(changes)), or by comparing identities (a set over the
whole sequence: O(jobs), for callers that hand over plain tuples, such as a replay).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Collection, Iterable, Sequence

from .types import JobView

_serials = itertools.count(1)


class Views(tuple):
    """Jobs of a snapshot (a tuple, in any order) that also say what changed since an earlier
    snapshot of the same caller: `new` holds the views that were not in snapshot `base` and
    `gone` the views of `base` that are not here (the same objects). `base` is None when the
    caller does not know. Every `Views` has a `serial` of its own."""

    serial: int
    base: int | None
    new: tuple[JobView, ...]
    gone: tuple[JobView, ...]

    @classmethod
    def of(cls, jobs: Iterable[JobView], base: int | None = None,
           new: Iterable[JobView] = (), gone: Iterable[JobView] = ()) -> Views:
        v = cls(jobs)
        v.serial = next(_serials)
        v.base = base
        v.new = tuple(new)
        v.gone = tuple(gone)
        return v


def serial_of(jobs: Sequence[JobView]) -> int | None:
    """The snapshot's serial (None for a plain sequence): what a consumer remembers it saw."""
    return getattr(jobs, "serial", None)


def changes(jobs: Sequence[JobView], known: Collection[int] | Callable[[], Collection[int]],
            seen: int | None) -> tuple[Iterable[int], list[JobView]]:
    """(the id()s in `known` that left, the views that are new) between the snapshot the
    consumer saw last (`seen`, its serial, with `known` the id()s of its views, or what gives
    them when called) and `jobs`. Read from `jobs` itself when it is a `Views` based on `seen`;
    found by comparing identities otherwise."""
    if seen is not None:
        if getattr(jobs, "serial", None) == seen:  # the very snapshot the consumer saw last
            return (), []
        if getattr(jobs, "base", None) == seen:
            return [id(v) for v in jobs.gone], list(jobs.new)
    if callable(known):
        known = known()
    current = set(map(id, jobs))
    if len(current) == len(known) and current == known:
        return (), []
    return known - current, added(jobs, current - known)


def added(jobs: Sequence[JobView], new: set[int]) -> list[JobView]:
    """The views in `jobs` whose id() is in `new`, in their order. Searched from the end:
    callers append what is new (arrivals, requeued jobs), so the search stops early."""
    found: list[JobView] = []
    if new:
        left = set(new)
        for job in reversed(jobs):
            key = id(job)
            if key in left:
                found.append(job)
                left.discard(key)
                if not left:
                    break
        found.reverse()
    return found
