"""Prometheus metrics: the scheduler's own on `/metrics`, each node's GPUs on a path of its own.

Collectors read a `ClusterReadModel` at scrape time, so gauges never drift from the truth.
Names follow Prometheus's conventions: `_total` only on counters, a zero series for every job
state (per queue) and node state so `== 0` alerts can fire. Counters (jobs submitted, started,
finished) are incremented by the daemon through `job_submitted`/`on_job_state`; they start at
zero on each daemon start, which `rate()` and `increase()` handle as a counter reset.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from . import models as m
from .dcgm import NODE_METRICS_PREFIX, gpu_families, http_sd_targets, render

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
TEXT_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# Prometheus takes http_sd targets only from a reply of this type (else "unsupported content type")
SD_CONTENT_TYPE = "application/json"
# a run that ended: every final state, and PREEMPTED (the job is then requeued)
RUN_END_STATES = frozenset(m.FINAL_STATES) | {m.PREEMPTED}


@dataclass(frozen=True)
class NodeInfo:
    name: str
    state: str
    gpus_total: int
    hostname: str = ""        # what the node calls itself (the agent's hello); "" = the name
    driver_version: str = ""  # the NVIDIA driver, e.g. "550.54.15"; "" when unknown


class ClusterReadModel(Protocol):
    """What the metrics read from the control plane; every call is a cheap, consistent read."""

    def job_counts(self) -> Iterable[tuple[str, str, int]]:
        """(state, queue, number of jobs), for the states and queues that have jobs."""

    def queues(self) -> Iterable[str]:
        """Every queue (partition), with or without jobs."""

    def nodes(self) -> Iterable[NodeInfo]:
        """Every registered node."""

    def node(self, name: str) -> NodeInfo | None:
        """One registered node; None when there is no such node. A scrape of one node's GPUs
        reads this, never every node: Prometheus scrapes every node's target each interval."""

    def gpu_usage(self) -> Mapping[str, int]:
        """Node -> GPUs allocated to configuring or running jobs."""

    def telemetry(self) -> Mapping[str, dict]:
        """Node -> its latest sample `{"time", "gpus": [...], "source"}` (docs/gpu.md)."""

    def gpu_jobs(self) -> Mapping[tuple[str, int], object]:
        """(node, GPU index) -> the id of the active job allocated that GPU."""

    def gpu_jobs_on(self, name: str) -> Mapping[int, object]:
        """GPU index -> the id of the active job allocated that GPU, on one node: what that
        node's jobs hold, not a read of every active job."""

    def team_gpu_seconds(self) -> Mapping[str, float]:
        """Team (account) -> GPU-seconds allocated to its jobs so far, running jobs up to now."""


class _ClusterCollector:
    """Gauges of jobs, nodes and GPUs, and the per-team usage counter, read at scrape time."""

    def __init__(self, cluster: ClusterReadModel):
        self.cluster = cluster

    def collect(self):
        c = self.cluster
        jobs = GaugeMetricFamily("trainyard_jobs", "Jobs by state and queue", labels=["state", "queue"])
        counts = {(state, queue): n for state, queue, n in c.job_counts()}
        queues = sorted(set(c.queues()) | {q for _, q in counts})
        states = list(m.JOB_STATES) + sorted({s for s, _ in counts} - set(m.JOB_STATES))
        for queue in queues:
            for state in states:
                jobs.add_metric([state, queue], counts.get((state, queue), 0))
        nodes = list(c.nodes())
        by_state = dict.fromkeys(m.NODE_STATES, 0)
        for n in nodes:
            by_state[n.state] = by_state.get(n.state, 0) + 1
        node_states = GaugeMetricFamily("trainyard_nodes", "Nodes by state", labels=["state"])
        for state, n in by_state.items():
            node_states.add_metric([state], n)
        used = c.gpu_usage()
        gpus = GaugeMetricFamily("trainyard_gpus", "GPUs on registered nodes")
        gpus.add_metric([], sum(n.gpus_total for n in nodes))
        alloc = GaugeMetricFamily("trainyard_gpus_allocated",
                                  "GPUs allocated to configuring or running jobs")
        alloc.add_metric([], sum(used.values()))
        node_gpus = GaugeMetricFamily("trainyard_node_gpus", "GPUs per node", labels=["node"])
        node_alloc = GaugeMetricFamily("trainyard_node_gpus_allocated", "GPUs allocated per node",
                                       labels=["node"])
        for n in sorted(nodes, key=lambda n: n.name):
            node_gpus.add_metric([n.name], n.gpus_total)
            node_alloc.add_metric([n.name], used.get(n.name, 0))
        team = CounterMetricFamily("trainyard_team_gpu_seconds",
                                   "GPU-seconds allocated to each team's jobs", labels=["team"])
        for name, seconds in sorted(c.team_gpu_seconds().items()):
            team.add_metric([name], seconds)
        yield from (jobs, node_states, gpus, alloc, node_gpus, node_alloc, team)

    def describe(self):
        return []


