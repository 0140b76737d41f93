"""Multifactor priority and fair share: who goes first, as an operator would check it."""

import pytest
from planner_helpers import job, node, reason, snap, started

from scheduler.planner import PolicyConfig, PriorityWeights, QueuePolicy, UsageLedger, plan

ONE_NODE = [node("n1", gpus=1)]


def first_started(policy, pending, now=1000.0, **kw):
    d = plan(snap(ONE_NODE, pending, **kw), now, policy)
    assert len(d.starts) == 1
    return d.starts[0].job_id


def test_older_job_goes_first_under_age_weight():
    policy = PolicyConfig(weights=PriorityWeights(age=1000, queue=0))
    assert first_started(policy, [job(2, submit_time=500.0), job(1, submit_time=100.0)]) == 1


def test_team_with_less_decayed_usage_goes_first_under_fair_share():
    ledger = UsageLedger(half_life_s=3600)
    ledger.charge("alice", "vision", 50_000, now=0)
    ledger.charge("bob", "speech", 1_000, now=0)
    policy = PolicyConfig.preset("fairshare")
    pending = [job(1, user="alice", account="vision", submit_time=0.0),
               job(2, user="bob", account="speech", submit_time=10.0)]
    assert first_started(policy, pending, usage=ledger.decayed(1000.0)) == 2


def test_within_a_team_the_lighter_user_goes_first():
    ledger = UsageLedger()
    ledger.charge("alice", "vision", 9_000, now=0)
    ledger.charge("carol", "vision", 100, now=0)
    policy = PolicyConfig.preset("fairshare")
    pending = [job(1, user="alice", account="vision"), job(2, user="carol", account="vision")]
    assert first_started(policy, pending, usage=ledger.decayed(0.0)) == 2


def test_larger_jobs_first_when_job_size_is_weighted():
    policy = PolicyConfig(weights=PriorityWeights(age=0, job_size=1000, queue=0))
    nodes = [node("n1", gpus=8)]
    d = plan(snap(nodes, [job(1, gpus=1), job(2, gpus=8)]), 0.0, policy)
    assert started(d) == [2]


def test_favor_small_reverses_the_size_factor():
    policy = PolicyConfig(weights=PriorityWeights(age=0, job_size=1000, queue=0, favor_small=True))
    d = plan(snap([node("n1", gpus=8)], [job(1, gpus=8), job(2, gpus=1)]), 0.0, policy)
    assert started(d)[0] == 2


def test_higher_priority_queue_goes_first():
    policy = PolicyConfig(queues={"high": QueuePolicy("high", priority=10),
                                  "low": QueuePolicy("low", priority=1)})
    pending = [job(1, queue="low", submit_time=0.0), job(2, queue="high", submit_time=50.0)]
    assert first_started(policy, pending) == 2


def test_nice_value_lowers_a_jobs_priority():
    policy = PolicyConfig(weights=PriorityWeights(age=1000, queue=0))
    pending = [job(1, submit_time=0.0, nice=500), job(2, submit_time=10.0)]
    assert first_started(policy, pending) == 2


def test_fifo_runs_in_submit_order_and_the_blocked_head_holds_the_queue():
    policy = PolicyConfig.preset("fifo")
    d = plan(snap([node("n1", gpus=8, free=4)], [job(1, gpus=8), job(2, gpus=1)]), 0.0, policy)
    assert started(d) == []
    assert (reason(d, 1), reason(d, 2)) == ("Resources", "Priority")


def test_a_job_that_can_never_fit_says_so_and_does_not_hold_the_queue():
    d = plan(snap([node("n1", gpus=4)], [job(1, gpus=8), job(2, gpus=1)]), 0.0,
             PolicyConfig.preset("fifo"))
    assert reason(d, 1) == "Resources"  # 8 GPUs never fit on a 4-GPU node: no constraint, so Resources
    assert started(d) == [2]


