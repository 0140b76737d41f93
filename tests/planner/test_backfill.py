"""EASY backfill: small jobs fill holes without delaying the top job's reservation."""

from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st
from planner_helpers import job, node, reason, running, snap, started, wait_of

from scheduler.planner import PolicyConfig, QueuePolicy, QueueView, plan

BACKFILL = PolicyConfig.preset("backfill")


def busy_cluster():
    # n1 fully busy until t=100, n2 half busy until t=1000
    nodes = [node("n1"), node("n2")]
    run = [running(90, {"n1": 8}, start=0.0, time_limit_s=100.0),
           running(91, {"n2": 4}, start=0.0, time_limit_s=1000.0)]
    return nodes, run


def test_top_job_gets_a_reservation_and_an_estimated_start():
    nodes, run = busy_cluster()
    d = plan(snap(nodes, [job(1, gpus=8, nodes=2, time_limit_s=50.0)], run), 10.0, BACKFILL)
    w = wait_of(d, 1)
    assert (w.reason, w.estimated_start) == ("Resources", 1000.0)


def test_short_job_backfills_when_it_ends_before_the_reservation():
    nodes, run = busy_cluster()
    pending = [job(1, gpus=8, nodes=2, time_limit_s=50.0), job(2, gpus=4, time_limit_s=500.0)]
    d = plan(snap(nodes, pending, run), 10.0, BACKFILL)
    assert started(d) == [2]
    assert d.starts[0].reason == "backfill"


def test_long_job_that_would_delay_the_reservation_waits_with_priority():
    nodes, run = busy_cluster()
    pending = [job(1, gpus=8, nodes=2, time_limit_s=50.0), job(2, gpus=4, time_limit_s=5000.0)]
    d = plan(snap(nodes, pending, run), 10.0, BACKFILL)
    assert started(d) == []
    assert reason(d, 2) == "Priority"


def test_job_without_time_gets_its_queues_default_limit():
    nodes, run = busy_cluster()
    pending = [job(1, gpus=8, nodes=2), job(2, gpus=4, queue="short")]
    queues = {"short": QueueView("short", default_time_limit_s=60.0),
              "default": QueueView("default", default_time_limit_s=3600.0)}
    d = plan(snap(nodes, pending, run, queues=queues), 10.0, BACKFILL)
    assert started(d) == [2]


def test_without_any_time_limit_nothing_is_promised_and_the_queue_holds():
    nodes, run = busy_cluster()
    run = [replace(r, time_limit_s=None) for r in run]
    pending = [job(1, gpus=8, nodes=2), job(2, gpus=4)]
    d = plan(snap(nodes, pending, run), 10.0, BACKFILL)
    assert started(d) == []
    assert wait_of(d, 1).estimated_start is None
    assert reason(d, 2) == "Priority"


def test_backfill_can_be_switched_off_per_policy():
    nodes, run = busy_cluster()
    pending = [job(1, gpus=8, nodes=2, time_limit_s=50.0), job(2, gpus=4, time_limit_s=5.0)]
    d = plan(snap(nodes, pending, run), 10.0, PolicyConfig.preset("fifo"))
    assert started(d) == []


def test_queue_max_time_caps_the_limit_used_for_planning():
    nodes, run = busy_cluster()
    pending = [job(1, gpus=8, nodes=2, time_limit_s=50.0),
               job(2, gpus=4, queue="short", time_limit_s=99999.0)]
    policy = PolicyConfig(queues={"short": QueuePolicy("short", max_time_limit_s=100.0)})
    d = plan(snap(nodes, pending, run), 10.0, policy)
    assert started(d) == [2]


# --- the guarantee, over random workloads -------------------------------------------------

@st.composite
def workloads(draw):
    n_nodes = draw(st.integers(1, 5))
    sizes = [draw(st.sampled_from([4, 8])) for _ in range(n_nodes)]
    nodes = [node(f"n{i}", gpus=g) for i, g in enumerate(sizes)]
    now = 100.0
    used = {f"n{i}": 0 for i in range(n_nodes)}
    run = []
    for rid in range(draw(st.integers(0, 8))):
        i = draw(st.integers(0, n_nodes - 1))
        name = f"n{i}"
        free = sizes[i] - used[name]
        if free == 0:
            continue
        g = draw(st.integers(1, free))
        alloc = ((name, tuple(range(used[name], used[name] + g))),)
        used[name] += g
        start = draw(st.floats(0, now))
        limit = draw(st.floats(now - start + 1, now - start + 2000))
        run.append(job(1000 + rid, g, start_time=start, allocation=alloc, time_limit_s=limit))
    pending = []
    for pid in range(draw(st.integers(1, 12))):
        g = draw(st.sampled_from([1, 2, 4, 8]))
        k = draw(st.integers(1, 2))
        pending.append(job(pid + 1, g, nodes=k, submit_time=draw(st.floats(0, now)),
                           time_limit_s=draw(st.floats(1, 3000))))
    return nodes, run, pending, now


def free_at(t, nodes, run, started_jobs, now):
    """Free GPUs per node at time t if every job runs exactly to its time limit."""
    free = {n.name: n.gpus_total for n in nodes}
    for j, start in [(r, r.start_time) for r in run] + started_jobs:
        if max(start + j.time_limit_s, now) > t:
            for name, gpus in j.allocation:
                free[name] -= len(gpus)
    return free


@settings(max_examples=300, deadline=None)
@given(workloads())
def test_backfill_never_delays_the_top_jobs_reservation(w):
    nodes, run, pending, now = w
    d = plan(snap(nodes, pending, run), now, BACKFILL)
    by_id = {j.id: j for j in pending}
    # no GPU is handed out twice
    taken = {(n, g) for r in run for n, gs in r.allocation for g in gs}
    for s in d.starts:
        for n, gs in s.allocation:
            for g in gs:
                assert (n, g) not in taken
                taken.add((n, g))
    top = next((x for x in d.waits if x.reason == "Resources"), None)
    if top is None or top.estimated_start is None:
        return
    t = top.estimated_start
    assert t >= now
    started_jobs = [(replace(by_id[s.job_id], allocation=s.allocation), now) for s in d.starts]
    free = free_at(t, nodes, run, started_jobs, now)
    need = by_id[top.job_id]
    assert sum(1 for v in free.values() if v >= need.gpus) >= need.nodes, (
        f"job {need.id} reserved at {t} no longer fits: free at t = {free}"
    )
