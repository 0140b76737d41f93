"""GET /v1/nodes on the leader re-renders only the nodes whose inputs changed: after any mix of
telemetry samples, drains, label changes, jobs taking and releasing GPUs, links going up and down
and GPUs excluded for health, the listing is exactly a full render of every node, at once."""

from __future__ import annotations

import random

import orjson
import pytest

from scheduler import models as m
from scheduler.config import DaemonConfig
from scheduler.daemon import Daemon, ManualClock
from scheduler.daemon.caller import Caller
from scheduler.daemon.jobs import JobRequest
from scheduler.models import Node

ADMIN = Caller("root", "admin")
NODES = 6


@pytest.fixture
def daemon(tmp_path):
    d = Daemon(DaemonConfig(), tmp_path / "home", clock=ManualClock())
    d.prepare()
    d.leadership.role = "leader"
    up: set[str] = set()
    d.links.connected = lambda name: name in up  # nodes without agents: links are set by the test
    with d.store.tx() as s:
        for i in range(NODES):
            s.add(Node(name=f"n{i}", address="127.0.0.1", state=m.UP, gpus_total=4,
                       gpu_indices=[0, 1, 2, 3], cpus=32, mem_mb=64000))
    yield d, up
    d.engine.dispose()


def full_render(d: Daemon) -> list:
    return orjson.loads(orjson.dumps(d.node_views(), option=orjson.OPT_NON_STR_KEYS))


def sample(rng: random.Random) -> dict:
    return {"time": rng.random(), "source": "nvml",
            "gpus": [{"index": g, "util_gpu": rng.randint(0, 100), "temp_c": rng.randint(30, 90)}
                     for g in range(4)]}


def test_listing_equals_a_full_render_after_every_change(daemon):
    d, up = daemon
    rng = random.Random(7)
    names = [f"n{i}" for i in range(NODES)]
    assert [n["name"] for n in orjson.loads(d.nodes_listing())] == names
    for step in range(300):
        name = rng.choice(names)
        what = rng.randrange(7)
        if what == 0:
            d.on_agent_message(name, {"ev": "telemetry", **sample(rng)})
        elif what == 1:
            (up.add if name not in up else up.discard)(name)
            d.links.errors[name] = "" if name in up else f"connection refused ({step})"
        elif what == 2:
            with d.store.tx() as s:
                node = s.get(Node, name)
                node.state = m.DRAINED if node.state == m.UP else m.UP
                node.reason = f"drained at step {step}" if node.state == m.DRAINED else ""
        elif what == 3:
            with d.store.tx() as s:
                s.get(Node, name).labels = {"rack": str(rng.randrange(3))}
        elif what == 4:  # a job takes GPUs on a node (allocated: counted in gpus_used)
            up.add(name)
            with d.store.tx() as s:
                s.get(Node, name).state = m.UP
            d.jobs.submit(ADMIN, JobRequest(command=["true"], gpus=rng.randint(1, 2)))
            d.dispatcher.dispatch = lambda job: None
            d.schedule_once()
        elif what == 5:  # jobs end: their GPUs are free again
            for job in d.jobs.list(ADMIN, _active()):
                if rng.random() < 0.5:
                    d.jobs.act(ADMIN, job["id"], "cancel")
        else:
            d.health.excluded[name] = {rng.randrange(4): f"XID 79 at step {step}"} \
                if rng.random() < 0.5 else {}
        listed = orjson.loads(d.nodes_listing())
        assert listed == full_render(d), f"step {step}: change {what} on {name}"
    # the listing showed what users see: some GPUs in use, a drained node, telemetry
    assert any(n["gpus_used"] for n in listed) or any(n["telemetry"]["gpus"] for n in listed)


def test_a_drain_shows_on_the_very_next_listing(daemon):
    d, up = daemon
    up.update(f"n{i}" for i in range(NODES))
    before = {n["name"]: n for n in orjson.loads(d.nodes_listing())}
    assert before["n3"]["state"] == m.UP
    d.inventory.drain(ADMIN, "n3", "fan failure")
    after = {n["name"]: n for n in orjson.loads(d.nodes_listing())}
    assert (after["n3"]["state"], after["n3"]["reason"]) == (m.DRAINED, "fan failure")
    assert after["n0"] == before["n0"]


def _active():
    from scheduler.daemon.jobs import JobFilter
    return JobFilter(all=False, states=frozenset(), user=None, queue=None, limit=1000)


def test_a_gpu_reading_is_listed_as_the_agent_sent_it_and_kept_out_of_the_collector(daemon):
    """The daemon keeps each GPU's reading with tuples for its lists (so that the garbage
    collector need not walk it); what the listing, the health rules and the metrics read is the
    reading the agent sent."""
    import gc

    from scheduler.simgpu import SimulatedGpus

    d, up = daemon
    up.add("n0")
    gpus = SimulatedGpus(4).telemetry({1: 7}, {})
    gpus[1]["processes"] = [{"pid": 42, "used_mb": 100, "job_id": 7}]
    gpus[2]["xid_events"] = [79]  # fell off the bus (a fatal XID)
    line = orjson.dumps({"ev": "telemetry", "time": 5.0, "source": "simulated", "gpus": gpus})
    d.on_agent_message("n0", orjson.loads(line))
    listed = next(n for n in orjson.loads(d.nodes_listing()) if n["name"] == "n0")
    assert listed["telemetry"]["gpus"] == orjson.loads(orjson.dumps(gpus))
    assert [v.gpu for v in d.health.tracker.verdicts("n0") if "79" in v.reason] == [2]
    kept = d.links.telemetry["n0"]["gpus"]
    assert not gc.is_tracked(kept[0]) and not gc.is_tracked(kept[3])  # every value a number or ()
    assert kept[2]["xid_events"] == (79,)
