"""Team quotas with borrowing and lending (Kueue cohorts), and preemption that wastes least."""

from hypothesis import given, settings
from hypothesis import strategies as st
from planner_helpers import job, node, reason, running, snap, started, wait_of

from scheduler.planner import PolicyConfig, QueuePolicy, TeamQuota, plan


def cohort_policy(**vision):
    teams = {
        "vision": TeamQuota("vision", nominal_gpus=8, cohort="research", **vision),
        "speech": TeamQuota("speech", nominal_gpus=8, cohort="research"),
    }
    return PolicyConfig(teams=teams)


NODES = [node("n1"), node("n2")]  # 16 GPUs: each team's nominal quota is 8


def test_a_team_borrows_unused_quota_from_its_cohort():
    pending = [job(i, gpus=4, account="speech") for i in range(1, 5)]
    d = plan(snap(NODES, pending), 0.0, cohort_policy())
    assert sorted(started(d)) == [1, 2, 3, 4]


def test_borrowing_teams_job_is_preempted_when_the_lender_submits_within_its_nominal_quota():
    # speech borrowed vision's 8 GPUs; vision now asks for 4 of its own
    run = [running(10, {"n1": 8}, start=0.0, account="speech", user="bob"),
           running(11, {"n2": 4}, start=0.0, account="speech", user="bob"),
           running(12, [("n2", (4, 5, 6, 7))], start=500.0, gpus=4, account="speech",
                   user="bob")]
    d = plan(snap(NODES, [job(1, gpus=4, account="vision")], run), 1000.0, cohort_policy())
    assert [p.job_id for p in d.preempts] == [12]  # the youngest: least GPU-time lost
    p = d.preempts[0]
    assert p.for_job == 1 and p.grace_period_s == 60.0
    assert "vision" in p.reason and "speech" in p.reason
    w = wait_of(d, 1)
    assert w.reason == "Resources" and w.estimated_start == 1060.0


def test_next_pass_waits_for_the_victim_instead_of_preempting_again():
    run = [running(10, {"n1": 8}, start=0.0, account="speech"),
           running(11, {"n2": 4}, start=0.0, account="speech"),
           running(12, [("n2", (4, 5, 6, 7))], start=500.0, gpus=4, account="speech",
                   preempted_at=1000.0)]
    d = plan(snap(NODES, [job(1, gpus=4, account="vision")], run), 1010.0, cohort_policy())
    assert d.preempts == []
    assert reason(d, 1) == "Resources"


def test_a_team_over_its_borrowing_limit_waits_with_quota_limit():
    run = [running(10, {"n1": 8}, account="vision")]
    policy = cohort_policy(borrowing_limit_gpus=2)
    d = plan(snap(NODES, [job(1, gpus=4, account="vision")], run), 0.0, policy)
    assert started(d) == []
    w = wait_of(d, 1)
    assert w.reason == "AssocGrpGRES" and "borrowing limit 2" in w.detail


def test_lending_limit_keeps_part_of_a_quota_for_its_team():
    # speech lends at most 2 of its 8 GPUs, so vision can reach 10 and no more
    teams = {"vision": TeamQuota("vision", nominal_gpus=8, cohort="c"),
             "speech": TeamQuota("speech", nominal_gpus=8, cohort="c", lending_limit_gpus=2)}
    run = [running(10, {"n1": 8}, account="vision")]
    pending = [job(1, gpus=2, account="vision"), job(2, gpus=1, account="vision")]
    d = plan(snap(NODES, pending, run), 0.0, PolicyConfig(teams=teams))
    assert started(d) == [1]
    assert reason(d, 2) == "AssocGrpGRES"


def test_team_without_a_cohort_stops_at_its_nominal_quota():
    policy = PolicyConfig(teams={"vision": TeamQuota("vision", nominal_gpus=4)})
    d = plan(snap(NODES, [job(1, gpus=4, account="vision"), job(2, gpus=1, account="vision")]),
             0.0, policy)
    assert started(d) == [1] and reason(d, 2) == "AssocGrpGRES"


def test_users_listed_in_a_team_are_charged_to_it():
    policy = PolicyConfig(teams={"vision": TeamQuota("vision", nominal_gpus=2, users=("alice",))})
    d = plan(snap(NODES, [job(1, gpus=4, user="alice")]), 0.0, policy)
    assert reason(d, 1) == "AssocGrpGRES"


TIERS = PolicyConfig(queues={"high": QueuePolicy("high", priority=10, preempts=("low",),
                                                 grace_period_s=30.0),
                             "low": QueuePolicy("low", grace_period_s=90.0)})


