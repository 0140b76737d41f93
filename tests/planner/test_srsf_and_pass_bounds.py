"""SRSF/QSSF ordering and preemption, backfill on predictions, and the bounded planner pass."""

import random

import pytest
from planner_helpers import job, node, reason, running, snap, started, wait_of

from scheduler.planner import PolicyConfig, plan
from scheduler.planner.ordering import PendingOrder
from scheduler.settings import Settings

SRSF = PolicyConfig(name="srsf", order="srsf", backfill=False, queueing="best_effort")


def test_srsf_starts_the_job_with_least_remaining_service_first():
    s = snap([node("n1", 1)], [job(1, predicted_runtime_s=7200.0),
                               job(2, predicted_runtime_s=60.0)])
    d = plan(s, 10.0, SRSF)
    assert started(d) == [2]
    assert reason(d, 1) == "Resources"


def test_srsf_counts_gpus_and_service_already_received():
    # job 1 is short per GPU but uses 8 GPUs; job 2 had most of its work done before
    s = snap([node("n1", 8)], [job(1, gpus=8, predicted_runtime_s=600.0),
                               job(2, gpus=8, predicted_runtime_s=7200.0,
                                   attained_gpu_s=8 * 7000.0)])
    assert started(plan(s, 10.0, SRSF)) == [2]


def test_srsf_aging_lets_a_long_waiting_job_ahead_of_a_newer_short_one():
    jobs = [job(1, submit_time=0.0, predicted_runtime_s=4000.0),
            job(2, submit_time=3000.0, predicted_runtime_s=100.0)]
    s = snap([node("n1", 1)], jobs)
    assert started(plan(s, 3000.0, SRSF)) == [2]
    aged = PolicyConfig(name="srsf", order="srsf", backfill=False, queueing="best_effort",
                        srsf_aging=2.0)
    assert started(plan(s, 3000.0, aged)) == [1]


def test_srsf_preempts_a_job_with_much_more_left_and_says_why():
    r = running(10, {"n1": 1}, start=0.0, predicted_runtime_s=100000.0)
    s = snap([node("n1", 1)], [job(1, submit_time=50.0, predicted_runtime_s=600.0)], [r])
    d = plan(s, 100.0, SRSF)
    assert [p.job_id for p in d.preempts] == [10]
    assert "needs less GPU time" in d.preempts[0].reason
    assert wait_of(d, 1).estimated_start == 160.0  # after the 60 s grace period


def test_srsf_does_not_preempt_where_it_does_not_pay():
    # 2,000 s left against 600 s: worth it at ratio 1, not at ratio 16 (QSSF's)
    r = running(10, {"n1": 1}, start=0.0, predicted_runtime_s=2100.0)
    s = snap([node("n1", 1)], [job(1, submit_time=50.0, predicted_runtime_s=600.0)], [r])
    assert [p.job_id for p in plan(s, 100.0, SRSF).preempts] == [10]
    picky = PolicyConfig(name="srsf", order="srsf", backfill=False, queueing="best_effort",
                         srsf_preempt_ratio=16.0)
    d = plan(s, 100.0, picky)
    assert d.preempts == [] and reason(d, 1) == "Resources"


def test_backfill_uses_a_prediction_below_the_time_limit():
    # job 1 holds the node until t=1000; job 2 (8 GPUs) reserves it from t=1000. Job 3 asks
    # for 1 day but history says 10 minutes: it fits before the reservation only by prediction
    r = running(1, {"n1": 4}, start=0.0, time_limit_s=1000.0)
    pending = [job(2, gpus=8, submit_time=1.0, time_limit_s=100.0),
               job(3, gpus=2, submit_time=2.0, time_limit_s=86400.0, predicted_runtime_s=600.0)]
    s = snap([node("n1", 8)], pending, [r])
    plain = PolicyConfig(name="backfill")
    assert started(plan(s, 10.0, plain)) == []
    assert started(plan(s, 10.0, PolicyConfig(name="backfill", backfill_on_prediction=True))) == [3]


def test_qssf_is_a_daemon_policy_and_the_oracle_is_not():
    assert Settings.from_toml({"scheduler": {"policy": "qssf"}}).to_policy().order == "srsf"
    with pytest.raises(ValueError, match="only in `trainyard simulate --policy oracle`"):
        Settings.from_toml({"scheduler": {"policy": "oracle"}})
    with pytest.raises(ValueError, match="queue_depth"):
        Settings.from_toml({"scheduler": {"queue_depth": 0}})


def test_a_long_strict_backlog_gets_one_decision_per_job_and_cancels_deep_in_it():
    running_job = running(1, {"n1": 8}, start=0.0)
    backlog = [job(i, gpus=8) for i in range(2, 2000)]
    backlog.append(job(5000, dependency="afterok:77", submit_time=9999.0))
    s = snap([node("n1", 8)], backlog, [running_job], finished={77: "FAILED"})
    d = plan(s, 10.0, PolicyConfig.preset("fifo"))
    assert [c.job_id for c in d.cancels] == [5000]  # decided even though the pass stopped early
    assert reason(d, 2) == "Resources"
    assert reason(d, 1999) == "Priority"
    assert wait_of(d, 1999).detail == "queue default waits for job 2 first"
    assert len(d.waits) + len(d.cancels) == len(backlog)


def test_queue_depth_bounds_how_many_jobs_behind_a_blocked_one_are_tried():
    r = running(1, {"n1": 6}, start=0.0, time_limit_s=1000.0)
    pending = [job(2, gpus=8, time_limit_s=100.0)] + \
              [job(i, gpus=4, time_limit_s=100.0) for i in range(3, 6)] + \
              [job(6, gpus=1, time_limit_s=100.0)]
    s = snap([node("n1", 8)], pending, [r])
    assert started(plan(s, 10.0, PolicyConfig(name="backfill"))) == [6]
    shallow = plan(s, 10.0, PolicyConfig(name="backfill", queue_depth=3))
    assert started(shallow) == []
    assert reason(shallow, 6) == "Priority"


@pytest.mark.parametrize("preset", ["fifo", "backfill", "fairshare", "las", "qssf"])
def test_a_kept_order_gives_the_same_decisions_as_a_fresh_one(preset):
    """Pass after pass with jobs arriving, starting and leaving: the cached order never
    changes a decision (the daemon and a replay keep one; tests mostly do not)."""
    rng = random.Random(7)
    policy = PolicyConfig.preset(preset)
    memo = PendingOrder()
    pending = {}
    next_id = 1
    for step in range(60):
        for _ in range(rng.randint(0, 6)):
            pending[next_id] = job(next_id, gpus=rng.choice([1, 2, 4, 8]),
                                   user=rng.choice(["ann", "bob", "cy"]),
                                   queue=rng.choice(["a", "b"]), submit_time=float(step),
                                   time_limit_s=rng.choice([60.0, 600.0, 6000.0]),
                                   predicted_runtime_s=rng.choice([None, 30.0, 3000.0]),
                                   attained_gpu_s=rng.choice([0.0, 5000.0, 50000.0]))
            next_id += 1
        busy = rng.randint(0, 8)
        r = [running(9999, {"n1": busy}, start=0.0)] if busy else []
        s = snap([node("n1", 8), node("n2", 4)], list(pending.values()), r,
                 usage={"user:ann": 1e5, "team:default": 1e5})
        warm = plan(s, float(step), policy, memo)
        cold = plan(s, float(step), policy)
        assert warm == cold
        for st in warm.starts:
            del pending[st.job_id]
        for jid in rng.sample(sorted(pending), k=min(len(pending), rng.randint(0, 2))):
            del pending[jid]  # cancelled
