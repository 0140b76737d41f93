"""GPU telemetry tests: the `gpu` marker (real NVML, `make test-gpu`) and a real agent process."""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

AGENT = Path(__file__).resolve().parents[2] / "scheduler" / "agent.py"


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "gpu: needs an NVIDIA GPU and driver (real NVML); `make test-gpu` runs these")


class AgentProcess:
    """scheduler/agent.py as the daemon runs it, speaking JSON lines on stdin/stdout."""

    def __init__(self, root: Path, sim_gpus: int | None = 4, declared: int = 0, telemetry_s: float = 0.1,
                 env: dict | None = None):
        env = {**{k: v for k, v in os.environ.items() if not k.startswith("TRAINYARD_SIM_")}, **(env or {})}
        if sim_gpus is not None:
            env["TRAINYARD_SIM_GPUS"] = str(sim_gpus)
        argv = [sys.executable, str(AGENT), "--root", str(root), "--telemetry", str(telemetry_s)]
        if declared:
            argv += ["--gpus", str(declared), "--gpu-model", "NVIDIA A100-SXM4-80GB"]
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()
        self.hello = self.wait_for("hello")

    def _pump(self):
        for line in self.proc.stdout:
            self.lines.put(json.loads(line))

    def send(self, **msg):
        self.proc.stdin.write(json.dumps(msg) + "\n")
        self.proc.stdin.flush()

    def wait_for(self, ev, pred=lambda m: True, timeout=15.0) -> dict:
        deadline = time.monotonic() + timeout
        passed = []  # what came instead (telemetry aside), to say why in the failure
        while time.monotonic() < deadline:
            try:
                msg = self.lines.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                break
            if msg.get("ev") == ev and pred(msg):
                return msg
            if msg.get("ev") not in ("telemetry", "output"):
                passed.append(msg)
        raise AssertionError(f"the agent sent no {ev} message that matched; it sent {passed[-5:]}")

    def request(self, timeout=15.0, **msg) -> dict:
        """Send a request with an id and return the agent's answer to it (any event)."""
        self.send(**msg)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                got = self.lines.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                break
            if got.get("id") == msg["id"] and got.get("ev") != "telemetry":
                return got
        raise AssertionError(f"no answer to {msg}")

    def gpu(self, index: int, pred=lambda g: True) -> dict:
        """The next telemetry for one GPU that matches pred."""
        msg = self.wait_for("telemetry", lambda m: pred(m["gpus"][index]))
        return msg["gpus"][index]

    def close(self):
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture
def sim_agent(tmp_path):
    a = AgentProcess(tmp_path / "agent")
    yield a
    a.close()
