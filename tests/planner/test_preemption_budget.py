"""Preemption budgets: a per-job cap, and LAS preempting once per level it reaches (las-budget)."""

import pytest
from planner_helpers import job, node, reason, running, snap

from scheduler.planner import PolicyConfig, plan

NODES = [node("n1"), node("n2")]
HOUR = 3600.0


def test_las_with_a_cap_spares_a_job_preempted_as_often_as_allowed():
    # both are at LAS's last level; job 11 has wasted less, so LAS alone evicts it
    run = [running(10, {"n1": 8}, start=0.0), running(11, {"n2": 8}, start=1000.0, preemptions=1)]
    new = [job(1, gpus=8, submit_time=36_000.0)]
    las = PolicyConfig.preset("las")
    assert [p.job_id for p in plan(snap(NODES, new, run), 36_000.0, las).preempts] == [11]
    capped = PolicyConfig.preset("las", max_preemptions_per_job=1)
    assert [p.job_id for p in plan(snap(NODES, new, run), 36_000.0, capped).preempts] == [10]


def test_las_with_every_running_job_at_its_cap_lets_the_new_job_wait():
    run = [running(10, {"n1": 8}, start=0.0, preemptions=1),
           running(11, {"n2": 8}, start=0.0, preemptions=2)]
    capped = PolicyConfig.preset("las", max_preemptions_per_job=1)
    d = plan(snap(NODES, [job(1, gpus=8, submit_time=36_000.0)], run), 36_000.0, capped)
    assert d.preempts == [] and reason(d, 1) == "Resources"


# levels at 1 and 2 GPU-hours; a job may be preempted once per level it reaches
ONCE_PER_LEVEL = PolicyConfig.preset("las", las_thresholds_gpu_s=(HOUR, 2 * HOUR),
                                     las_preempt_once_per_level=True)


@pytest.mark.parametrize("served_h, preemptions, evicted", [
    (0.5, 0, False),   # level 0: never preempted
    (1.5, 0, True),    # level 1, not preempted yet
    (1.5, 1, False),   # level 1, preempted once already
    (2.5, 1, True),    # level 2, preempted once (at level 1)
    (2.5, 2, False),   # level 2, preempted twice
])
def test_las_preempts_a_job_once_per_level_it_reaches(served_h, preemptions, evicted):
    # one 1-GPU job fills a 1-GPU node; its service is attained before this run + this run
    r = running(10, {"n1": 1}, start=0.0, attained_gpu_s=(served_h - 0.25) * HOUR,
                preemptions=preemptions)
    d = plan(snap([node("n1", 1)], [job(1, submit_time=900.0)], [r]), 900.0, ONCE_PER_LEVEL)
    assert [p.job_id for p in d.preempts] == ([10] if evicted else [])
    assert reason(d, 1) == "Resources"


def test_las_budget_preset_never_preempts_a_job_under_its_first_level():
    policy = PolicyConfig.preset("las-budget")
    first = policy.las_thresholds_gpu_s[0]
    young = running(10, {"n1": 8}, start=0.0)  # 8 GPUs for just under the first level
    now = first / 8 - 1.0
    d = plan(snap([node("n1")], [job(1, gpus=8, submit_time=now)], [young]), now, policy)
    assert d.preempts == []
    d = plan(snap([node("n1")], [job(1, gpus=8, submit_time=now)], [young]), now + 2.0, policy)
    assert [p.job_id for p in d.preempts] == [10]


def test_bad_budget_settings_say_what_to_give():
    with pytest.raises(ValueError, match="max_preemptions_per_job: must be >= 0"):
        PolicyConfig.preset("las", max_preemptions_per_job=-1)
