"""A short, time-compressed slice of a trace as jobs a live demo cluster can be fed (pure)."""

from __future__ import annotations

import random
from dataclasses import dataclass

from . import TraceJob


@dataclass(frozen=True, slots=True)
class DemoJob:
    at_s: float  # when to submit, seconds from the demo's start
    user: str
    team: str
    queue: str
    name: str
    gpus: int
    runtime_s: float  # how long its process runs (compressed)
    exit_code: int  # 0, or non-zero for the jobs that fail as in real clusters


def demo_jobs(trace: list[TraceJob], seconds: float = 120.0, speedup: float = 600.0,
              start_s: float | None = None, users: tuple[str, ...] = ("ann", "bob", "chen", "dee"),
              teams: tuple[str, ...] = ("vision", "speech"), queues: tuple[str, ...] = ("default",),
              max_gpus: int = 8, fail_fraction: float = 0.1, seed: int = 0) -> list[DemoJob]:
    """The trace's jobs submitted within `seconds x speedup` of `start_s` (default: the busiest
    stretch), with times divided by `speedup`, run times capped to the demo, GPUs capped to
    `max_gpus`, and users, teams, queues and failures assigned from `seed`."""
    if seconds <= 0 or speedup <= 0:
        raise ValueError(f"seconds and speedup must be > 0, got {seconds!r} and {speedup!r}")
    span = seconds * speedup
    if start_s is None:
        start_s = _busiest(trace, span)
    rng = random.Random(seed)
    out = []
    for j in trace:
        if not start_s <= j.submit < start_s + span:
            continue
        user = j.user or rng.choice(users)
        out.append(DemoJob(
            at_s=(j.submit - start_s) / speedup,
            user=user,
            team=j.team or teams[sum(map(ord, user)) % len(teams)],  # stable across runs
            queue=rng.choice(queues),
            name=j.name or f"{j.vc or 'job'}-{j.id}",
            gpus=min(max_gpus, j.gpus),
            runtime_s=max(1.0, min(j.duration / speedup, float(seconds))),
            exit_code=1 if rng.random() < fail_fraction else 0,
        ))
    return out


def _busiest(trace: list[TraceJob], span: float) -> float:
    """The start of the `span` with the most submissions (a sliding window over sorted times)."""
    best, best_start, lo = 0, 0.0, 0
    for hi, j in enumerate(trace):
        while trace[lo].submit < j.submit - span:
            lo += 1
        if hi - lo + 1 > best:
            best, best_start = hi - lo + 1, trace[lo].submit
    return best_start
