"""A short, time-compressed slice of a trace as jobs a live demo cluster can be fed (pure)."""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

from . import TraceJob

# the busiest 12 hours of Philly, shipped with trainyard (data/README.md: source and licence)
PHILLY_SLICE = Path(__file__).with_name("data") / "philly-busiest-12h.csv"


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
    trace_id: int = 0  # the job's row in the trace


def team_of(user: str, teams: tuple[str, ...]) -> str:
    """The team a demo user belongs to: the same for a name on every run and machine."""
    return teams[sum(map(ord, user)) % len(teams)]


def demo_jobs(trace: list[TraceJob], seconds: float = 120.0, speedup: float = 600.0,
              start_s: float | None = None, users: tuple[str, ...] = ("ann", "bob", "chen", "dee"),
              teams: tuple[str, ...] = ("vision", "speech"), queues: tuple[str, ...] = ("default",),
              max_gpus: int = 8, fail_fraction: float = 0.1, seed: int = 0,
              keep: float = 1.0, max_runtime_s: float | None = None) -> list[DemoJob]:
    """The trace's jobs submitted within `seconds x speedup` of `start_s` (default: the busiest
    stretch), with times divided by `speedup`, run times capped to `max_runtime_s` (default:
    the demo's `seconds`), GPUs capped to `max_gpus`, a `keep` fraction of them chosen (a
    trace of thousands of GPUs thinned for a demo of a few dozen), and users, teams, queues
    (repeat a name to weight it) and failures assigned from `seed`."""
    if seconds <= 0 or speedup <= 0:
        raise ValueError(f"seconds and speedup must be > 0, got {seconds!r} and {speedup!r}")
    if not 0 < keep <= 1:
        raise ValueError(f"keep is the fraction of the trace's jobs to replay, in (0, 1]; got {keep!r}")
    span = seconds * speedup
    cap = float(seconds if max_runtime_s is None else max_runtime_s)
    if start_s is None:
        start_s = _busiest(trace, span)
    rng = random.Random(seed)
    out = []
    for j in trace:
        if not start_s <= j.submit < start_s + span:
            continue
        if keep < 1 and rng.random() >= keep:
            continue
        user = j.user or rng.choice(users)
        out.append(DemoJob(
            at_s=(j.submit - start_s) / speedup,
            user=user,
            team=j.team or team_of(user, teams),
            queue=rng.choice(queues),
            name=j.name or f"{j.vc or 'job'}-{j.id}",
            gpus=min(max_gpus, j.gpus),
            runtime_s=max(1.0, min(j.duration / speedup, cap)),
            exit_code=1 if rng.random() < fail_fraction else 0,
            trace_id=j.id,
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
