"""GET /v1/nodes on the leader re-renders only the nodes whose inputs changed: after any mix of
telemetry samples, drains, label changes, jobs taking and releasing GPUs, links going up and down
and GPUs excluded for health, the listing is exactly a full render of every node, at once. The
gzip-compressed listing (put together from each node's compressed part) is the same JSON, as
one valid gzip member, and what a client that asks for gzip gets from a real daemon."""

from __future__ import annotations

import gzip
import json
import random
import zlib

import httpx
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
        plain = d.nodes_listing()
        listed = orjson.loads(plain)
        assert listed == full_render(d), f"step {step}: change {what} on {name}"
        if step % 3 == 0:  # some parts compressed, others kept compressed from earlier steps
            assert one_gzip_member(d.nodes_listing(compressed=True)) == plain, f"step {step}"
    # the listing showed what users see: some GPUs in use, a drained node, telemetry
    assert any(n["gpus_used"] for n in listed) or any(n["telemetry"]["gpus"] for n in listed)


def one_gzip_member(data: bytes) -> bytes:
    """The content of `data`, which must be exactly one gzip member (its CRC and length checked)."""
    z = zlib.decompressobj(16 + zlib.MAX_WBITS)
    out = z.decompress(data) + z.flush()
    assert z.eof and z.unused_data == b"", "not one complete gzip member"
    assert gzip.decompress(data) == out
    return out


def test_the_compressed_listing_on_a_leader_a_standby_and_an_empty_cluster(daemon, tmp_path):
    d, up = daemon
    up.add("n2")
    rng = random.Random(3)
    for name in ("n0", "n2", "n5"):
        d.on_agent_message(name, {"ev": "telemetry", **sample(rng)})
    plain = d.nodes_listing()
    first = d.nodes_listing(compressed=True)
    assert one_gzip_member(first) == plain
    assert len(first) < len(plain)
    assert d.nodes_listing(compressed=True) == first  # nothing changed: the same bytes
    d.on_agent_message("n5", {"ev": "telemetry", **sample(rng)})  # the last node changed
    assert one_gzip_member(d.nodes_listing(compressed=True)) == d.nodes_listing()
    d.inventory.drain(ADMIN, "n0", "fan failure")  # the first node changed
    assert json.loads(one_gzip_member(d.nodes_listing(compressed=True)))[0]["reason"] == "fan failure"
    d.leadership.role = "standby"  # a standby renders and compresses every node each time
    assert one_gzip_member(d.nodes_listing(compressed=True)) == d.nodes_listing()
    empty = Daemon(DaemonConfig(), tmp_path / "empty", clock=ManualClock())
    empty.prepare()
    empty.leadership.role = "leader"
    try:
        assert one_gzip_member(empty.nodes_listing(compressed=True)) == empty.nodes_listing() == b"[]"
    finally:
        empty.engine.dispose()


# the listing's pieces put together, with and without ISA-L (a platform without its wheel)
JOIN_CHECK = """
import sys, gzip, zlib
if sys.argv[1] == "zlib":
    sys.modules["isal"] = None  # as if isal were not installed
from scheduler.daemon import views
parts = [b"[", b'{"name": "n1", "gpus": [1, 2, 3]}' * 200, b",", b'{"x": 1}', b"]"]
pieces = [views.deflate_piece(p) for p in parts]
crc = 0
for p in parts:
    crc = zlib.crc32(p, crc)
joined = views.gzip_joined(pieces, crc, sum(map(len, parts)))
assert gzip.decompress(joined) == b"".join(parts)
assert gzip.decompress(views.gzip_bytes(b"x" * 5000)) == b"x" * 5000
print(views._deflate.__name__)
"""


@pytest.mark.parametrize("engine, module", [("isal", "isal.isal_zlib"), ("zlib", "zlib")])
def test_compressed_pieces_join_into_one_gzip_member_with_isal_and_without(engine, module):
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", JOIN_CHECK, engine], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == module


@pytest.mark.parametrize("header, gz", [
    ("gzip, deflate", True), ("gzip, deflate, br, zstd", True), ("GZIP", True), ("x-gzip", True),
    ("br;q=1.0, gzip;q=0.8, *;q=0.1", True), ("*", True), ("gzip;q=0", False), ("gzip;q=0.0, *", False),
    ("deflate", False), ("identity", False), ("", False), (None, False), ("gzip;q=nope", False),
])
def test_which_accept_encoding_headers_admit_gzip(header, gz):
    from scheduler.daemon.views import accepts_gzip

    assert accepts_gzip(header) is gz


def test_a_client_that_asks_for_gzip_gets_the_listing_compressed(demo_cluster):
    """From the demo's daemon (a real process, simulated SSH nodes sending telemetry): the same
    nodes either way, under a third of the bytes compressed (2 nodes of 4 GPUs), and the CLI (httpx asks
    for gzip) lists them."""
    auth = {"Authorization": f"Bearer {demo_cluster.token}"}
    with httpx.Client(base_url=demo_cluster.url, headers=auth) as c:
        plain = c.get("/v1/nodes", headers={"Accept-Encoding": "identity"})
        packed = c.get("/v1/nodes", headers={"Accept-Encoding": "gzip"})
        refused = c.get("/v1/nodes", headers={"Accept-Encoding": "gzip;q=0, br"})
    assert plain.status_code == packed.status_code == refused.status_code == 200
    assert "content-encoding" not in plain.headers and "content-encoding" not in refused.headers
    assert packed.headers["content-encoding"] == "gzip"
    assert plain.headers["vary"] == packed.headers["vary"] == "Accept-Encoding"
    names = [n["name"] for n in plain.json()]
    assert len(names) == 2 and [n["name"] for n in packed.json()] == names
    assert [set(n) for n in packed.json()] == [set(n) for n in plain.json()]
    assert packed.num_bytes_downloaded * 3 < plain.num_bytes_downloaded
    listed = json.loads(demo_cluster.cli("nodes", "--json", check=True).stdout)
    assert [n["name"] for n in listed] == names


def test_a_long_job_listing_is_compressed_and_a_short_one_is_not(demo_cluster):
    auth = {"Authorization": f"Bearer {demo_cluster.token}"}
    with httpx.Client(base_url=demo_cluster.url, headers=auth) as c:
        ids = [c.post("/v1/jobs", json={"command": ["sleep", "1"], "gpus": 1, "hold": True,
                                        "name": f"held-{i}"}).json()["id"] for i in range(60)]
        try:
            plain = c.get("/v1/jobs", params={"state": "PENDING"}, headers={"Accept-Encoding": "identity"})
            packed = c.get("/v1/jobs", params={"state": "PENDING"}, headers={"Accept-Encoding": "gzip"})
            short = c.get("/v1/jobs", params={"ids": str(ids[0])}, headers={"Accept-Encoding": "gzip"})
        finally:
            assert c.post("/v1/jobs/actions/cancel", json={"ids": ids}).json()["done"] == ids
    assert len(plain.content) >= 16 * 1024  # long enough to be compressed
    assert "content-encoding" not in plain.headers and packed.headers["content-encoding"] == "gzip"
    assert packed.json() == plain.json() and {j["id"] for j in plain.json()} >= set(ids)
    assert packed.num_bytes_downloaded * 4 < plain.num_bytes_downloaded
    assert "content-encoding" not in short.headers and [j["name"] for j in short.json()] == ["held-0"]


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
