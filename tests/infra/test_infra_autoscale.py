"""Autoscaling end to end: the daemon grows an AWS pool through the stand-in pulumi for pending
jobs, simulated nodes answer at the addresses it exports, and idle nodes go back."""

from __future__ import annotations

import asyncio
import getpass
import json
import sys
from pathlib import Path

import pytest
from infra_helpers import aws_pool, onprem_pool, stack_config
from sqlmodel import col, select

from scheduler import models as m
from scheduler.daemon import Daemon, ManualClock
from scheduler.daemon.caller import Caller
from scheduler.daemon.jobs import JobRequest
from scheduler.daemon_config import DaemonConfig
from scheduler.models import Event, Job, Node
from scheduler.settings import Settings, SettingsError
from scheduler.simnode import start_sim_nodes, stop_sim_nodes

GPUS = 4  # g6.12xlarge: 4 NVIDIA L4 per node
ANN = Caller("ann", "user")


def autoscale_config(project: Path, **pool) -> DaemonConfig:
    doc = {"infra": {"project_dir": str(project), "stack": "dev", "autoscale_interval": 3600.0},
           "autoscale": {"gpu": {"min": 0, "max": 3, "idle_minutes": 10.0, "cooldown_minutes": 5.0, **pool}}}
    return DaemonConfig(telemetry_interval_s=0.3, schedule_interval_s=0.2, connect_timeout_s=5.0,
                        settings=Settings.from_toml(doc))


@pytest.fixture
def loopback_pulumi(fake_pulumi, tmp_path, monkeypatch):
    """The stand-in CLI, exporting the pool's nodes at loopback ports the test fills in."""
    shim = tmp_path / "bin" / "pulumi"
    wrapper = Path(__file__).with_name("fake_pulumi_loopback.py")
    shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{wrapper}" "$@"\n')
    addresses = tmp_path / "addresses.json"
    addresses.write_text("{}")
    monkeypatch.setenv("FAKE_PULUMI_ADDRESSES", str(addresses))
    fake_pulumi.init_stack("dev", stack_config(aws_pool("gpu", "g6.12xlarge", 0, sshUser=getpass.getuser()),
                                               onprem_pool("lab", 1)))
    fake_pulumi.addresses = addresses
    return fake_pulumi


class Bootstrap:
    """The Ansible step, stubbed at its boundary: records the inventory it was given."""

    def __init__(self):
        self.runs: list[list[str]] = []

    def __call__(self, doc):
        self.runs.append([n["name"] for n in doc])
        return {n["name"]: True for n in doc}


@pytest.fixture
async def cluster(loopback_pulumi, tmp_path):
    clock = ManualClock()
    d = Daemon(autoscale_config(loopback_pulumi.project_dir), tmp_path / "home", clock=clock)
    d.prepare()
    boot = Bootstrap()
    d.autoscaler.bootstrap = boot
    pub = (d.key_path.parent / "id_ed25519.pub").read_text()
    sims = await start_sim_nodes(tmp_path / "sims", 3, GPUS, pub)
    loopback_pulumi.addresses.write_text(json.dumps({f"gpu-{i}": s.port for i, s in enumerate(sims)}))
    await d.start()
    yield d, clock, loopback_pulumi, boot
    await d.stop()
    agents = [p for sim in sims for p in sim.processes]
    await stop_sim_nodes(sims)
    for p in agents:  # reaped inside the loop, before it closes
        await p.wait()


def submit(d: Daemon, gpus: int, nodes: int = 1) -> int:
    return d.jobs.submit(ANN, JobRequest(command=["sleep", "600"], gpus=gpus, nodes=nodes))["id"]


def jobs(d: Daemon) -> dict[int, Job]:
    with d.store.read() as s:
        return {j.id: j for j in s.exec(select(Job)).all()}


def events(d: Daemon, prefix: str = "autoscale.") -> list[tuple[str, str, str]]:
    with d.store.read() as s:
        rows = s.exec(select(Event).where(col(Event.action).startswith(prefix)).order_by(Event.id)).all()
        return [(e.action, e.target, e.detail.get("reason", "")) for e in rows]


def pool_count(fake) -> int:
    (pool,) = [p for p in fake.state()["stacks"]["dev"]["config"]["trainyard:pools"] if p["name"] == "gpu"]
    return pool["count"]


async def until(pred, what: str, timeout: float = 30.0):
    for _ in range(int(timeout / 0.05)):
        if result := pred():
            return result
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


async def pending_for_resources(d: Daemon, *ids: int) -> None:
    d.wake()
    await until(lambda: all(jobs(d)[i].reason == "Resources" for i in ids), "jobs pending for Resources")


