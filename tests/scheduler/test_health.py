"""GPU health end to end on the demo's simulated nodes: a fault drains the node with its cause."""

import json

import httpx
import pytest

from scheduler.client import ApiError
from tests.conftest import add_sshd_node, wait_for


def test_fatal_xid_drains_the_node_with_the_cause_and_resume_returns_it(demo_cluster):
    c = demo_cluster.client()
    job = c.submit({"command": ["sleep", "30"], "gpus": 1})
    node = wait_for(lambda: (j := c.job(job["id"]))["state"] == "RUNNING" and j, 15)["allocation"][0]["node"]
    out = demo_cluster.cli("node", "fault", node, "--gpu", "0", "--xid", "79", check=True).stdout
    assert "xid 79 injected" in out
    drained = wait_for(lambda: (n := c.node(node))["state"] in ("DRAINING", "DRAINED") and n, 15,
                       what="health drain")
    assert drained["state"] == "DRAINING"  # its job still runs
    assert "XID 79" in drained["reason"] and "GPU 0" in drained["reason"]
    assert "XID 79" in demo_cluster.cli("nodes", check=True).stdout
    c.cancel(job["id"])
    wait_for(lambda: c.node(node)["state"] == "DRAINED", 15, what="DRAINED once the job is gone")
    demo_cluster.cli("node", "fault", node, "--gpu", "0", "--clear", check=True)
    assert c.resume_node(node)["state"] == "UP"
    # the same (cleared) cause does not drain it again
    assert c.node(node)["state"] == "UP"


def test_gpu_off_the_bus_is_never_allocated(demo_cluster):
    c = demo_cluster.client()
    c.fault_node("node-2", 3, "off_bus")
    wait_for(lambda: "3" in c.node("node-2")["excluded_gpus"], 10, what="GPU 3 excluded")
    if c.node("node-2")["state"] != "UP":
        # the health gate refuses a node with a GPU off the bus; an operator may run it on the rest
        with pytest.raises(ApiError, match="3 of 4 expected GPUs present"):
            c.resume_node("node-2")
        c.resume_node("node-2", force=True)
    gpus_seen = set()
    ids = [c.submit({"command": ["sleep", "2"], "gpus": 1, "constraint": {}})["id"] for _ in range(6)]
    for i in ids:
        j = wait_for(lambda i=i: (j := c.job(i))["allocation"] and j, 20, what=f"job {i} allocated")
        for a in j["allocation"]:
            gpus_seen.update((a["node"], g) for g in a["gpus"])
    assert ("node-2", 3) not in gpus_seen
    for i in ids:
        try:
            c.cancel(i)
        except ApiError:
            pass
    c.fault_node("node-2", 3, "clear")


def test_per_gpu_listing_and_dcgm_metrics(demo_cluster):
    out = demo_cluster.cli("nodes", "--gpus", check=True).stdout
    assert "node-1" in out and len(out.strip().splitlines()) >= 1 + 2 * 4
    # each node's GPUs are a scrape target of their own (instance = the node), as dcgm-exporter's
    assert "DCGM_FI_DEV_GPU_UTIL" not in httpx.get(f"{demo_cluster.url}/metrics").text
    text = httpx.get(f"{demo_cluster.url}/metrics/nodes/node-1").text
    for name in ("DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_GPU_TEMP", "DCGM_FI_DEV_POWER_USAGE"):
        assert f'{name}{{' in text
    nodes = json.loads(demo_cluster.cli("nodes", "--json", check=True).stdout)
    assert all(len(n["telemetry"]["gpus"]) == 4 for n in nodes)


def test_fault_injection_is_refused_on_a_real_node(daemon, sshd_factory):
    node = sshd_factory("r1", daemon.public_key)
    add_sshd_node(daemon, node)
    r = daemon.cli("node", "fault", "r1", "--gpu", "0", "--ecc-dbe")
    assert r.returncode == 1
    assert "real node; fault injection works only on the demo's simulated GPUs" in r.stderr


@pytest.mark.parametrize("args", [["--xid", "79", "--off-bus"], []])
def test_fault_needs_exactly_one_kind(demo_cluster, args):
    r = demo_cluster.cli("node", "fault", "node-1", "--gpu", "0", *args)
    assert r.returncode == 2 and "exactly one of" in r.stderr
