"""What the TUI last heard from the daemon, per source, with when; and per-GPU history."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

HISTORY = 60  # samples kept per GPU for the sparklines (2 minutes at the default 2 s refresh)
EVENTS_KEPT = 1000


@dataclass
class GpuHistory:
    """Bounded utilisation and memory history per node, one sample per new telemetry time.

    A sample is two tuples (utilisation %, memory %) indexed by GPU position: 2 tuples a node per
    tick instead of 2 deque appends a GPU, which matters at 1,000 nodes × 8 GPUs."""

    size: int = HISTORY
    samples: dict[str, deque] = field(default_factory=dict)
    seen: dict[str, float] = field(default_factory=dict)

    def record(self, nodes: list[dict]) -> None:
        seen = self.seen
        for node in nodes:
            telemetry = node.get("telemetry")
            if not telemetry:
                continue
            stamp = telemetry.get("time")
            name = node.get("name")
            if stamp is None or seen.get(name) == stamp:
                continue  # the same sample again: no new point
            seen[name] = stamp
            gpus = telemetry.get("gpus") or ()
            index = tuple(g.get("index") for g in gpus)
            util = tuple(g.get("util_gpu") for g in gpus)
            mem = tuple(_mem_pct(g) for g in gpus)
            history = self.samples.get(name)
            if history is None:
                history = self.samples[name] = deque(maxlen=self.size)
            history.append((index, util, mem))

    def series(self, name: str, gpu_index: int) -> tuple[list, list]:
        """(utilisation %, memory %) over time for one GPU; None where it was not reported."""
        util, mem = [], []
        for index, u, m in self.samples.get(name, ()):
            try:
                i = index.index(gpu_index)
            except ValueError:
                util.append(None)
                mem.append(None)
                continue
            util.append(u[i])
            mem.append(m[i])
        return util, mem

    def forget(self, names: set[str]) -> None:
        """Drop history of nodes that left the cluster."""
        for name in [n for n in self.seen if n not in names]:
            del self.seen[name]
            self.samples.pop(name, None)


def _mem_pct(gpu: dict) -> float | None:
    total, used = gpu.get("mem_total_mb"), gpu.get("mem_used_mb")
    return 100 * used / total if total and used is not None else None


@dataclass
class ClusterState:
    """The last answer of every source, when it came, and the errors since."""

    me: dict = field(default_factory=dict)
    cluster: dict = field(default_factory=dict)
    nodes: list[dict] = field(default_factory=list)
    jobs: list[dict] = field(default_factory=list)
    queues: list[dict] = field(default_factory=list)
    # From /v1/teams, fetched with the queues; None while unknown or when the daemon has no such
    # endpoint (the queues view then falls back to per-user counts from the job list).
    teams: list[dict] | None = None
    events: deque = field(default_factory=lambda: deque(maxlen=EVENTS_KEPT))
    fetched_at: dict[str, float] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    history: GpuHistory = field(default_factory=GpuHistory)
    # How this session talks to the daemon (every screen's header shows it).
    readonly: bool = False
    streaming: bool = False
    refresh_interval: float = 2.0

    @property
    def stale_after(self) -> float:
        """Data older than this is shown as stale: three missed refreshes, at least 5 s."""
        return max(3 * self.refresh_interval, 5.0)

    @property
    def last_event_id(self) -> int:
        return self.events[-1].get("id", 0) if self.events else 0

    def apply(self, source: str, data: Any, at: float) -> None:
        self.fetched_at[source] = at
        self.errors.pop(source, None)
        if source == "nodes":
            self.nodes = data
            self.history.record(data)
            if len(self.history.seen) > len(data):
                self.history.forget({n.get("name") for n in data})
        elif source == "events":
            self.add_events(data)
        elif source == "queues" and isinstance(data, dict):
            self.queues = data.get("queues") or []
            self.teams = data.get("teams")
        else:
            setattr(self, source, data)

    def add_events(self, events: list[dict]) -> list[dict]:
        """Append events not seen before (by id); returns the new ones."""
        last = self.last_event_id
        fresh = [e for e in sorted(events, key=lambda e: e.get("id", 0)) if e.get("id", 0) > last]
        self.events.extend(fresh)
        return fresh

    def user_teams(self) -> dict[str, str]:
        """user -> team, from the teams' member lists (a user in none is in "default")."""
        return {u: t["name"] for t in self.teams or () for u in t.get("users") or () if t.get("name")}

    def node(self, name: str) -> dict | None:
        return next((n for n in self.nodes if n.get("name") == name), None)
