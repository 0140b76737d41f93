"""Fixtures of the infra tests (helpers live in infra_helpers.py, a name no other test directory uses)."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest
from infra_helpers import FAKE_PULUMI, FakePulumi, aws_pool, onprem_pool, stack_config


@pytest.fixture
def hybrid_config() -> dict:
    return stack_config(
        aws_pool("h100", "p5.48xlarge", 2, availabilityZone="us-east-1b"),
        aws_pool("l4", "g6.xlarge", 3, spot=True, maxPrice=0.5),
        onprem_pool("lab", 2),
    )


@pytest.fixture
def fake_pulumi(tmp_path, monkeypatch) -> FakePulumi:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    shim = bin_dir / "pulumi"
    shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{FAKE_PULUMI}" "$@"\n')
    shim.chmod(0o755)
    project = tmp_path / "project"
    project.mkdir()
    shutil.copy(Path(__file__).resolve().parents[2] / "Pulumi.yaml", project / "Pulumi.yaml")
    fake = FakePulumi(tmp_path / "pulumi-state.json", tmp_path / "pulumi-calls.jsonl", project)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")
    monkeypatch.setenv("FAKE_PULUMI_STATE", str(fake.state_path))
    monkeypatch.setenv("FAKE_PULUMI_LOG", str(fake.log_path))
    monkeypatch.delenv("FAKE_PULUMI_FAIL", raising=False)
    monkeypatch.delenv("FAKE_PULUMI_VERSION", raising=False)
    monkeypatch.delenv("TRAINYARD_STACK", raising=False)
    return fake


@pytest.fixture(autouse=True)
def _an_event_loop_for_pulumi():
    """Pulumi's mocks ask for the main thread's current event loop; a test that ran
    `asyncio.run()` before (the autoscaler's) leaves none set."""
    import asyncio

    try:
        asyncio.get_event_loop_policy().get_event_loop()
    except RuntimeError:
        asyncio.set_event_loop(asyncio.new_event_loop())
    yield
