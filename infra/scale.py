"""Scaling a pool: which nodes go, draining them through the daemon, then changing the count."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from infra.config import MAX_POOL_COUNT, AwsPool, ClusterConfig, ConfigError

ListNodes = Callable[[], list[Mapping[str, Any]]]
DrainNode = Callable[[str, str], Any]
RemoveNode = Callable[[str, bool], Any]  # (name, force)
Report = Callable[[str], Any]


class ScaleError(Exception):
    """The scale cannot go ahead; the message says why and what to do."""


class DaemonUnreachable(ScaleError):
    pass


class DrainRefused(ScaleError):
    pass


class DrainTimeout(ScaleError):
    def __init__(self, busy: list[Mapping[str, Any]], timeout: float):
        self.busy = busy
        detail = ", ".join(f"{n['name']} ({n.get('state')}, {n.get('gpus_used', 0)} GPUs in use)" for n in busy)
        names = " ".join(n["name"] for n in busy)
        super().__init__(
            f"still not drained after {timeout:g}s: {detail}. Nothing was removed; they stay draining. "
            "Wait longer (--drain-timeout), cancel or requeue their jobs, pass --force to remove them "
            f"anyway, or give up with: trainyard node resume {names}"
        )


@dataclass(frozen=True)
class ScalePlan:
    pool: AwsPool
    target: int

    @property
    def current(self) -> int:
        return self.pool.count

    @property
    def leaving(self) -> list[str]:
        """The nodes a smaller count removes: the program numbers nodes 0..count-1, so the highest go."""
        return [self.pool.node_name(i) for i in range(self.current - 1, self.target - 1, -1)]

    @property
    def joining(self) -> list[str]:
        return [self.pool.node_name(i) for i in range(self.current, self.target)]

    def describe(self) -> str:
        head = f"pool {self.pool.name} ({self.pool.instance_type.name}): {self.current} -> {self.target} nodes"
        if self.leaving:
            return f"{head}; removing {', '.join(self.leaving)} (highest index first), after draining them"
        if self.joining:
            return f"{head}; adding {', '.join(self.joining)}"
        return f"{head}; nothing to change"


def plan_scale(config: ClusterConfig, pool_name: str, target: int) -> ScalePlan:
    pool = config.pool(pool_name)
    if not isinstance(pool, AwsPool):
        raise ConfigError(
            [f"pool {pool_name} is on-prem: its hosts are declared in {pool_name}'s hosts list, not scaled by count"]
        )
    if not 0 <= target <= MAX_POOL_COUNT:
        raise ConfigError([f"the new count for {pool_name} must be between 0 and {MAX_POOL_COUNT}, got {target}"])
    return ScalePlan(pool, target)


def is_drained(node: Mapping[str, Any]) -> bool:
    """Safe to remove: drained, or down with nothing allocated on it."""
    state = node.get("state")
    return state == "DRAINED" or (state == "DOWN" and not node.get("gpus_used"))


def drain(
    names: list[str],
    *,
    list_nodes: ListNodes,
    drain_node: DrainNode,
    reason: str,
    report: Report,
) -> list[str]:
    """Ask the daemon to drain each node; returns the names it knows (the ones to wait for)."""
    known = {n["name"]: n for n in list_nodes()}
    waiting = []
    for name in names:
        node = known.get(name)
        if node is None:
            report(f"  {name}: not registered with the daemon, nothing to drain")
            continue
        waiting.append(name)
        if is_drained(node):
            report(f"  {name}: already {node['state']}")
        elif node.get("state") == "DRAINING":
            report(f"  {name}: already draining ({node.get('gpus_used', 0)} GPUs in use)")
        else:
            drain_node(name, reason)
            report(f"  {name}: draining ({node.get('gpus_used', 0)} GPUs in use)")
    return waiting


def wait_drained(
    names: list[str],
    *,
    list_nodes: ListNodes,
    timeout: float,
    report: Report,
    poll: float = 10.0,
    sleep: Callable[[float], Any] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> None:
    """Block until every named node is drained (or gone from the daemon); DrainTimeout after `timeout`."""
    deadline = clock() + timeout
    last: tuple | None = None
    while True:
        current = {n["name"]: n for n in list_nodes()}
        busy = [current[n] for n in names if n in current and not is_drained(current[n])]
        if not busy:
            return
        if clock() >= deadline:
            raise DrainTimeout(busy, timeout)
        summary = tuple((n["name"], n.get("state"), n.get("gpus_used", 0)) for n in busy)
        if summary != last:
            waiting = ", ".join(f"{name} ({gpus} GPUs in use)" for name, _, gpus in summary)
            report(f"  waiting for running jobs to end on {waiting}")
            last = summary
        sleep(min(poll, max(0.0, deadline - clock())))


class Stack(Protocol):
    def set_pool_count(self, pool: AwsPool, count: int) -> None: ...
    def up(self, on_event: Any = None) -> dict[str, Any]: ...


def scale(
    stack: Stack,
    plan: ScalePlan,
    *,
    list_nodes: ListNodes,
    drain_node: DrainNode,
    report: Report,
    remove_node: RemoveNode | None = None,
    on_event: Any = None,
    force: bool = False,
    timeout: float = 3600.0,
    poll: float = 10.0,
    sleep: Callable[[float], Any] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> dict[str, Any]:
    """Drain the leaving nodes (wait unless forced), set the new count, update, then forget them in the daemon."""
    report(plan.describe())
    if plan.target == plan.current:
        return {}
    registered: list[str] = []
    if plan.leaving:
        reason = f"scale-down of pool {plan.pool.name} to {plan.target}"
        try:
            registered = drain(plan.leaving, list_nodes=list_nodes, drain_node=drain_node, reason=reason, report=report)
            if force:
                if registered:
                    report("  --force: not waiting for their jobs; jobs still running there will be lost")
            elif registered:
                wait_drained(registered, list_nodes=list_nodes, timeout=timeout, report=report, poll=poll, sleep=sleep, clock=clock)
                report("  drained: " + ", ".join(registered))
        except DaemonUnreachable as exc:
            if not force:
                raise DaemonUnreachable(
                    f"{exc}; cannot drain {', '.join(plan.leaving)}. Nothing was changed. Start the daemon "
                    "(or point TRAINYARD_URL at it), or pass --force to remove the nodes without draining"
                ) from None
            report(f"  --force: daemon unreachable ({exc}); removing without draining")
    stack.set_pool_count(plan.pool, plan.target)
    report(f"stack config: {plan.pool.name}.count = {plan.target}; updating")
    outputs = stack.up(on_event)
    for name in registered if remove_node is not None else []:
        try:
            remove_node(name, force)
            report(f"  {name}: removed from the scheduler")
        except ScaleError as exc:
            report(f"  {name}: still registered with the scheduler ({exc}); run: trainyard node remove {name}")
    return outputs