def test_high_queue_preempts_the_low_job_that_wastes_least_gpu_time():
    run = [running(10, {"n1": 8}, start=0.0, queue="low"),       # 8 GPUs x 1000 s
           running(11, {"n2": 8}, start=900.0, queue="low")]     # 8 GPUs x 100 s
    d = plan(snap(NODES, [job(1, gpus=8, queue="high")], run), 1000.0, TIERS)
    assert [(p.job_id, p.grace_period_s) for p in d.preempts] == [(11, 90.0)]
    assert "queue high preempts queue low" in d.preempts[0].reason


def test_preemption_frees_a_whole_gang_or_nothing():
    run = [running(10, {"n1": 8}, queue="low"), running(11, {"n2": 8}, queue="default")]
    d = plan(snap(NODES, [job(1, gpus=8, nodes=2, queue="high")], run), 10.0, TIERS)
    assert d.preempts == []  # the other node's job is not preemptible by queue high
    assert reason(d, 1) == "Resources"


def test_jobs_marked_not_preemptible_are_never_victims():
    run = [running(10, {"n1": 8}, queue="low", preemptible=False), running(11, {"n2": 8})]
    d = plan(snap(NODES, [job(1, gpus=8, queue="high")], run), 10.0, TIERS)
    assert d.preempts == []


def test_preemption_switched_off_leaves_running_jobs_alone():
    run = [running(10, {"n1": 8}, queue="low"), running(11, {"n2": 8}, queue="low")]
    policy = PolicyConfig(queues=TIERS.queues, preemption=False)
    d = plan(snap(NODES, [job(1, gpus=8, queue="high")], run), 10.0, policy)
    assert d.preempts == [] and reason(d, 1) == "Resources"


def test_las_preempts_the_job_with_the_most_attained_service_for_a_new_one():
    policy = PolicyConfig.preset("las")
    run = [running(10, {"n1": 8}, start=0.0),         # 80 GPU-hours: the last level
           running(11, {"n2": 8}, start=35_000.0)]    # 2.2 GPU-hours: the middle level
    d = plan(snap(NODES, [job(1, gpus=8, submit_time=35_900.0)], run), 36_000.0, policy)
    assert [p.job_id for p in d.preempts] == [10]
    assert "less GPU time" in d.preempts[0].reason


def test_las_runs_the_least_served_job_first():
    policy = PolicyConfig.preset("las")
    pending = [job(1, gpus=8, submit_time=0.0, attained_gpu_s=50_000.0),
               job(2, gpus=8, submit_time=10.0)]
    d = plan(snap([node("n1")], pending), 100.0, policy)
    assert started(d) == [2]


def test_gpus_a_reclaim_freed_go_to_the_reclaiming_team_not_back_to_the_borrower():
    """Kueue's order: a job within its team's nominal quota goes before one that borrows. The
    victim a reclaim preempted comes back PENDING and older than the job it made room for;
    taking its GPUs again would only make the reclaim preempt again (each time losing the work
    of a borrowing job), so the borrower waits while the lender asks for its own."""
    run = [running(10, {"n1": 8}, start=0.0, account="speech"),
           running(11, {"n2": 4}, start=0.0, account="speech"),
           running(12, [("n2", (4, 5, 6, 7))], start=500.0, gpus=4, account="speech")]
    lender = job(1, gpus=4, account="vision", submit_time=900.0)
    d = plan(snap(NODES, [lender], run), 1000.0, cohort_policy())
    assert [p.job_id for p in d.preempts] == [12]
    # job 12 left after its grace period and was requeued: pending again, submitted before job 1
    victim = job(12, gpus=4, account="speech", submit_time=400.0)
    d = plan(snap(NODES, [victim, lender], run[:2]), 1070.0, cohort_policy())
    assert started(d) == [1] and d.preempts == []
    w = wait_of(d, 12)
    assert w.reason == "AssocGrpGRES" and "team vision" in w.detail and "nominal" in w.detail


def test_a_borrower_still_borrows_what_the_lenders_pending_jobs_do_not_ask_for():
    run = [running(10, {"n1": 8}, start=0.0, account="speech")]
    pending = [job(2, gpus=4, account="speech", submit_time=1.0), job(3, gpus=2, account="speech", submit_time=2.0),
               job(1, gpus=2, account="vision", submit_time=3.0),
               job(4, gpus=4, account="vision", submit_time=4.0, held=True)]  # held: asks for nothing yet
    d = plan(snap(NODES, pending, run), 10.0, cohort_policy())
    # vision asks for 2 of its 8: speech may borrow the other 6 (4 + 2)
    assert sorted(started(d)) == [1, 2, 3]