async def test_a_gang_grows_the_pool_by_its_size_and_starts_on_the_new_nodes(cluster):
    d, clock, fake, boot = cluster
    gang = submit(d, GPUS, nodes=2)
    single = submit(d, 2)
    await pending_for_resources(d, gang, single)

    assert [r.reason for r in d.autoscaler.tick()] == [f"pool gpu: 0 -> 3 for jobs {gang}, {single}"]
    assert d.autoscaler.tick() == []  # one operation on a pool at a time
    await d.autoscaler.settle()

    assert pool_count(fake) == 3
    assert boot.runs == [["gpu-0", "gpu-1", "gpu-2"]]
    await until(lambda: all(j.state == m.RUNNING for j in jobs(d).values()), "the jobs to run", 40)
    assert {a["node"] for a in jobs(d)[gang].allocation} <= {"gpu-0", "gpu-1", "gpu-2"}
    with d.store.read() as s:
        nodes = {n.name: n for n in s.exec(select(Node)).all()}
    assert {n.provider for n in nodes.values()} == {"aws"}
    assert all(n.health_checks["status"] == "passed" for n in nodes.values())  # through the gate
    assert events(d)[0] == ("autoscale.up", "gpu", f"pool gpu: 0 -> 3 for jobs {gang}, {single}")


async def test_idle_nodes_go_back_after_idle_minutes_but_never_one_with_jobs(cluster):
    d, clock, fake, boot = cluster
    first, second = submit(d, GPUS), submit(d, GPUS)
    await pending_for_resources(d, first, second)
    d.autoscaler.tick()
    await d.autoscaler.settle()
    await until(lambda: all(j.state == m.RUNNING for j in jobs(d).values()), "the jobs to run", 40)
    on_top = next(j for j in jobs(d).values() if j.allocation[0]["node"] == "gpu-1")
    d.jobs.act(ANN, on_top.id, "cancel")
    await until(lambda: jobs(d)[on_top.id].state == m.CANCELLED and not d.store.active.on("gpu-1"), "cancel")

    d.autoscaler.tick()  # gpu-1 idle from now
    clock.advance(9 * 60)
    assert d.autoscaler.tick() == []
    clock.advance(61)
    (down,) = d.autoscaler.tick()
    await d.autoscaler.settle()

    assert down.reason == "pool gpu: 2 -> 1, idle: gpu-1"
    assert pool_count(fake) == 1
    with d.store.read() as s:
        assert [n.name for n in s.exec(select(Node)).all()] == ["gpu-0"]  # the busy node stays
    assert ("autoscale.down", "gpu", "pool gpu: 2 -> 1, idle: gpu-1") in events(d)
    clock.advance(3600)
    assert d.autoscaler.tick() == []  # gpu-0 runs a job


async def test_a_pulumi_failure_restores_the_count_and_the_jobs_say_why(cluster, monkeypatch):
    d, clock, fake, boot = cluster
    job = submit(d, GPUS)
    await pending_for_resources(d, job)
    monkeypatch.setenv("FAKE_PULUMI_FAIL", "up")
    d.autoscaler.tick()
    await d.autoscaler.settle()

    assert pool_count(fake) == 0 and boot.runs == []
    action, target, reason = events(d)[-1]
    assert (action, target) == ("autoscale.failed", "gpu")
    assert reason.startswith(f"pool gpu: 0 -> 1 for jobs {job} failed: pulumi failed:")
    assert "InsufficientInstanceCapacity" in reason or "update failed" in reason
    assert jobs(d)[job].state == m.PENDING
    assert jobs(d)[job].reason.startswith("Resources (scale-up of pool gpu failed: pulumi failed")

    monkeypatch.delenv("FAKE_PULUMI_FAIL")
    clock.advance(4 * 60)
    assert d.autoscaler.tick() == []  # cooldown
    clock.advance(61)
    assert [r.target for r in d.autoscaler.tick()] == [1]
    await d.autoscaler.settle()
    assert pool_count(fake) == 1


def test_an_autoscaled_pool_must_be_an_aws_pool_of_the_stack(loopback_pulumi, tmp_path):
    config = autoscale_config(loopback_pulumi.project_dir)
    config.settings = Settings.from_toml({
        "infra": {"project_dir": str(loopback_pulumi.project_dir), "stack": "dev"},
        "autoscale": {"lab": {"max": 2}, "p5": {"max": 2}}})
    with pytest.raises(SettingsError) as info:
        Daemon(config, tmp_path / "home")
    assert info.value.problems == [
        "autoscale.lab: pool lab is an on-prem pool; only AWS pools are scaled (remove [autoscale.lab])",
        "autoscale.p5: no pool named 'p5' in trainyard:pools (pools: gpu, lab); autoscale names AWS pools",
    ]
