"""How many nodes a pool needs for its pending jobs, and which idle nodes may go (pure decisions)."""

from __future__ import annotations

import pytest

from scheduler.daemon.autoscale import Demand, PoolShape, idle_nodes, nodes_needed
from scheduler.settings import Settings, SettingsError

P5 = dict(gpu_model="NVIDIA H100 80GB HBM3", gpus_per_node=8, labels={"instance-type": "p5.48xlarge"})


def pool(name="p5", count=0, lo=0, hi=8, free=(), **over) -> PoolShape:
    return PoolShape(name, **{**P5, **over}, count=count, min=lo, max=hi, free=tuple(free))


def test_a_four_node_gang_needs_four_nodes_not_one():
    (resize,) = nodes_needed([Demand(12, gpus=8, nodes=4)], [pool(count=4, free=())]).values()
    assert (resize.current, resize.target, resize.jobs) == (4, 8, (12,))
    assert resize.reason == "pool p5: 4 -> 8 for jobs 12"


def test_free_gpus_of_the_pool_count_before_new_nodes():
    needed = nodes_needed([Demand(12, gpus=8, nodes=4)], [pool(count=2, free=(8, 8))])
    assert needed["p5"].target == 4


def test_a_gang_never_puts_two_ranks_on_one_node():
    # one node with 8 free GPUs cannot hold two ranks of 4: the gang needs a second node
    needed = nodes_needed([Demand(7, gpus=4, nodes=2)], [pool(count=1, free=(8,))])
    assert needed["p5"].target == 2


def test_small_jobs_share_new_nodes():
    needed = nodes_needed([Demand(i, gpus=2) for i in range(1, 5)] + [Demand(5, gpus=4)], [pool()])
    assert (needed["p5"].target, needed["p5"].jobs) == (2, (1, 2, 3, 4, 5))


def test_never_above_max_and_a_gang_that_cannot_fit_adds_nothing():
    needed = nodes_needed([Demand(12, gpus=8, nodes=4), Demand(13, gpus=8, nodes=2)],
                          [pool(count=4, hi=6)])
    assert (needed["p5"].target, needed["p5"].jobs) == (6, (13,))


def test_a_job_goes_to_the_pool_whose_gpus_it_asked_for():
    l4 = pool("l4", gpu_model="NVIDIA L4", gpus_per_node=4, labels={"instance-type": "g6.12xlarge"})
    needed = nodes_needed([Demand(1, gpus=1, gpu_type="l4"), Demand(2, gpus=8, gpu_type="h100"),
                           Demand(3, gpus=16), Demand(4, gpus=1, labels={"instance-type": "g6.12xlarge"})],
                          [pool(), l4])
    assert (needed["p5"].jobs, needed["l4"].jobs) == ((2,), (1, 4))  # 16 GPUs per node: no pool


def test_min_is_kept_without_demand_and_nothing_else_is_added():
    assert nodes_needed([], [pool(count=1, lo=2)])["p5"].target == 2
    assert nodes_needed([], [pool(count=2, lo=2)]) == {}


def test_only_a_run_of_idle_nodes_at_the_top_goes_and_never_below_min():
    names = {i: f"p5-{i}" for i in range(4)}
    idle = {"p5-3": 0.0, "p5-2": 0.0, "p5-0": 0.0}  # p5-1 runs a job
    resize = idle_nodes(pool(count=4), names, idle, now=600.0, idle_s=600.0)
    assert resize.leaving == ("p5-3", "p5-2") and resize.reason == "pool p5: 4 -> 2, idle: p5-3, p5-2"
    assert idle_nodes(pool(count=4, lo=3), names, idle, now=600.0, idle_s=600.0).leaving == ("p5-3",)
    assert idle_nodes(pool(count=4), names, idle, now=599.0, idle_s=600.0) is None
    assert idle_nodes(pool(count=4), names, {"p5-2": 0.0}, now=900.0, idle_s=600.0) is None


@pytest.mark.parametrize(("table", "problem"), [
    ({"p5": {"min": 6, "max": 4}}, "autoscale.p5: min = 6 is above max = 4; set min <= max"),
    ({"p5": {"max": 4, "cooldown_minutes": -1}}, "autoscale.p5.cooldown_minutes: must be >= 0, got -1"),
    ({"p5": {"max": 4, "idle": 5}}, "autoscale.p5.idle: unknown setting (value 5); known settings: "
                                    "cooldown_minutes, idle_minutes, max, min"),
])
def test_bad_autoscale_tables_are_refused_naming_the_key(table, problem):
    with pytest.raises(SettingsError) as info:
        Settings.from_toml({"autoscale": table})
    assert info.value.problems == [problem]