def test_a_stopped_queues_jobs_leave_the_pool_to_borrowers():
    from scheduler.planner import QueueView

    run = [running(10, {"n1": 8}, start=0.0, account="speech")]
    pending = [job(2, gpus=8, account="speech", submit_time=1.0),
               job(1, gpus=8, account="vision", queue="frozen", submit_time=0.5)]
    stopped = {"default": QueueView("default"), "frozen": QueueView("frozen", open=False)}
    d = plan(snap(NODES, pending, run, queues=stopped), 10.0, cohort_policy())
    assert started(d) == [2] and reason(d, 1) == "PartitionInactive"  # Slurm's word for a stopped queue
    opened = {"default": QueueView("default"), "frozen": QueueView("frozen")}
    d = plan(snap(NODES, pending, run, queues=opened), 10.0, cohort_policy())
    assert started(d) == [1] and reason(d, 2) == "AssocGrpGRES"


@st.composite
def reclaims(draw):
    """A cluster of 8-GPU nodes that one team (speech) fills, borrowing from the other (vision);
    vision's job within its nominal quota; more of speech's jobs waiting, older than it."""
    n_nodes = draw(st.integers(2, 4))
    total = 8 * n_nodes
    lent = draw(st.integers(1, total - 1))  # vision's nominal quota; speech's is the rest
    teams = {"vision": TeamQuota("vision", nominal_gpus=lent, cohort="c"),
             "speech": TeamQuota("speech", nominal_gpus=total - lent, cohort="c")}
    run, jid = [], 100
    for i in range(n_nodes):
        used = 0
        while used < 8:
            g = draw(st.sampled_from([g for g in (1, 2, 4, 8) if g <= 8 - used]))
            run.append(running(jid, [(f"n{i}", tuple(range(used, used + g)))], gpus=g,
                               start=draw(st.floats(0, 900)), account="speech", submit_time=0.0))
            used, jid = used + g, jid + 1
    lender = job(1, gpus=draw(st.sampled_from([g for g in (1, 2, 4, 8) if g <= lent])), account="vision",
                 submit_time=950.0)
    more = [job(200 + k, gpus=draw(st.sampled_from([1, 2, 4, 8])), account="speech",
                submit_time=draw(st.floats(0, 949))) for k in range(draw(st.integers(0, 6)))]
    return [node(f"n{i}") for i in range(n_nodes)], run, lender, more, PolicyConfig(teams=teams)


@settings(max_examples=200, deadline=None)
@given(reclaims())
def test_a_reclaim_preempts_once_and_its_job_starts_when_the_victims_leave(w):
    """Whatever the sizes: the lender's job preempts borrowers once; when they have left (and are
    back in the queue, older than it) it starts, and nothing is preempted again."""
    nodes, run, lender, more, policy = w
    d = plan(snap(nodes, [lender, *more], run), 1000.0, policy)
    victims = {p.job_id for p in d.preempts}
    assert victims and all(p.for_job == 1 for p in d.preempts) and lender.id not in started(d)
    left = [r for r in run if r.id not in victims]
    requeued = [job(r.id, gpus=r.gpus, account="speech", submit_time=r.submit_time) for r in run if r.id in victims]
    d = plan(snap(nodes, [*requeued, lender, *more], left), 1000.0 + 61, policy)
    assert lender.id in started(d) and d.preempts == []


def test_an_array_asks_for_no_more_tasks_than_its_limit_lets_run():
    # vision's array of 1-GPU tasks, at most 2 at once (%2), one of them running: it asks for 1
    # more GPU of its 8, so speech may borrow the other 6
    run = [running(10, {"n1": 8}, start=0.0, account="speech"),
           running(20, {"n2": 1}, start=0.0, account="vision", array_parent=19, array_limit=2)]
    tasks = [job(21 + k, gpus=1, account="vision", array_parent=19, array_limit=2, submit_time=1.0)
             for k in range(50)]
    borrowers = [job(2, gpus=4, account="speech", submit_time=0.5), job(3, gpus=2, account="speech", submit_time=0.6),
                 job(4, gpus=1, account="speech", submit_time=0.7)]
    d = plan(snap(NODES, [*borrowers, *tasks], run), 10.0, cohort_policy())
    assert sorted(started(d)) == [2, 3, 21]
    assert reason(d, 4) == "AssocGrpGRES"  # the 7th GPU would leave none for the task that may run
