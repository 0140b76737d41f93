"""The running jobs a pass looks at for victims (`ServiceIndex`, kept between passes) are never
fewer than a sweep over every running job would keep: under SRSF every job with more service
left than the threshold, under LAS every job with at least that much service attained, as the
jobs start, leave and time passes."""

import random

import pytest
from planner_helpers import running

from scheduler.planner.preemption import ServiceIndex

GRACE = 60.0


def _left_net(v, now: float) -> float:
    """Service left net of the grace period's cost, as the pass computes it."""
    run = (now - v.start_time) * v.gpus * v.nodes
    left = v.time_limit_s * v.gpus * v.nodes - (v.attained_gpu_s + max(0.0, run))
    return max(0.0, left) - GRACE * v.gpus * v.nodes


def _attained(v, now: float) -> float:
    return v.attained_gpu_s + max(0.0, (now - v.start_time) * v.gpus * v.nodes)


def _left_constant(v) -> float:
    g = v.gpus * v.nodes
    return (v.time_limit_s - GRACE) * g - v.attained_gpu_s + v.start_time * g


def _attained_constant(v) -> float:
    return v.attained_gpu_s - v.start_time * v.gpus * v.nodes


@pytest.mark.parametrize("rate", [-1, 1])
def test_candidates_hold_every_job_past_the_threshold_and_leave_most_out(rate):
    rng = random.Random(rate)
    exact = _left_net if rate < 0 else _attained
    constant = _left_constant if rate < 0 else _attained_constant
    index = ServiceIndex()
    jobs: dict[int, object] = {}
    pruned = 0
    for step in range(300):
        now = 1.5e9 + step * 97.0  # epoch seconds, as traces give them
        for jid in rng.sample(sorted(jobs), k=min(len(jobs), rng.randint(0, 3))):
            del jobs[jid]
        for _ in range(rng.randint(0, 4)):
            jid = step * 10 + len(jobs) + 1
            gpus = rng.choice([1, 2, 4, 8])
            jobs[jid] = running(jid, {f"n{jid % 7}": gpus}, start=now - rng.uniform(0, 5000),
                                time_limit_s=rng.choice([300.0, 3600.0, 86400.0]),
                                attained_gpu_s=rng.choice([0.0, 1e3, 1e5]))
        views = tuple(jobs.values())
        threshold = rng.choice([0.0, 1e3, 5e4, 2e5])
        got = {v.id for v in index.candidates(views, "sig", now, rate, threshold, constant)}
        past = {v.id for v in views if exact(v, now) >= threshold}
        assert past <= got, f"step {step}: jobs past {threshold} left out: {past - got}"
        pruned += len(views) - len(got)
    assert pruned > 0  # it does leave jobs out, or it would save nothing


def test_a_job_started_after_now_makes_it_look_at_every_job():
    index = ServiceIndex()
    early = running(1, {"n0": 8}, start=1000.0, time_limit_s=10.0, attained_gpu_s=0.0)
    ahead = running(2, {"n1": 8}, start=5000.0, time_limit_s=10.0, attained_gpu_s=9e5)
    got = index.candidates((early, ahead), "sig", 2000.0, 1, 1e5, _attained_constant)
    assert {v.id for v in got} == {1, 2}


def test_jobs_that_may_not_be_evicted_are_never_candidates():
    index = ServiceIndex()
    keep = running(1, {"n0": 8}, start=0.0, time_limit_s=1e6, attained_gpu_s=0.0)
    guarded = running(2, {"n1": 8}, start=0.0, time_limit_s=1e6, attained_gpu_s=0.0,
                      preemptible=False)

    def constant(v):
        return _left_constant(v) if v.preemptible else None

    got = index.candidates((keep, guarded), "sig", 10.0, -1, -float("inf"), constant)
    assert [v.id for v in got] == [1]
