"""Fixtures for the TUI tests."""

from __future__ import annotations

import pytest
from fake_backend import FakeBackend


@pytest.fixture
def backend() -> FakeBackend:
    return FakeBackend()


@pytest.fixture(scope="module")
def demo_cluster(tmp_path_factory):
    """A real daemon on 2 simulated nodes × 4 GPUs (`trainyard demo --no-tui`); yields (url, token)."""
    import os
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    base = tmp_path_factory.mktemp("demo")
    trainyard = Path(sys.executable).with_name("trainyard")
    env = {**os.environ, "HOME": str(base), "TRAINYARD_HOME": str(base / "home")}
    env.pop("TRAINYARD_URL", None)
    env.pop("TRAINYARD_TOKEN", None)
    proc = subprocess.Popen(
        [str(trainyard), "demo", "--no-tui", "--idle", "--nodes", "2", "--gpus-per-node", "4",
         "--dir", str(base / "demo")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    settings: dict[str, str] = {}
    deadline = time.monotonic() + 60
    while len(settings) < 2 and time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        key, sep, value = line.strip().partition("=")
        if sep and key in ("TRAINYARD_URL", "TRAINYARD_TOKEN"):
            settings[key] = value
    if len(settings) < 2:
        proc.kill()
        pytest.fail(f"trainyard demo did not print its settings: {proc.stdout.read()[-2000:]}")
    try:
        yield settings["TRAINYARD_URL"], settings["TRAINYARD_TOKEN"]
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
