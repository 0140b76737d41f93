"""A real Prometheus finds every node through http_sd and NVIDIA's DCGM dashboard reads it unchanged."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from scheduler.metrics import Metrics
from tests.conftest import DemoProc, wait_for
from tests.metrics.cluster import two_node_cluster
from tests.metrics.conftest import gpu_scrape_configs

# The queries of NVIDIA's dashboard (Grafana id 12239, dcgm-exporter's
# grafana/dcgm-exporter-dashboard.json), panel by panel, with its two variables.
PER_GPU_PANELS = {
    "GPU Temperature": 'DCGM_FI_DEV_GPU_TEMP{instance=~"$instance", gpu=~"$gpu"}',
    "GPU Power Usage": 'DCGM_FI_DEV_POWER_USAGE{instance=~"$instance", gpu=~"$gpu"}',
    "GPU SM Clocks": 'DCGM_FI_DEV_SM_CLOCK{instance=~"$instance", gpu=~"$gpu"} * 1000000',
    "GPU Utilization": 'DCGM_FI_DEV_GPU_UTIL{instance=~"$instance", gpu=~"$gpu"}',
    "GPU Framebuffer Mem Used": 'DCGM_FI_DEV_FB_USED{instance=~"$instance", gpu=~"$gpu"}',
    "Tensor Core Utilization": 'DCGM_FI_PROF_PIPE_TENSOR_ACTIVE{instance=~"$instance", gpu=~"$gpu"}',
}
AGGREGATE_PANELS = {
    "GPU Avg. Temp": 'avg(DCGM_FI_DEV_GPU_TEMP{instance=~"$instance", gpu=~"$gpu"})',
    "GPU Power Total": 'sum(DCGM_FI_DEV_POWER_USAGE{instance=~"$instance", gpu=~"$gpu"})',
}
INSTANCE_VARIABLE = "DCGM_FI_DEV_GPU_TEMP"  # label_values(DCGM_FI_DEV_GPU_TEMP, instance)


def panel(expr: str, instance: str = ".+", gpu: str = ".+") -> str:
    """The query as Grafana sends it with the variables set (All: a regex matching every value)."""
    return expr.replace("$instance", instance).replace("$gpu", gpu)


def by_node_gpu(result: list[dict]) -> dict[tuple[str, str], float]:
    out = {}
    for r in result:
        key = (r["metric"]["instance"], r["metric"]["gpu"])
        assert key not in out, f"two series for node {key[0]} GPU {key[1]}: {result}"
        out[key] = float(r["value"][1])
    return out


def test_the_dcgm_dashboard_reads_every_node_and_gpu(prometheus_factory, serve_metrics):
    cluster = two_node_cluster(gpus=4)
    url = serve_metrics(Metrics(cluster))
    prom = prometheus_factory(gpu_scrape_configs(url))
    want = {(f"node-{k}", str(i)): 10 * k + i for k in (1, 2) for i in range(4)}  # see cluster.gpu()
    expected = {"GPU Temperature": lambda b: 40 + b, "GPU Power Usage": lambda b: 100.5 + b,
                "GPU SM Clocks": lambda b: (1000 + b) * 1e6, "GPU Utilization": lambda b: b,
                "GPU Framebuffer Mem Used": lambda b: 1000 + b,
                "Tensor Core Utilization": lambda b: b / 200}
    for title, expr in PER_GPU_PANELS.items():
        got = by_node_gpu(prom.wait(panel(expr), lambda r: len(r) == len(want)))
        assert got == pytest.approx({key: expected[title](b) for key, b in want.items()}), title
    instances = prom.query(f"count by (instance) ({INSTANCE_VARIABLE})")
    assert sorted(r["metric"]["instance"] for r in instances) == ["node-1", "node-2"]
    # one host selected, as the dashboard's gauges are used: that node's GPUs only
    avg = prom.query(panel(AGGREGATE_PANELS["GPU Avg. Temp"], instance="node-2"))
    assert float(avg[0]["value"][1]) == pytest.approx(40 + 21.5)
    total = prom.query(panel(AGGREGATE_PANELS["GPU Power Total"], instance="node-1"))
    assert float(total[0]["value"][1]) == pytest.approx(4 * 100.5 + 40 + 6)


def test_hpc_job_finds_the_gpus_of_a_job_and_zero_series_let_alerts_fire(prometheus_factory,
                                                                          serve_metrics):
    url = serve_metrics(Metrics(two_node_cluster()))
    prom = prometheus_factory(gpu_scrape_configs(url))
    job_gpus = prom.wait('DCGM_FI_DEV_GPU_UTIL{hpc_job="7"}', lambda r: len(r) == 2)
    assert sorted((r["metric"]["instance"], r["metric"]["gpu"]) for r in job_gpus) == [
        ("node-2", "1"), ("node-2", "2")]
    assert all("exported_job" not in r["metric"] for r in job_gpus)
    xid = prom.wait('DCGM_FI_DEV_XID_ERRORS == 0', lambda r: len(r) == 8)
    assert {r["metric"]["err_msg"] for r in xid} == {"No Error"}
    # `== 0` alerts need the zero series: no failed jobs, no DOWN nodes
    assert prom.wait('trainyard_jobs{state="FAILED", queue="default"} == 0')
    assert prom.wait('trainyard_nodes{state="DOWN"} == 0')
    assert prom.wait('trainyard_jobs_finished_total{state="TIMEOUT", queue="batch"} == 0')
    health = {t["labels"]["instance"]: t["health"] for t in prom.targets()
              if t["labels"]["job"] == "trainyard-gpus"}
    assert health == {"node-1": "up", "node-2": "up"}


def test_prometheus_scrapes_the_demo_through_http_sd(prometheus_factory, tmp_path):
    demo = DemoProc(tmp_path / "demo", nodes=2, gpus=4)
    try:
        client = demo.client()
        wait_for(lambda: all(n["state"] == "UP" and n["telemetry"]["gpus"] for n in client.nodes()),
                 30, what="demo nodes UP with telemetry")
        job = client.submit({"command": ["sleep", "300"], "gpus": 2})
        job = wait_for(lambda: (j := client.job(job["id"]))["state"] == "RUNNING" and j, 30,
                       what="job RUNNING")
        prom = prometheus_factory(gpu_scrape_configs(demo.url))
        every_gpu = {(f"node-{k}", str(i)) for k in (1, 2) for i in range(4)}
        for title, expr in PER_GPU_PANELS.items():
            got = by_node_gpu(prom.wait(panel(expr), lambda r: len(r) == len(every_gpu)))
            assert set(got) == every_gpu, title
        held = {(a["node"], str(g)) for a in job["allocation"] for g in a["gpus"]}
        util = prom.wait(f'DCGM_FI_DEV_GPU_UTIL{{hpc_job="{job["id"]}"}}', lambda r: len(r) == 2)
        assert set(by_node_gpu(util)) == held
        busy = by_node_gpu(prom.query(panel(PER_GPU_PANELS["GPU Utilization"])))
        # the demo's GPUs are busy while a job runs (each job its own load, 41-100 %), idle otherwise
        assert all(busy[key] >= 41 for key in held)
        assert all(busy[key] <= 3 for key in every_gpu - held)
        assert all(busy[key] <= 3 for key in every_gpu - held)
        assert prom.wait('trainyard_jobs_started_total{queue="default"} >= 1')
    finally:
        demo.stop()


def test_trainyards_own_dashboard_queries_run_and_find_data(prometheus_factory, serve_metrics):
    dashboard = json.loads((Path(__file__).parents[2] / "deploy" / "grafana" / "trainyard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    assert len(exprs) >= 20
    c = two_node_cluster()
    c.team_usage = {"vision": 3600.0}
    metrics = Metrics(c)
    metrics.job_submitted("default")
    metrics.schedule_cycle.observe(0.01)
    prom = prometheus_factory(gpu_scrape_configs(serve_metrics(metrics)))
    prom.wait('DCGM_FI_DEV_GPU_UTIL{hpc_job="7"}', lambda r: len(r) == 2)
    prom.wait("trainyard_gpus")
    for expr in exprs:
        q = expr.replace("$queue", ".*").replace("$job", ".+").replace("$__range", "1h")
        prom.query(q)  # a PromQL error would raise here (HTTP 400)
    for expr in ("trainyard_gpus_allocated / clamp_min(trainyard_gpus, 1)",
                 'avg by (hpc_job) (DCGM_FI_DEV_GPU_UTIL{hpc_job=~".+"})',
                 'sum by (state) (trainyard_jobs{queue=~".*"})'):
        assert prom.query(expr), expr
