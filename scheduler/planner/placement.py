"""Gang placement: all-or-nothing, best fit, topology-aware, over free GPUs indexed by count."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from ..slurm.features import satisfies
from .types import JobView, NodeView

INF = math.inf


def eligibility(job: JobView, selector: Mapping[str, str]) -> tuple:
    """The key of the node set a job may use: its GPU type, label constraints (queue's too),
    feature expression, and the nodes it must or must not use."""
    labels = dict(selector)
    labels.update(job.constraint)
    return ((job.gpu_type or "").lower(), tuple(sorted(labels.items())), job.features,
            tuple(sorted(job.nodelist)), tuple(sorted(job.exclude)))


# the eligibility of a job with no GPU type, label, feature or node list in a queue without
# a node selector
PLAIN = ("", (), "", (), ())


def node_matches(node: NodeView, key: tuple) -> bool:
    gpu_type, labels, features, only, never = key
    if not node.schedulable:
        return False
    if gpu_type and gpu_type not in node.gpu_model.lower():
        return False
    if (only and node.name not in only) or node.name in never:
        return False
    if features and not satisfies(features, node.labels):
        return False
    return all(node.labels.get(k) == v for k, v in labels)


class Pool:
    """The nodes one kind of job may use, bucketed by their number of free GPUs (best fit)."""

    __slots__ = ("names", "buckets", "capacity")

    def __init__(self, names: list[str], free: Mapping[str, list[int]], totals: Mapping[str, int]):
        self.names = names
        top = max((totals[n] for n in names), default=0)
        self.buckets: list[dict[str, None]] = [{} for _ in range(top + 1)]
        for n in names:
            self.buckets[len(free[n])][n] = None
        # capacity[g]: how many of these nodes have at least g GPUs in total
        hist = [0] * (top + 2)
        for n in names:
            hist[totals[n]] += 1
        for g in range(top, -1, -1):
            hist[g] += hist[g + 1]
        self.capacity = hist[: top + 1]

    def count_at_least(self, g: int) -> int:
        b = self.buckets
        return sum(len(b[i]) for i in range(g, len(b))) if g < len(b) else 0

    def could_ever_fit(self, g: int, k: int) -> bool:
        return g < len(self.capacity) and self.capacity[g] >= k

    def move(self, name: str, old: int, new: int) -> None:
        del self.buckets[old][name]
        self.buckets[new][name] = None


class NodeTable:
    """The nodes of the last pass, by name: kept between passes by the caller (in
    `PendingOrder`), so a pass rebuilds only the entries of nodes whose view changed."""

    __slots__ = ("_views", "nodes", "totals", "free", "cpus", "mem")

    def __init__(self):
        self._views: tuple[NodeView, ...] | None = None
        self.nodes: dict[str, NodeView] = {}
        self.totals: dict[str, int] = {}
        self.free: dict[str, list[int]] = {}  # free GPUs, sorted; none on unschedulable nodes
        self.cpus: dict[str, int] = {}
        self.mem: dict[str, int] = {}

    def sync(self, nodes: Sequence[NodeView]) -> None:
        last = self._views
        if nodes is last:
            return
        views = tuple(nodes)
        if last is None or len(last) != len(views) or any(
                a is not b and a.name != b.name for a, b in zip(last, views, strict=True)):
            self.nodes = {n.name: n for n in views}
            self.totals = {n.name: n.gpus_total for n in views}
            self.free = {n.name: sorted(n.free_gpus) if n.schedulable else [] for n in views}
            self.cpus = {n.name: n.cpus_free for n in views}
            self.mem = {n.name: n.mem_free_mb for n in views}
        else:  # the same nodes in the same order: only changed views are read again
            for old, n in zip(last, views, strict=True):
                if old is not n:
                    name = n.name
                    self.nodes[name] = n
                    self.totals[name] = n.gpus_total
                    self.free[name] = sorted(n.free_gpus) if n.schedulable else []
                    self.cpus[name] = n.cpus_free
                    self.mem[name] = n.mem_free_mb
        self._views = views


class ClusterState:
    """What is free during one planner pass, updated as the pass hands out allocations.

    Also holds backfill reservations: on a reserved node, a job that would still run at the
    reservation's start may use only the GPUs the reservation leaves spare.
    """

    def __init__(self, nodes: Sequence[NodeView], running: Sequence[JobView],
                 table: NodeTable | None = None):
        table = table if table is not None else NodeTable()
        table.sync(nodes)
        # the table's dicts, read only here; what a pass changes is copied (values are
        # replaced, never changed in place)
        self.nodes = table.nodes
        self.totals = table.totals
        self.free: dict[str, list[int]] = dict(table.free)
        self.cpus: dict[str, int] = dict(table.cpus)
        self.mem: dict[str, int] = dict(table.mem)
        self._running = running
        self._occupied: set[str] | None = None  # built when an exclusive job first asks
        self._taken: set[str] = set()  # nodes given out in this pass
        self.hidden: dict[str, int] = {}  # free GPUs behind an exclusive job, back when it ends
        for j in running:
            if j.exclusive:
                for name, _ in j.allocation:
                    if name in self.free and name not in self.hidden:
                        self.hidden[name] = len(self.free[name])
                        self.free[name] = []
        self._pools: dict[tuple, Pool] = {}
        # node -> [[reservation start, spare GPUs, job id], ...]
        self.reserved: dict[str, list[list]] = {}
        self.reserved_need: dict[str, int] = {}
        self.reservation_times: list[float] = []
        self.version = 0  # bumps whenever an allocation or reservation changes what fits

    @property
    def occupied(self) -> set[str]:
        """Nodes where some job runs (or was started in this pass): no exclusive job there."""
        if self._occupied is None:
            self._occupied = {name for j in self._running for name, _ in j.allocation}
            self._occupied |= self._taken
        return self._occupied

    def pool(self, key: tuple) -> Pool:
        p = self._pools.get(key)
        if p is None:
            if key == PLAIN:  # no constraint at all: every schedulable node
                names = [n.name for n in self.nodes.values() if n.schedulable]
            else:
                names = [n.name for n in self.nodes.values() if node_matches(n, key)]
            p = Pool(names, self.free, self.totals)
            self._pools[key] = p
        return p

    def crossings(self, end: float) -> int:
        """How many reservations a job ending at `end` would still be running into."""
        times = self.reservation_times
        if not times:
            return 0
        if len(times) == 1:
            return 1 if end > times[0] else 0
        return sum(1 for t in times if end > t)

    def usable(self, name: str, end: float) -> int:
        """GPUs on `name` a job ending at `end` may take without delaying a reservation."""
        n = len(self.free[name])
        for t, spare, _ in self.reserved.get(name, ()):
            if end > t and spare < n:
                n = spare
        return n

    def _fits_node(self, name: str, job: JobView, end: float) -> bool:
        node = self.nodes[name]
        if job.exclusive:
            if name in self.occupied or len(self.free[name]) < node.gpus_total:
                return False
            if name in self.reserved and self.usable(name, end) < node.gpus_total:
                return False
            if any(end > t for t, _, _ in self.reserved.get(name, ())):
                return False
        elif self.usable(name, end) < job.gpus:
            return False
        if job.cpus and node.cpus_total and self.cpus[name] < job.cpus:
            return False
        return not (job.mem_mb and node.mem_total_mb and self.mem[name] < job.mem_mb)

    def candidates(self, job: JobView, pool: Pool, end: float, limit: int | None):
        """Nodes that can host one member of the gang now, fullest first (best fit)."""
        out: list[str] = []
        need = job.gpus
        for i in range(need, len(pool.buckets)):
            for name in pool.buckets[i]:
                if self._fits_node(name, job, end):
                    out.append(name)
                    if limit is not None and len(out) >= limit:
                        return out
        return out

    def place(self, job: JobView, pool: Pool, end: float, topology_keys: Sequence[str]):
        """An allocation ((node, (gpu, ...)), ...) for the whole gang, or None if it cannot start."""
        k = job.nodes
        if pool.count_at_least(job.gpus) < k:
            return None
        single = k == 1
        cands = self.candidates(job, pool, end, 1 if single else None)
        if len(cands) < k:
            return None
        chosen = cands if single else choose_gang(cands, k, self.nodes, topology_keys)
        return tuple((name, tuple(self.free[name][: job.gpus])) for name in chosen)

    def take(self, job: JobView, allocation, end: float) -> None:
        for name, gpus in allocation:
            old = len(self.free[name])
            if job.exclusive:
                self.hidden[name] = old - len(gpus)
                new_free: list[int] = []
            else:
                taken = set(gpus)
                new_free = [g for g in self.free[name] if g not in taken]
            self.free[name] = new_free
            self.cpus[name] -= job.cpus
            self.mem[name] -= job.mem_mb
            self._taken.add(name)
            if self._occupied is not None:
                self._occupied.add(name)
            for p in self._pools.values():  # those that hold the node have it under `old`
                if old < len(p.buckets) and name in p.buckets[old]:
                    p.move(name, old, len(new_free))
            for entry in self.reserved.get(name, ()):
                if end > entry[0]:
                    entry[1] -= old - len(new_free)
        self.version += 1

    def reserve(self, job_id: int, start: float, need: Mapping[str, int], spare: Mapping[str, int]):
        for name, n in need.items():
            self.reserved.setdefault(name, []).append([start, spare[name], job_id])
            self.reserved_need[name] = self.reserved_need.get(name, 0) + n
        self.reservation_times.append(start)
        self.version += 1


def choose_gang(cands: list[str], k: int, nodes: Mapping[str, NodeView],
                topology_keys: Sequence[str]) -> list[str]:
    """k nodes out of `cands` (best fit first), packed under one switch or rack when possible."""
    for key in topology_keys:
        groups: dict[str, list[str]] = {}
        for name in cands:
            value = nodes[name].labels.get(key)
            if value is not None:
                groups.setdefault(value, []).append(name)
        fitting = [(len(members), value) for value, members in groups.items() if len(members) >= k]
        if fitting:
            _, value = min(fitting)  # the tightest group that holds the whole gang
            return groups[value][:k]
    for key in topology_keys:  # no single group holds it: span as few groups as possible
        groups = {}
        for name in cands:
            groups.setdefault(nodes[name].labels.get(key, ""), []).append(name)
        if len(groups) > 1 or "" not in groups:
            out: list[str] = []
            for _, members in sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[0])):
                out.extend(members[: k - len(out)])
                if len(out) == k:
                    return out
    return cands[:k]
