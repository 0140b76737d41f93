"""The demo's workload: a slice of Philly submitted to the demo daemon over its API, as its users."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass

from .traces import load_trace
from .traces.demo import PHILLY_SLICE, DemoJob, demo_jobs, team_of

log = logging.getLogger("trainyard.demo")

USERS = ("ann", "bob", "chen", "dee")
TEAMS = ("vision", "speech")
QUEUE_MIX = ("prod", "dev", "dev", "dev")  # one job in four is production work

PERIOD_S = 300.0  # one pass over the slice; then it starts again
SLICE_SPAN_S = 12 * 3600.0
MAX_RUNTIME_S = 90.0
WARMUP_S = 30.0  # the slice's first seconds are submitted at once: busy from the start
STEPS = 5  # lines of output per job, one per "epoch"


@dataclass(frozen=True)
class FeedPlan:
    """What the feeder submits: the slice's jobs, once every `period_s`, and what that offers."""

    jobs: list[DemoJob]
    period_s: float
    keep: float  # the fraction of the slice's jobs replayed
    offered_load: float  # GPU-seconds of the kept jobs / (period x the cluster's GPUs)


def team_members() -> dict[str, list[str]]:
    """team -> its demo users (the rule demo_jobs assigns teams by)."""
    out: dict[str, list[str]] = {t: [] for t in TEAMS}
    for user in USERS:
        out[team_of(user, TEAMS)].append(user)
    return out


def plan_feed(gpus_total: int, load: float = 0.9, seed: int = 0) -> FeedPlan:
    """The shipped Philly slice compressed into PERIOD_S and thinned so that its jobs offer
    `load` of `gpus_total` GPUs (Philly ran thousands of GPUs; the demo has a few dozen)."""
    if gpus_total <= 0:
        raise ValueError(f"the demo cluster has no GPUs ({gpus_total}); use --gpus-per-node 1 or more")
    trace = load_trace(PHILLY_SLICE)
    kw = dict(seconds=PERIOD_S, speedup=SLICE_SPAN_S / PERIOD_S, users=USERS, teams=TEAMS,
              queues=QUEUE_MIX, max_gpus=min(8, gpus_total), max_runtime_s=MAX_RUNTIME_S, seed=seed)
    full = demo_jobs(trace, **kw)
    service = sum(j.runtime_s * j.gpus for j in full)
    keep = min(1.0, load * gpus_total * PERIOD_S / service)
    jobs = demo_jobs(trace, keep=keep, **kw)
    offered = sum(j.runtime_s * j.gpus for j in jobs) / (PERIOD_S * gpus_total)
    return FeedPlan(jobs, PERIOD_S, keep, offered)


def due(jobs: list[DemoJob], period_s: float, since: float, until: float) -> list[DemoJob]:
    """The jobs whose submission falls in (since, until] seconds from the feed's start, the
    slice repeating every `period_s`; in submission order."""
    out: list[DemoJob] = []
    if until <= since:
        return out
    for lap in range(max(0, math.floor(since / period_s)), math.floor(until / period_s) + 1):
        base = lap * period_s
        out.extend(j for j in jobs if since < base + j.at_s <= until)
    return out


def job_request(job: DemoJob) -> dict:
    """The POST /v1/jobs body for one demo job: a shell loop that prints its epochs and sleeps
    its run time, then exits with the job's code; the time limit a user would give (~2x)."""
    step = job.runtime_s / STEPS
    fail = (f"echo 'RuntimeError: loss is NaN at epoch {STEPS} (trace job {job.trace_id})' >&2; "
            if job.exit_code else "")
    script = (f"echo '{job.name}: {job.gpus} GPU(s), {job.runtime_s:.0f} s, "
              f"GPUs '\"$CUDA_VISIBLE_DEVICES\"; i=0; while [ $i -lt {STEPS} ]; do "
              f"sleep {step:.2f}; i=$((i+1)); echo \"epoch $i/{STEPS}\"; done; "
              f"{fail}exit {job.exit_code}")
    return {"command": ["sh", "-c", script], "name": job.name, "queue": job.queue,
            "gpus": job.gpus, "time_limit": int(job.runtime_s * 2) + 30}


async def feed(url: str, tokens: dict[str, str], plan: FeedPlan, stop: asyncio.Event,
               max_backlog: int, tick_s: float = 0.25, warmup_s: float = WARMUP_S) -> None:
    """Submit the plan's jobs as their users until `stop`, the slice over and over; while the
    pending backlog is `max_backlog` jobs or more (nodes drained, faults) the due jobs are
    skipped, so a stalled cluster does not pile up an endless queue."""
    import httpx

    headers = {u: {"Authorization": f"Bearer {t}"} for u, t in tokens.items()}
    any_user = next(iter(tokens))
    start = time.monotonic()
    since = -1.0  # before the slice's first submission (at 0)
    backlog, checked = 0, -math.inf
    async with httpx.AsyncClient(base_url=url, timeout=10.0) as client:
        while not stop.is_set():
            now = time.monotonic() - start + warmup_s  # the slice's clock runs warmup_s ahead
            jobs = due(plan.jobs, plan.period_s, since, now)
            since = now
            if jobs and time.monotonic() - checked > 2.0:
                backlog, checked = await _backlog(client, headers[any_user]), time.monotonic()
            for job in jobs:
                if backlog >= max_backlog:
                    break
                await _submit(client, headers[job.user], job)
                backlog += 1
            try:
                await asyncio.wait_for(stop.wait(), tick_s)
            except TimeoutError:
                pass


async def _backlog(client, headers: dict) -> int:
    try:
        r = await client.get("/v1/queues", headers=headers)
        r.raise_for_status()
        return sum(q.get("pending", 0) for q in r.json())
    except Exception as e:  # noqa: BLE001 - the feed goes on; the daemon says what is wrong
        log.warning("demo feed: cannot read the queues: %s", e)
        return 0


async def _submit(client, headers: dict, job: DemoJob) -> None:
    try:
        r = await client.post("/v1/jobs", json=job_request(job), headers=headers)
        if r.status_code >= 400:
            log.warning("demo feed: job %s refused (%s): %s", job.name, r.status_code, r.text[:200])
    except Exception as e:  # noqa: BLE001 - a lost submission is a demo's blemish, not its end
        log.warning("demo feed: cannot submit %s: %s", job.name, e)


def describe(plan: FeedPlan, gpus_total: int) -> str:
    """One line for the person who started the demo: what it replays, as whom, how busy."""
    users = sorted({j.user for j in plan.jobs})
    return (f"replaying {len(plan.jobs)} jobs of Philly's busiest 12 hours "
            f"({plan.keep:.0%} of them) every {plan.period_s:.0f} s as {', '.join(users)}: "
            f"{plan.offered_load:.0%} offered load on {gpus_total} GPUs")
