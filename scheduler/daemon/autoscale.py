"""Capacity that follows the queue: AWS pools grow for pending jobs and shrink when idle."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from sqlmodel import col, or_, select

from .. import models as m
from ..models import Job, Node
from ..planner.types import BAD_CONSTRAINT, RESOURCES
from ..settings import AutoscalePoolSettings, InfraSettings, SettingsError
from ..slurm.features import satisfies
from .caller import Caller
from .clock import Clock
from .errors import DomainError
from .inventory import Inventory, NodeRequest
from .state import StateStore

log = logging.getLogger("trainyard.autoscale")

ACTOR = "autoscale"
CALLER = Caller(ACTOR, "admin")


# ------------------------------------------------------------------------------ the decisions
@dataclass(frozen=True)
class Demand:
    """A job pending for Resources, as the autoscaler sizes it: `nodes` nodes of `gpus` GPUs."""

    job_id: int
    gpus: int  # per node
    nodes: int = 1
    gpu_type: str = ""
    labels: Mapping[str, str] = field(default_factory=dict)  # its constraints and its queue's selector
    features: str = ""


@dataclass(frozen=True)
class PoolShape:
    """An autoscaled pool: what one of its nodes looks like, how many it has, its bounds."""

    name: str
    gpu_model: str
    gpus_per_node: int
    count: int
    min: int
    max: int
    labels: Mapping[str, str] = field(default_factory=dict)  # the labels its nodes carry
    free: tuple[int, ...] = ()  # free GPUs of its nodes that take (or are about to take) work

    def fits(self, d: Demand) -> bool:
        if d.gpus > self.gpus_per_node or d.nodes > self.max:
            return False
        if d.gpu_type and d.gpu_type.lower() not in self.gpu_model.lower():
            return False
        if d.features and not satisfies(d.features, self.labels):
            return False
        return all(self.labels.get(k) == v for k, v in d.labels.items())


@dataclass(frozen=True)
class Resize:
    """One decision: a pool's count from `current` to `target`, and why."""

    pool: str
    current: int
    target: int
    jobs: tuple[int, ...] = ()  # the pending jobs a scale-up is for
    leaving: tuple[str, ...] = ()  # the idle nodes a scale-down removes

    @property
    def reason(self) -> str:
        head = f"pool {self.pool}: {self.current} -> {self.target}"
        if self.jobs:
            return f"{head} for jobs {', '.join(str(j) for j in self.jobs)}"
        return f"{head}, idle: {', '.join(self.leaving)}"


def nodes_needed(pending: Sequence[Demand], pools: Sequence[PoolShape]) -> dict[str, Resize]:
    """The scale-ups that would start the pending jobs, pool by pool (pure).

    Jobs are taken in the order given (the queue's order); each goes to the first pool whose
    instance type can run it. A gang of N nodes needs N nodes with its GPUs free: the pool's
    free GPUs are used first, then new nodes, packed first-fit. A job that would take a pool
    above its max adds nothing there (a partial gang starts nothing)."""
    bins = {p.name: list(p.free) for p in pools}
    added = {p.name: 0 for p in pools}
    jobs: dict[str, list[int]] = {p.name: [] for p in pools}
    for d in pending:
        if d.nodes < 1 or d.gpus < 0:
            continue
        for p in pools:
            if not p.fits(d):
                continue
            trial = list(bins[p.name])
            taken: set[int] = set()  # one rank per node: a gang's ranks on distinct nodes
            new = 0
            for _ in range(d.nodes):
                i = next((i for i, free in enumerate(trial) if i not in taken and free >= d.gpus), None)
                if i is None:
                    trial.append(p.gpus_per_node)
                    new += 1
                    i = len(trial) - 1
                taken.add(i)
                trial[i] -= d.gpus
            if p.count + added[p.name] + new > p.max:
                continue
            bins[p.name] = trial
            added[p.name] += new
            if any(i >= len(p.free) for i in taken):  # it starts on a node this scale-up adds
                jobs[p.name].append(d.job_id)
            break
    out = {}
    for p in pools:
        target = max(p.count + added[p.name], p.min)
        if target > p.count:
            out[p.name] = Resize(p.name, p.count, min(target, p.max), tuple(jobs[p.name]))
    return out


