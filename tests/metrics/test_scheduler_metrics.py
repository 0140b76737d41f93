"""Scheduler metrics by Prometheus's conventions, read from a ClusterReadModel at scrape time."""

from __future__ import annotations

import json
from types import SimpleNamespace

from scheduler import models as m
from scheduler.metrics import Metrics
from tests.metrics.cluster import InMemoryCluster, two_node_cluster
from tests.metrics.exposition import parse


def samples(fams, name) -> dict[tuple, float]:
    return {tuple(sorted(labels.items())): v for n, labels, v in fams[name]["samples"]
            if not n.endswith("_created")}


def test_every_job_state_has_a_series_in_every_queue_zero_included():
    fams = parse(Metrics(two_node_cluster()).render().decode())
    jobs = samples(fams, "trainyard_jobs")
    assert len(jobs) == len(m.JOB_STATES) * 2
    assert jobs[(("queue", "batch"), ("state", "PENDING"))] == 3
    assert jobs[(("queue", "default"), ("state", "RUNNING"))] == 1
    assert jobs[(("queue", "default"), ("state", "FAILED"))] == 0


def test_every_node_state_has_a_series():
    c = two_node_cluster()
    fams = parse(Metrics(c).render().decode())
    nodes = samples(fams, "trainyard_nodes")
    assert {k[0][1]: v for k, v in nodes.items()} == {**dict.fromkeys(m.NODE_STATES, 0), "UP": 2}


def test_gauges_have_no_total_suffix_and_counters_do():
    fams = parse(Metrics(two_node_cluster()).render().decode())
    for name, fam in fams.items():
        assert fam["type"] in ("gauge", "counter", "histogram"), name
        assert name.endswith("_total") == (fam["type"] == "counter"), name
    assert samples(fams, "trainyard_gpus") == {(): 8}
    assert samples(fams, "trainyard_gpus_allocated") == {(): 2}
    assert samples(fams, "trainyard_node_gpus_allocated") == {(("node", "node-1"),): 0,
                                                              (("node", "node-2"),): 2}


def test_job_counters_count_submissions_starts_and_ends_by_state():
    metrics = Metrics(two_node_cluster())
    before = parse(metrics.render().decode())
    assert samples(before, "trainyard_jobs_finished_total")[(("queue", "batch"), ("state", "TIMEOUT"))] == 0
    assert samples(before, "trainyard_jobs_submitted_total")[(("queue", "default"),)] == 0
    metrics.job_submitted("default", n=3)
    job = SimpleNamespace(queue="default", state=m.RUNNING)
    metrics.on_job_state(job, m.CONFIGURING)
    job.state = m.RUNNING
    metrics.on_job_state(job, m.RUNNING)  # no change: nothing counted
    job.state = m.FAILED
    metrics.on_job_state(job, m.RUNNING)
    job.state = m.PENDING
    metrics.on_job_state(job, m.FAILED)   # requeued after the failure: not a second end
    fams = parse(metrics.render().decode())
    assert samples(fams, "trainyard_jobs_submitted_total")[(("queue", "default"),)] == 3
    assert samples(fams, "trainyard_jobs_started_total")[(("queue", "default"),)] == 1
    finished = samples(fams, "trainyard_jobs_finished_total")
    assert finished[(("queue", "default"), ("state", "FAILED"))] == 1
    assert sum(finished.values()) == 1


def test_a_run_that_ended_before_its_start_was_reported_counts_as_started():
    """A job of a few milliseconds goes from CONFIGURING to its end in one commit (the agent's
    started and exited reports together): it ran, and has an exit code. A launch that failed or
    a cancel before the start has none, and did not run."""
    metrics = Metrics(two_node_cluster())
    for state, exit_code in ((m.COMPLETED, 0), (m.FAILED, 3), (m.FAILED, None), (m.CANCELLED, None)):
        metrics.on_job_state(SimpleNamespace(queue="batch", state=state, exit_code=exit_code), m.CONFIGURING)
    fams = parse(metrics.render().decode())
    assert samples(fams, "trainyard_jobs_started_total")[(("queue", "batch"),)] == 2
    finished = samples(fams, "trainyard_jobs_finished_total")
    assert (finished[(("queue", "batch"), ("state", "COMPLETED"))],
            finished[(("queue", "batch"), ("state", "FAILED"))],
            finished[(("queue", "batch"), ("state", "CANCELLED"))]) == (1, 2, 1)


def test_team_usage_is_a_counter_per_team():
    c = two_node_cluster()
    c.team_usage = {"vision": 7200.0, "nlp": 0.0}
    fams = parse(Metrics(c).render().decode())
    assert fams["trainyard_team_gpu_seconds_total"]["type"] == "counter"
    assert samples(fams, "trainyard_team_gpu_seconds_total") == {(("team", "nlp"),): 0,
                                                                 (("team", "vision"),): 7200}


def test_latency_histograms_stay():
    metrics = Metrics(InMemoryCluster())
    metrics.schedule_cycle.observe(0.003)
    fams = parse(metrics.render().decode())
    for name in ("trainyard_schedule_cycle_seconds", "trainyard_dispatch_latency_seconds",
                 "trainyard_submit_to_running_seconds"):
        assert fams[name]["type"] == "histogram"
    assert ("trainyard_schedule_cycle_seconds_count", {}, 1.0) in fams["trainyard_schedule_cycle_seconds"]["samples"]


def test_node_endpoint_serves_only_that_nodes_gpus_with_the_allocation_as_hpc_job():
    metrics = Metrics(two_node_cluster())
    fams = parse(metrics.render_node("node-2").decode())
    temps = fams["DCGM_FI_DEV_GPU_TEMP"]["samples"]
    assert [(s[1]["gpu"], s[1]["Hostname"], s[2]) for s in temps] == [
        ("0", "host-2", 60), ("1", "host-2", 61), ("2", "host-2", 62), ("3", "host-2", 63)]
    assert [s[1].get("hpc_job") for s in temps] == [None, "7", "7", None]
    assert metrics.render_node("node-9") is None


def test_http_sd_lists_every_registered_node():
    sd = json.loads(Metrics(two_node_cluster()).http_sd("127.0.0.1:9"))
    assert [(g["targets"], g["labels"]["instance"], g["labels"]["__metrics_path__"]) for g in sd] == [
        (["127.0.0.1:9"], "node-1", "/metrics/nodes/node-1"),
        (["127.0.0.1:9"], "node-2", "/metrics/nodes/node-2")]