def test_usage_halves_after_one_half_life():
    ledger = UsageLedger(half_life_s=100)
    ledger.charge("alice", "vision", 800, now=0)
    usage = ledger.decayed(200)
    assert usage["user:alice"] == pytest.approx(200)
    assert usage["team:vision"] == pytest.approx(200)


def test_a_run_is_charged_each_second_decayed_from_when_it_was_used():
    ledger = UsageLedger(half_life_s=1e12)  # no decay to speak of: plain GPU-seconds
    ledger.charge_run("alice", "vision", gpus=4, start=0, end=100)
    assert ledger.decayed(100)["team:vision"] == pytest.approx(400, rel=1e-6)
    fast = UsageLedger(half_life_s=10)
    fast.charge_run("alice", "vision", gpus=1, start=0, end=1000)
    # an hour-old run decays away; only the last half-lives count
    assert fast.decayed(1000)["user:alice"] == pytest.approx(10 / 0.6931, rel=1e-3)


def test_decayed_usage_counts_what_running_jobs_used_so_far():
    ledger = UsageLedger(half_life_s=1e12)
    run = job(1, gpus=2, start_time=0.0, allocation=(("n1", (0, 1)),), account="vision")
    usage = ledger.decayed(50, running=[run])
    assert usage["user:alice"] == pytest.approx(100, rel=1e-6)
    assert usage["team:vision"] == pytest.approx(100, rel=1e-6)


def test_ledger_refuses_negative_charges():
    with pytest.raises(ValueError, match="gpu_seconds"):
        UsageLedger().charge("a", "t", -1, 0)


def test_the_running_jobs_usage_kept_between_calls_equals_each_runs_value():
    """The ledger keeps per-key sums of the running jobs' use and looks only at the jobs that
    came or went: after any mix of arrivals, ends, views replaced, runs that start later, and
    months between calls, each key's usage is what run_value gives for its runs (plus charges)."""
    import random

    rng = random.Random(5)
    ledger = UsageLedger(3600.0)
    running: list = []
    now, next_id = 1000.0, 1
    for step in range(600):
        now += rng.choice((0.5, 30.0, 600.0, 3600.0 * 24 * 40)) if step % 50 == 49 else rng.uniform(0, 60)
        for _ in range(rng.randint(0, 3)):  # arrivals, some of them starting later
            start = now + rng.choice((-300.0, -1.0, 0.0, 5.0, 200.0))
            running.append(job(next_id, gpus=rng.choice((0, 1, 8)), user=rng.choice(("ann", "bo", "cy")),
                               nodes=rng.choice((1, 2)), account=rng.choice(("vision", "nlp")),
                               start_time=start))
            next_id += 1
        if running and rng.random() < 0.5:  # an end: charged as finished
            done = running.pop(rng.randrange(len(running)))
            if done.start_time < now:
                ledger.charge_run(done.user, done.account, done.gpus * done.nodes, done.start_time, now)
        if running and rng.random() < 0.2:  # a job's view replaced (its row changed)
            i = rng.randrange(len(running))
            running[i] = job(running[i].id, gpus=running[i].gpus, user=running[i].user, nodes=running[i].nodes,
                             account=running[i].account, start_time=running[i].start_time, priority=step)
        usage = ledger.decayed(now, tuple(running) if step % 2 else list(running))
        fresh = UsageLedger(3600.0)
        fresh._ref, fresh._value = ledger._ref, ledger._value  # the same charges, no kept runs
        expected = fresh.decayed(now)
        for r in running:
            v = ledger.run_value(r.gpus * r.nodes, r.start_time, now)
            if v > 0:
                for key in (f"user:{r.user}", f"team:{r.account}"):
                    expected[key] = expected.get(key, 0.0) + v
        assert usage.keys() == expected.keys(), step
        for key, v in expected.items():
            assert usage[key] == pytest.approx(v, rel=1e-9, abs=1e-6), (step, key)