def idle_nodes(pool: PoolShape, names_by_index: Mapping[int, str], idle_since: Mapping[str, float],
               now: float, idle_s: float) -> Resize | None:
    """The scale-down of a pool whose highest-numbered nodes sat idle `idle_s` (pure).

    The Pulumi program numbers a pool's nodes 0..count-1, so a smaller count removes the
    highest: only a run of idle nodes at the top can go, never below min."""
    leaving: list[str] = []
    for index in range(pool.count - 1, pool.min - 1, -1):
        name = names_by_index.get(index)
        since = idle_since.get(name) if name else None
        if since is None or now - since < idle_s:
            break
        leaving.append(name)
    if not leaving:
        return None
    return Resize(pool.name, pool.count, pool.count - len(leaving), leaving=tuple(leaving))


# ------------------------------------------------------------------------------ the boundaries
class StackLike(Protocol):
    """What the autoscaler needs of infra.automation.InfraStack."""

    def config(self) -> Any: ...
    def set_pool_count(self, pool: Any, count: int) -> None: ...
    def up(self, on_event: Any = None) -> dict[str, Any]: ...


Bootstrap = Callable[[list[dict]], Mapping[str, bool]]  # inventory document -> node name -> ok


def ansible_bootstrap(public_key: Path) -> Bootstrap:
    """The playbooks (site.yml through ansible-runner) on new nodes; the daemon's key authorised."""

    def run(doc: list[dict]) -> Mapping[str, bool]:
        from ..bootstrap import inventory_from_document, run_bootstrap  # noqa: PLC0415 - heavy

        result = run_bootstrap(inventory_from_document(doc),
                               extravars={"common_trainyard_ssh_public_key": public_key.read_text().strip()})
        return {n["name"]: (h := result.hosts.get(n["name"])) is not None
                and h.outcome in ("ok", "changed") for n in doc}

    return run


def open_stack(infra: InfraSettings) -> StackLike:
    """The Pulumi stack of [infra], through the Automation API (needs the pulumi CLI)."""
    from infra.automation import InfraStack, find_project_dir  # noqa: PLC0415 - pulumi is heavy

    project = Path(infra.project_dir).expanduser() if infra.project_dir else find_project_dir()
    return InfraStack(project, infra.stack or None)


# ------------------------------------------------------------------------------ the loop
@dataclass
class PoolState:
    settings: AutoscalePoolSettings
    pool: Any  # infra.config.AwsPool, as the stack config last said
    busy: asyncio.Task | None = None
    last_end: float | None = None  # when the last operation ended (the cooldown counts from here)
    failure: str = ""  # why the last operation failed, until the next one succeeds
    failed_jobs: tuple[int, ...] = ()
    joining: set[str] = field(default_factory=set)

    @property
    def cooldown_s(self) -> float:
        return self.settings.cooldown_minutes * 60


