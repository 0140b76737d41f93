"""Prometheus metrics: jobs by state and queue, GPUs, scheduling and dispatch latency."""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

if TYPE_CHECKING:
    from .daemon import Daemon

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class _StateCollector:
    """Reads gauges from the database at scrape time, so they can never drift from the truth."""

    def __init__(self, daemon: Daemon):
        self.daemon = daemon

    def collect(self):
        from sqlmodel import Session, select

        from .models import Node

        d = self.daemon
        jobs = GaugeMetricFamily("trainyard_jobs", "Jobs by state and queue", labels=["state", "queue"])
        nodes = GaugeMetricFamily("trainyard_nodes", "Nodes by state", labels=["state"])
        total = GaugeMetricFamily("trainyard_gpus_total", "GPUs on registered nodes")
        alloc = GaugeMetricFamily("trainyard_gpus_allocated", "GPUs allocated to starting or running jobs")
        node_alloc = GaugeMetricFamily("trainyard_node_gpus_allocated", "GPUs allocated per node", labels=["node"])
        with Session(d.engine) as s:
            for state, queue, n in d.job_counts(s):
                jobs.add_metric([state, queue], n)
            by_state: dict[str, int] = {}
            gpus = 0
            used = d.gpu_usage(s)
            for node in s.exec(select(Node)).all():
                by_state[node.state] = by_state.get(node.state, 0) + 1
                gpus += node.gpus_total
                node_alloc.add_metric([node.name], used.get(node.name, 0))
        for state, n in by_state.items():
            nodes.add_metric([state], n)
        total.add_metric([], gpus)
        alloc.add_metric([], sum(used.values()))
        yield from (jobs, nodes, total, alloc, node_alloc)


class Metrics:
    def __init__(self, daemon: Daemon):
        self.registry = CollectorRegistry()
        self.registry.register(_StateCollector(daemon))
        from .dcgm import DcgmCollector

        self.registry.register(DcgmCollector(lambda: daemon.telemetry))
        self.schedule_cycle = Histogram(
            "trainyard_schedule_cycle_seconds", "Time of one scheduling cycle (snapshot, plan, commit)",
            buckets=LATENCY_BUCKETS, registry=self.registry)
        self.dispatch_latency = Histogram(
            "trainyard_dispatch_latency_seconds", "From the STARTING commit to the agent's started report",
            buckets=LATENCY_BUCKETS, registry=self.registry)
        self.submit_to_running = Histogram(
            "trainyard_submit_to_running_seconds", "From submission to RUNNING",
            buckets=LATENCY_BUCKETS, registry=self.registry)

    def render(self) -> bytes:
        return generate_latest(self.registry)
