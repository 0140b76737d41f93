"""What is new in a pass's snapshot against the last one, found by the views' identities."""

from __future__ import annotations

from collections.abc import Sequence

from .types import JobView


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