class Autoscaler:
    """Raises and lowers the counts of the [autoscale.POOL] pools through the Pulumi program."""

    def __init__(self, store: StateStore, inventory: Inventory, clock: Clock, infra: InfraSettings,
                 pools: Mapping[str, AutoscalePoolSettings], bootstrap: Bootstrap,
                 selectors: Callable[[str], Mapping[str, str]] = lambda queue: {},
                 stack_factory: Callable[[], StackLike] | None = None):
        self.store = store
        self.inventory = inventory
        self.clock = clock
        self.infra = infra
        self.bootstrap = bootstrap
        self.selectors = selectors
        self.stack_factory = stack_factory or (lambda: open_stack(infra))
        self.pools: dict[str, PoolState] = {}
        self.idle_since: dict[str, float] = {}
        self._settings = dict(pools)

    @property
    def enabled(self) -> bool:
        return bool(self._settings)

    def check(self) -> None:
        """Read the stack's pools once; SettingsError naming the key for a pool that is not AWS."""
        if not self._settings:
            return
        from infra.automation import InfraError  # noqa: PLC0415
        from infra.config import AwsPool, ConfigError  # noqa: PLC0415

        try:
            config = self.stack_factory().config()
        except (InfraError, ConfigError) as e:
            raise SettingsError([f"autoscale: cannot read the Pulumi stack of [infra]: {e}"]) from None
        problems = []
        for name, settings in self._settings.items():
            try:
                pool = config.pool(name)
            except ConfigError as e:
                problems.append(f"autoscale.{name}: {e.problems[0]}; autoscale names AWS pools")
                continue
            if not isinstance(pool, AwsPool):
                problems.append(f"autoscale.{name}: pool {name} is an on-prem pool; only AWS pools "
                                "are scaled (remove [autoscale." + name + "])")
                continue
            self.pools[name] = PoolState(settings, pool)
        if problems:
            raise SettingsError(problems)

    # ---------------------------------------------------------------- one pass
    async def loop(self, running: Callable[[], bool]) -> None:
        while running():
            await asyncio.sleep(self.infra.autoscale_interval)
            try:
                self.tick()
            except Exception:
                log.exception("autoscale pass failed")

    def tick(self) -> list[Resize]:
        """Decide, and start an operation on each pool that needs one and is free to take it."""
        now = self.clock.time()
        with self.store.read() as s:
            nodes = s.exec(select(Node).where(col(Node.pool).in_(list(self.pools)))).all()
            # "Resources (scale-up ... failed ...)" is still Resources: the failure is held in it
            waiting = or_(col(Job.reason).in_([RESOURCES, BAD_CONSTRAINT]),
                          col(Job.reason).startswith(f"{RESOURCES} ("))
            pending = s.exec(select(Job).where(Job.state == m.PENDING, Job.held == "", waiting)
                             .order_by(col(Job.priority).desc(), Job.id)).all()
            demand = [self._demand(j) for j in pending if not j.nodelist]
        busy_nodes = {n.name for n in nodes if self.store.active.on(n.name)}
        self._track_idle(nodes, busy_nodes, now)
        shapes = {name: self._shape(ps, [n for n in nodes if n.pool == name])
                  for name, ps in self.pools.items()}
        ups = nodes_needed(demand, list(shapes.values()))
        started = []
        for name, ps in self.pools.items():
            self._hold_reasons(ps)
            if ps.busy is not None or (ps.last_end is not None and now < ps.last_end + ps.cooldown_s):
                continue
            resize = ups.get(name)
            if resize is None and not any(shapes[name].fits(d) for d in demand):  # none it could run
                by_index = {i: f"{name}-{i}" for i in range(ps.pool.count)}
                registered = {n.name for n in nodes}
                by_index = {i: n for i, n in by_index.items() if n in registered}
                resize = idle_nodes(shapes[name], by_index, self.idle_since, now,
                                    ps.settings.idle_minutes * 60)
            if resize is None:
                continue
            ps.busy = asyncio.get_running_loop().create_task(self._operate(ps, resize),
                                                              name=f"autoscale {name}")
            started.append(resize)
        return started

    async def settle(self) -> None:
        """Wait for the operations in flight (tests, and a daemon that stops)."""
        tasks = [ps.busy for ps in self.pools.values() if ps.busy is not None]
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t

    async def stop(self) -> None:
        for ps in self.pools.values():
            if ps.busy is not None:
                ps.busy.cancel()
        await self.settle()

    def pending_reason(self, job_id: int) -> str | None:
        """The reason a job pends when a scale-up for it failed (the cycle's "Resources" refined)."""
        for name, ps in self.pools.items():
            if ps.failure and job_id in ps.failed_jobs:
                return self._failure_reason(name, ps)
        return None

    # ---------------------------------------------------------------- what the pass reads
    def _demand(self, job: Job) -> Demand:
        labels = {**self.selectors(job.queue), **(job.constraint or {})}
        return Demand(job.id, job.gpus, job.nodes, job.gpu_type or "", labels, job.features or "")

    def _shape(self, ps: PoolState, nodes: list[Node]) -> PoolShape:
        used = self._gpus_used()
        free = []
        for n in nodes:
            if n.state == m.UP:
                free.append(max(0, n.gpus_total - used.get(n.name, 0)))
            elif n.name in ps.joining and n.state not in (m.DRAINING, m.DRAINED):
                free.append(ps.pool.instance_type.gpu_count)
        from infra.inventory import aws_node  # noqa: PLC0415 - the labels its nodes get

        labels = aws_node(ps.pool, 0, "")["labels"]
        return PoolShape(ps.pool.name, ps.pool.instance_type.gpu_model, ps.pool.instance_type.gpu_count,
                         ps.pool.count, ps.settings.min, ps.settings.max, labels, tuple(free))

    def _gpus_used(self) -> dict[str, int]:
        from .overview import Overview  # noqa: PLC0415

        with self.store.read() as s:
            return Overview.gpu_usage(s)

    def _track_idle(self, nodes: Iterable[Node], busy: set[str], now: float) -> None:
        for n in nodes:
            if n.state == m.UP and n.name not in busy:
                self.idle_since.setdefault(n.name, now)
            else:
                self.idle_since.pop(n.name, None)
        for ps in self.pools.values():
            ps.joining = {j for j in ps.joining if any(n.name == j and n.state != m.UP for n in nodes)}

    def _failure_reason(self, name: str, ps: PoolState) -> str:
        after = time.strftime("%H:%M:%S", time.localtime((ps.last_end or 0) + ps.cooldown_s))
        return f"{RESOURCES} (scale-up of pool {name} failed: {ps.failure}; next try after {after})"[:500]

    def _hold_reasons(self, ps: PoolState) -> None:
        """Keep the failure in the pending reason of the jobs the failed scale-up was for."""
        if not ps.failure or not ps.failed_jobs:
            return
        reason = self._failure_reason(ps.pool.name, ps)
        with self.store.tx() as s:
            for jid in ps.failed_jobs:
                job = s.get(Job, jid)
                if job is not None and job.state == m.PENDING and job.reason == RESOURCES:
                    job.reason = reason
                    s.add(job)

    # ---------------------------------------------------------------- operations
    async def _operate(self, ps: PoolState, resize: Resize) -> None:
        name = ps.pool.name
        try:
            stack = await asyncio.to_thread(self.stack_factory)
            config = await asyncio.to_thread(stack.config)
            ps.pool = config.pool(name)
            if ps.pool.count != resize.current:  # changed by hand since the pass read it
                self.store.audit(ACTOR, "autoscale.skip", name, {
                    "reason": f"pool {name}: count is {ps.pool.count} in the stack, not {resize.current}; "
                              "re-planning"})
                return
            if resize.target > resize.current:
                await self._grow(ps, stack, resize)
            else:
                await self._shrink(ps, stack, resize)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a pass must never stop the loop; the event says what happened
            log.exception("autoscale of pool %s failed", name)
            self._failed(ps, resize, f"{type(e).__name__}: {e}")
        finally:
            ps.busy = None
            ps.last_end = self.clock.time()

    async def _grow(self, ps: PoolState, stack: StackLike, resize: Resize) -> None:
        name = ps.pool.name
        self.store.audit(ACTOR, "autoscale.up", name, {
            "reason": resize.reason, "from": resize.current, "to": resize.target, "jobs": list(resize.jobs)})
        outputs = await self._apply(ps, stack, resize)
        if outputs is None:
            return
        joining = [f"{name}-{i}" for i in range(resize.current, resize.target)]
        doc = [n for n in outputs.get("inventory") or [] if n.get("name") in joining]
        missing = sorted(set(joining) - {n["name"] for n in doc})
        if missing:
            self.store.audit(ACTOR, "autoscale.inventory", name, {
                "reason": f"pool {name}: the stack's inventory lacks {', '.join(missing)}"})
        booted = await asyncio.to_thread(self.bootstrap, doc) if doc else {}
        for node in doc:
            if not booted.get(node["name"]):
                self.store.audit(ACTOR, "autoscale.bootstrap_failed", node["name"], {
                    "reason": f"pool {name}: bootstrap of {node['name']} failed; "
                              f"run: trainyard bootstrap --limit {node['name']}"})
                continue
            try:
                await self.inventory.register(CALLER, NodeRequest(
                    name=node["name"], address=node["address"], port=int(node["ssh_port"]),
                    user=node["ssh_user"], gpus=int(node["gpu_count"]), gpu_model=node["gpu_model"],
                    pool=name, provider="aws", labels=dict(node["labels"]),
                    accept_new_host_key=self.infra.accept_new_host_keys))
                ps.joining.add(node["name"])
            except DomainError as e:
                self.store.audit(ACTOR, "autoscale.register_failed", node["name"], {"reason": str(e)})
        ps.failure, ps.failed_jobs = "", ()
        self.store.audit(ACTOR, "autoscale.done", name, {
            "reason": f"pool {name}: {resize.target} nodes; joining: {', '.join(sorted(ps.joining)) or 'none'}"})

    async def _shrink(self, ps: PoolState, stack: StackLike, resize: Resize) -> None:
        name = ps.pool.name
        idle_min = ps.settings.idle_minutes
        # no await between the check and the drains: the planner (same thread) cannot place a job
        with self.store.read() as s:
            for node_name in resize.leaving:
                node = s.get(Node, node_name)
                if node is None or node.state != m.UP or self.store.active.on(node_name):
                    self.store.audit(ACTOR, "autoscale.skip", name, {
                        "reason": f"pool {name}: {node_name} took work or left service; not scaling down"})
                    return
        self.store.audit(ACTOR, "autoscale.down", name, {
            "reason": resize.reason, "from": resize.current, "to": resize.target,
            "nodes": list(resize.leaving), "idle_minutes": idle_min})
        for node_name in resize.leaving:
            self.inventory.drain(CALLER, node_name, f"autoscale: idle {idle_min:g} min, leaving pool {name}")
        outputs = await self._apply(ps, stack, resize)
        for node_name in resize.leaving:
            self.idle_since.pop(node_name, None)
            if outputs is None:  # the nodes still exist: back into service
                await self.inventory.resume(CALLER, node_name, force=True)
            else:
                await self.inventory.remove(CALLER, node_name, force=False)
        if outputs is not None:
            self.store.audit(ACTOR, "autoscale.done", name, {
                "reason": f"pool {name}: {resize.target} nodes; removed {', '.join(resize.leaving)}"})

    async def _apply(self, ps: PoolState, stack: StackLike, resize: Resize) -> dict | None:
        """Set the count and update; on failure restore the count and record why (None)."""
        from infra.automation import InfraError  # noqa: PLC0415

        try:
            await asyncio.to_thread(stack.set_pool_count, ps.pool, resize.target)
            outputs = await asyncio.to_thread(stack.up)
        except InfraError as e:
            message = str(e).replace("\n", " ")
            try:
                await asyncio.to_thread(stack.set_pool_count, ps.pool, resize.current)
            except InfraError as again:
                message += f"; restoring the count to {resize.current} failed too: {again}"
            self._failed(ps, resize, message)
            return None
        config = await asyncio.to_thread(stack.config)
        ps.pool = config.pool(ps.pool.name)
        return outputs

    def _failed(self, ps: PoolState, resize: Resize, message: str) -> None:
        name = ps.pool.name
        ps.failure, ps.failed_jobs = message[:300], resize.jobs
        ps.last_end = self.clock.time()
        self.store.audit(ACTOR, "autoscale.failed", name, {
            "reason": f"{resize.reason} failed: {message}"[:1000], "count": resize.current,
            "retry_after_s": ps.cooldown_s})
        self._hold_reasons(ps)
