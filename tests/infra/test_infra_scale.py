"""Scaling a pool with injected daemon calls: which nodes go, drain first, wait, then change the count."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from infra_helpers import FakeDaemon, aws_pool, daemon, onprem_pool, stack_config

from infra.config import ConfigError, parse_config
from infra.scale import DaemonUnreachable, DrainRefused, DrainTimeout, plan_scale, scale


def config(count: int = 4):
    return parse_config(stack_config(aws_pool("a100", "p4d.24xlarge", count), onprem_pool("lab", 1)), default_name="dev")


@dataclass
class FakeStack:
    log: list = field(default_factory=list)

    def set_pool_count(self, pool, count):
        self.log.append(("set", pool.name, count))

    def up(self, on_event=None):
        self.log.append(("up",))
        return {"inventory": []}


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def run(plan, d: FakeDaemon, stack: FakeStack | None = None, **kw):
    stack = stack or FakeStack()
    lines: list[str] = []
    clock = Clock()
    result = scale(
        stack, plan, list_nodes=d.list_nodes, drain_node=d.drain_node, remove_node=d.remove_node,
        report=lines.append, sleep=clock.sleep, clock=clock, poll=10, **kw,
    )
    return stack, lines, clock, result


def test_scale_down_removes_the_highest_indexes_and_says_so_first():
    plan = plan_scale(config(4), "a100", 2)
    assert plan.leaving == ["a100-3", "a100-2"] and plan.joining == []
    assert plan.describe() == (
        "pool a100 (p4d.24xlarge): 4 -> 2 nodes; removing a100-3, a100-2 (highest index first), after draining them"
    )


def test_scale_up_adds_the_next_indexes():
    plan = plan_scale(config(2), "a100", 4)
    assert plan.joining == ["a100-2", "a100-3"] and plan.leaving == []


def test_leaving_nodes_are_drained_and_waited_for_before_the_count_changes():
    d = daemon(("a100-0", "UP", 8), ("a100-1", "UP", 8), ("a100-2", "UP", 8), ("a100-3", "UP", 4), busy_polls={"a100-3": 3})
    stack, lines, clock, _ = run(plan_scale(config(4), "a100", 2), d)

    assert [n for n, _ in d.drained] == ["a100-3", "a100-2"]
    assert all(reason == "scale-down of pool a100 to 2" for _, reason in d.drained)
    assert d.nodes["a100-0"]["state"] == "UP"  # staying nodes are left alone
    assert stack.log == [("set", "a100", 2), ("up",)]
    assert clock.now == 30  # three polls while a100-3 still ran its job
    assert lines[0].startswith("pool a100 (p4d.24xlarge): 4 -> 2 nodes; removing a100-3, a100-2")
    assert "  a100-3: draining (4 GPUs in use)" in lines
    assert "  waiting for running jobs to end on a100-3 (4 GPUs in use)" in lines
    assert "  drained: a100-3, a100-2" in lines
    # after the update, the scheduler forgets them
    assert d.removed == [("a100-3", False), ("a100-2", False)] and sorted(d.nodes) == ["a100-0", "a100-1"]
    assert lines[-1] == "  a100-2: removed from the scheduler"


def test_already_drained_down_and_unknown_nodes_are_not_drained_again():
    d = daemon(("a100-3", "DRAINED", 0), ("a100-2", "DOWN", 0), ("a100-1", "DRAINING", 2), busy_polls={"a100-1": 1})
    stack, lines, clock, _ = run(plan_scale(config(5), "a100", 0), d)
    assert d.drained == []
    assert "  a100-4: not registered with the daemon, nothing to drain" in lines
    assert "  a100-0: not registered with the daemon, nothing to drain" in lines
    assert "  a100-3: already DRAINED" in lines and "  a100-2: already DOWN" in lines
    assert "  a100-1: already draining (2 GPUs in use)" in lines
    assert stack.log == [("set", "a100", 0), ("up",)]


def test_a_drain_that_does_not_finish_in_time_changes_nothing():
    d = daemon(("a100-1", "UP", 8), busy_polls={"a100-1": 1000})
    with pytest.raises(DrainTimeout) as info:
        run(plan_scale(config(2), "a100", 1), d, stack=(stack := FakeStack()), timeout=60)
    assert stack.log == []
    assert str(info.value) == (
        "still not drained after 60s: a100-1 (DRAINING, 8 GPUs in use). Nothing was removed; they stay draining. "
        "Wait longer (--drain-timeout), cancel or requeue their jobs, pass --force to remove them anyway, "
        "or give up with: trainyard node resume a100-1"
    )


def test_force_drains_but_does_not_wait_and_removes_the_node_anyway():
    d = daemon(("a100-1", "UP", 8), busy_polls={"a100-1": 1000})
    stack, lines, clock, _ = run(plan_scale(config(2), "a100", 1), d, force=True)
    assert d.drained and clock.now == 0 and stack.log == [("set", "a100", 1), ("up",)]
    assert any("--force: not waiting" in line for line in lines)
    assert d.removed == [("a100-1", True)]


def test_a_node_the_daemon_will_not_forget_is_named_with_the_command_to_run():
    d = daemon(("a100-1", "UP", 0))
    stack = FakeStack()
    lines: list[str] = []

    def refuse(name, force):
        raise DrainRefused("the daemon refused: operator role required")

    scale(stack, plan_scale(config(2), "a100", 1), list_nodes=d.list_nodes, drain_node=d.drain_node,
          remove_node=refuse, report=lines.append, sleep=lambda s: None)
    assert stack.log == [("set", "a100", 1), ("up",)]
    assert lines[-1] == (
        "  a100-1: still registered with the scheduler (the daemon refused: operator role required); "
        "run: trainyard node remove a100-1"
    )


def test_an_unreachable_daemon_stops_a_scale_down_unless_forced():
    d = daemon(("a100-1", "UP", 8))
    d.reachable = False
    with pytest.raises(DaemonUnreachable, match="cannot drain a100-1. Nothing was changed.*--force") as info:
        run(plan_scale(config(2), "a100", 1), d, stack=(stack := FakeStack()))
    assert stack.log == [] and "connection refused" in str(info.value)
    stack, lines, _, _ = run(plan_scale(config(2), "a100", 1), d, force=True)
    assert stack.log == [("set", "a100", 1), ("up",)]
    assert any("daemon unreachable" in line for line in lines)


def test_a_refused_drain_stops_the_scale():
    d = daemon(("a100-1", "UP", 8))

    def refuse(name, reason):
        raise DrainRefused("the daemon refused: operator role required")

    with pytest.raises(DrainRefused):
        scale(FakeStack(), plan_scale(config(2), "a100", 1), list_nodes=d.list_nodes, drain_node=refuse, report=print)


def test_scale_up_needs_no_daemon():
    def no_daemon():
        raise AssertionError("scale-up must not talk to the daemon")

    stack = FakeStack()
    scale(stack, plan_scale(config(1), "a100", 3), list_nodes=no_daemon, drain_node=no_daemon, report=print)
    assert stack.log == [("set", "a100", 3), ("up",)]


def test_the_same_count_changes_nothing():
    stack, lines, _, result = run(plan_scale(config(2), "a100", 2), daemon())
    assert stack.log == [] and result == {} and lines == ["pool a100 (p4d.24xlarge): 2 -> 2 nodes; nothing to change"]


@pytest.mark.parametrize(
    ("pool", "count", "message"),
    [
        ("h100", 1, "no pool named 'h100' in trainyard:pools (pools: a100, lab)"),
        ("lab", 3, "pool lab is on-prem: its hosts are declared in lab's hosts list, not scaled by count"),
        ("a100", 10_000, "the new count for a100 must be between 0 and 512, got 10000"),
    ],
)
def test_impossible_scales_are_refused(pool, count, message):
    with pytest.raises(ConfigError) as info:
        plan_scale(config(), pool, count)
    assert info.value.problems == [message]
