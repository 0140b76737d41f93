"""A real Prometheus (Debian's `prometheus`) on a loopback port, and the metrics routes served."""

from __future__ import annotations

import shutil
import signal
import subprocess
import threading
from pathlib import Path

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import Response

from scheduler.metrics import SD_CONTENT_TYPE, TEXT_CONTENT_TYPE, Metrics
from tests.conftest import free_port, require_or_skip, wait_for

PROMETHEUS = shutil.which("prometheus")
SCRAPE_S = 1


class Prometheus:
    """`prometheus` with its own config and storage; `query` runs PromQL as a dashboard does."""

    def __init__(self, base: Path, scrape_configs: str):
        self.dir = base / "prometheus"
        self.dir.mkdir()
        self.port = free_port()
        self.log = self.dir / "prometheus.log"
        (self.dir / "prometheus.yml").write_text(
            f"global:\n  scrape_interval: {SCRAPE_S}s\n  evaluation_interval: {SCRAPE_S}s\n"
            f"scrape_configs:\n{scrape_configs}")
        self.proc = subprocess.Popen(
            [PROMETHEUS, f"--config.file={self.dir / 'prometheus.yml'}",
             f"--storage.tsdb.path={self.dir / 'data'}", f"--web.listen-address=127.0.0.1:{self.port}"],
            stdout=subprocess.DEVNULL, stderr=open(self.log, "wb"))
        self.url = f"http://127.0.0.1:{self.port}"

        def ready():
            if self.proc.poll() is not None:
                raise AssertionError(f"prometheus exited: {self.log.read_text()[-2000:]}")
            try:
                return httpx.get(f"{self.url}/-/ready", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(ready, 30, 0.1, "prometheus ready")

    def query(self, promql: str) -> list[dict]:
        r = httpx.get(f"{self.url}/api/v1/query", params={"query": promql}, timeout=5)
        r.raise_for_status()
        return r.json()["data"]["result"]

    def wait(self, promql: str, pred=bool, timeout: float = 30.0) -> list[dict]:
        """The query's result once pred(result) holds (scrapes and service discovery take seconds)."""
        return wait_for(lambda: (lambda res: res if pred(res) else None)(self.query(promql)),
                        timeout, 0.25, f"{promql} in prometheus")

    def targets(self) -> list[dict]:
        return httpx.get(f"{self.url}/api/v1/targets", timeout=5).json()["data"]["activeTargets"]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def gpu_scrape_configs(daemon_url: str) -> str:
    """trainyard's own metrics plus every node's GPUs found through http_sd (deploy/prometheus.yml)."""
    host = daemon_url.split("://", 1)[1]
    return (f"  - job_name: trainyard\n    static_configs:\n      - targets: ['{host}']\n"
            f"  - job_name: trainyard-gpus\n    http_sd_configs:\n"
            f"      - url: {daemon_url}/metrics/http_sd\n        refresh_interval: {SCRAPE_S}s\n")


@pytest.fixture
def prometheus_factory(tmp_path):
    require_or_skip(PROMETHEUS is not None, "prometheus is not installed (apt-get install prometheus)")
    started: list[Prometheus] = []

    def make(scrape_configs: str) -> Prometheus:
        p = Prometheus(tmp_path, scrape_configs)
        started.append(p)
        return p

    yield make
    for p in started:
        p.stop()


def metrics_app(metrics: Metrics) -> FastAPI:
    """The three metrics routes as the daemon's API serves them."""
    app = FastAPI()

    @app.get("/metrics")
    def cluster():
        return Response(metrics.render(), media_type=TEXT_CONTENT_TYPE)

    @app.get("/metrics/http_sd")
    def http_sd(request: Request):
        return Response(metrics.http_sd(request.headers["host"], request.url.scheme),
                        media_type=SD_CONTENT_TYPE)

    @app.get("/metrics/nodes/{name}")
    def node(name: str):
        body = metrics.render_node(name)
        if body is None:
            return Response(f'{{"detail": "node {name} does not exist"}}', status_code=404,
                            media_type="application/json")
        return Response(body, media_type=TEXT_CONTENT_TYPE)

    return app


@pytest.fixture
def serve_metrics():
    """Serve a Metrics' routes with uvicorn on a loopback port; yields a function -> its URL."""
    servers: list[tuple[uvicorn.Server, threading.Thread]] = []

    def start(metrics: Metrics) -> str:
        port = free_port()
        server = uvicorn.Server(uvicorn.Config(metrics_app(metrics), host="127.0.0.1", port=port,
                                               log_level="warning", lifespan="off"))
        t = threading.Thread(target=server.run, daemon=True)
        t.start()
        wait_for(lambda: server.started, 10, 0.02, "metrics server")
        servers.append((server, t))
        return f"http://127.0.0.1:{port}"

    yield start
    for server, t in servers:
        server.should_exit = True
        t.join(10)