class Metrics:
    """The daemon's metrics: `/metrics` (render), `/metrics/nodes/<node>` (render_node) and the
    Prometheus HTTP service discovery list (http_sd)."""

    def __init__(self, cluster: ClusterReadModel):
        self.cluster = cluster
        self.registry = CollectorRegistry()
        self.registry.register(_ClusterCollector(cluster))
        self.submitted = Counter("trainyard_jobs_submitted", "Jobs submitted", ["queue"],
                                 registry=self.registry)
        self.started = Counter("trainyard_jobs_started",
                               "Job runs started (RUNNING, or ended before their start was reported)", ["queue"],
                               registry=self.registry)
        self.finished = Counter("trainyard_jobs_finished", "Job runs ended, by end state",
                                ["state", "queue"], registry=self.registry)
        self.reads_throttled = Counter(
            "trainyard_api_reads_throttled", "Reads refused (429) to a user past their share of the read threads",
            ["user"], registry=self.registry)
        self.schedule_cycle = Histogram(
            "trainyard_schedule_cycle_seconds", "Time of one scheduling cycle (snapshot, plan, commit)",
            buckets=LATENCY_BUCKETS, registry=self.registry)
        self.dispatch_latency = Histogram(
            "trainyard_dispatch_latency_seconds", "From the allocation's commit to the agent's started report",
            buckets=LATENCY_BUCKETS, registry=self.registry)
        self.submit_to_running = Histogram(
            "trainyard_submit_to_running_seconds", "From submission to RUNNING",
            buckets=LATENCY_BUCKETS, registry=self.registry)
        self.loop_lag = Histogram(
            "trainyard_event_loop_lag_seconds",
            "How late the daemon's event loop ran a timer due now, sampled ten times a second: every "
            "request, agent report and scheduling cycle waits at least this long",
            buckets=LATENCY_BUCKETS, registry=self.registry)
        self.gc_pause = Histogram(
            "trainyard_gc_pause_seconds",
            "Pauses of the daemon's garbage collector, by generation (the event loop waits for each)",
            ["generation"], buckets=LATENCY_BUCKETS, registry=self.registry)

    # --- counter hooks the daemon calls
    def job_submitted(self, queue: str, n: int = 1) -> None:
        self.submitted.labels(queue).inc(n)

    def job_started(self, queue: str) -> None:
        self.started.labels(queue).inc()

    def job_finished(self, state: str, queue: str) -> None:
        self.finished.labels(state, queue).inc()

    def read_throttled(self, user: str) -> None:
        self.reads_throttled.labels(user).inc()

    def on_job_state(self, job, old: str | None) -> None:
        """A job-state hook (after commit): counts runs that started and runs that ended."""
        new = job.state
        if new == old:
            return
        if new == m.RUNNING:
            self.job_started(job.queue)
        elif new in RUN_END_STATES:
            # a run that ended before its start was reported (a job of a few milliseconds: the
            # agent's started and exited reports in one commit) ran all the same: it has an exit
            # code, which a launch that failed or a cancel before the start does not
            if old == m.CONFIGURING and getattr(job, "exit_code", None) is not None:
                self.job_started(job.queue)
            self.job_finished(new, job.queue)

    # --- what the routes serve
    def _zero_counters(self) -> None:
        """A zero series for every queue (and end state) before the first job, so `rate()`
        and `== 0` alerts see them from the start."""
        for queue in self.cluster.queues():
            self.submitted.labels(queue)
            self.started.labels(queue)
            for state in sorted(RUN_END_STATES):
                self.finished.labels(state, queue)

    def render(self) -> bytes:
        self._zero_counters()
        return generate_latest(self.registry)

    def render_node(self, name: str) -> bytes | None:
        """One node's GPUs in dcgm-exporter's exposition; None when no such node is registered."""
        node = self.cluster.node(name)
        if node is None:
            return None
        gpus = (self.cluster.telemetry().get(name) or {}).get("gpus") or []
        # which job holds each GPU labels its samples: none to label, none to look up (a standby,
        # which has no telemetry since the agents report to the leader, would read every active job)
        jobs = dict(self.cluster.gpu_jobs_on(name)) if gpus else {}
        return render(gpu_families(node.hostname or node.name, node.driver_version, gpus, jobs))

    def http_sd(self, address: str, scheme: str = "http") -> bytes:
        """The http_sd_configs reply: one target per node at /metrics/nodes/<node>."""
        names = sorted(n.name for n in self.cluster.nodes())
        return json.dumps(http_sd_targets(names, address, scheme, NODE_METRICS_PREFIX)).encode()
