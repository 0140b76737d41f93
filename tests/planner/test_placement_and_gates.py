"""Gang placement (all or nothing, topology, constraints) and the pending-reason gates."""

from planner_helpers import job, node, reason, running, snap, started

from scheduler.planner import PolicyConfig, QueuePolicy, QueueView, plan


def nodes_of(d, job_id):
    s = next(s for s in d.starts if s.job_id == job_id)
    return [n for n, _ in s.allocation]


def test_gang_starts_on_all_its_nodes_or_not_at_all():
    nodes = [node("n1"), node("n2", free=4)]
    d = plan(snap(nodes, [job(1, gpus=8, nodes=2)]), 0.0)
    assert started(d) == [] and reason(d, 1) == "Resources"


def test_gang_members_get_distinct_nodes_and_the_gpus_asked_for():
    nodes = [node(f"n{i}") for i in range(3)]
    d = plan(snap(nodes, [job(1, gpus=4, nodes=3)]), 0.0)
    alloc = d.starts[0].allocation
    assert len({n for n, _ in alloc}) == 3
    assert all(len(g) == 4 for _, g in alloc)


def test_gang_prefers_nodes_under_one_rack():
    nodes = [node("a1", labels={"rack": "a"}), node("b1", labels={"rack": "b"}),
             node("a2", labels={"rack": "a"}), node("b2", labels={"rack": "b"}),
             node("b3", labels={"rack": "b"})]
    d = plan(snap(nodes, [job(1, gpus=8, nodes=2)]), 0.0)
    assert sorted(nodes_of(d, 1)) == ["a1", "a2"]  # rack a fits the gang exactly


def test_switch_is_preferred_over_rack_when_both_are_labelled():
    nodes = [node("x", labels={"switch": "s1", "rack": "r1"}),
             node("y", labels={"switch": "s2", "rack": "r1"}),
             node("z", labels={"switch": "s1", "rack": "r2"})]
    d = plan(snap(nodes, [job(1, gpus=8, nodes=2)]), 0.0)
    assert sorted(nodes_of(d, 1)) == ["x", "z"]


def test_single_gpu_jobs_fill_the_fullest_node_first():
    nodes = [node("empty"), node("half", free=4)]
    d = plan(snap(nodes, [job(1, gpus=2)]), 0.0)
    assert nodes_of(d, 1) == ["half"]


def test_constraint_and_gpu_type_pick_matching_nodes():
    nodes = [node("v", gpu_model="Tesla V100", labels={"zone": "a"}),
             node("h", gpu_model="NVIDIA H100 80GB", labels={"zone": "b"})]
    d = plan(snap(nodes, [job(1, gpu_type="h100"), job(2, constraint={"zone": "a"})]), 0.0)
    assert nodes_of(d, 1) == ["h"] and nodes_of(d, 2) == ["v"]


def test_unsatisfiable_constraint_is_reported_not_waited_for_forever():
    d = plan(snap([node("n1")], [job(1, constraint={"zone": "mars"})]), 0.0)
    assert reason(d, 1) == "BadConstraints"


def test_exclusive_job_needs_an_idle_node_and_blocks_it_for_others():
    nodes = [node("busy"), node("idle")]
    run = [running(10, {"busy": 1})]
    d = plan(snap(nodes, [job(1, gpus=1, exclusive=True), job(2, gpus=1)], run), 0.0)
    assert nodes_of(d, 1) == ["idle"] and nodes_of(d, 2) == ["busy"]
    run = [running(10, {"idle": 1}, exclusive=True)]
    d = plan(snap([node("idle")], [job(2, gpus=1)], run), 0.0)
    assert started(d) == []


def test_drained_nodes_get_no_jobs():
    d = plan(snap([node("n1", schedulable=False)], [job(1)]), 0.0)
    assert started(d) == []


def test_queue_node_selector_keeps_a_queue_on_its_own_nodes():
    policy = PolicyConfig(queues={"vc1": QueuePolicy("vc1", node_selector={"vc": "1"})})
    nodes = [node("a", labels={"vc": "2"}), node("b", labels={"vc": "1"})]
    d = plan(snap(nodes, [job(1, queue="vc1")]), 0.0, policy)
    assert nodes_of(d, 1) == ["b"]


def test_held_job_waits_with_held():
    d = plan(snap([node("n1")], [job(1, held=True)]), 0.0)
    assert reason(d, 1) == "Held" and started(d) == []


def test_stopped_queue_waits_with_queue_stopped():
    d = plan(snap([node("n1")], [job(1)], queues={"default": QueueView("default", open=False)}),
             0.0)
    assert reason(d, 1) == "PartitionInactive"


def test_stopped_in_config_when_the_snapshot_has_no_queue_view():
    policy = PolicyConfig(queues={"default": QueuePolicy("default", open=False)})
    d = plan(snap([node("n1")], [job(1)]), 0.0, policy)
    assert reason(d, 1) == "PartitionInactive"


def test_every_pending_job_gets_exactly_one_decision():
    nodes = [node("n1", gpus=2)]
    pending = [job(i, gpus=1, held=(i == 3)) for i in range(1, 6)]
    d = plan(snap(nodes, pending), 0.0)
    ids = [s.job_id for s in d.starts] + [w.job_id for w in d.waits + d.cancels]
    assert sorted(ids) == [1, 2, 3, 4, 5]
    assert all(w.reason for w in d.waits)


def test_plan_is_deterministic():
    nodes = [node(f"n{i}", free=i % 9) for i in range(20)]
    pending = [job(i, gpus=1 + i % 8, nodes=1 + i % 2, time_limit_s=100.0 * i) for i in range(50)]
    assert plan(snap(nodes, pending), 5.0) == plan(snap(nodes, pending), 5.0)
