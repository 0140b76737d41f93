"""GPUs passed to containers by CDI name where the node has an NVIDIA CDI spec.

The spec is the NVIDIA Container Toolkit's shape (`nvidia-ctk cdi generate`): kind
nvidia.com/gpu, one device per GPU by index and by UUID, `all`, and the control nodes in the
spec-wide edits. Its index names deliberately differ from the device minors (as NVML's PCI
order can differ from /dev/nvidiaN on a real node): the agent must pick, for each allocated
/dev/nvidiaN, the CDI device that holds that node, not the name `nvidia.com/gpu=N`.

On the node the spec lies in /var/run/cdi, private to that node: its /run is an overlay with
an upper layer of its own, so neither the machine nor other tests' nodes see it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from scheduler import containers
from tests.conftest import wait_for, wait_job
from tests.nodes.conftest import add_node, start_daemon
from tests.nodes.registry import podman_config, use_podman_config
from tests.nodes.test_containers import lab  # noqa: F401 - the registries and the image

GPUS = 4


def toolkit_spec(gpus: int = GPUS, index_of=lambda minor: GPUS - 1 - minor) -> str:
    """A CDI spec as `nvidia-ctk cdi generate` writes it, for fake GPUs /dev/nvidia0..N-1."""
    devices = []
    for minor in range(gpus):
        edits = f"  containerEdits:\n    deviceNodes:\n    - path: /dev/nvidia{minor}\n"
        devices.append(f"- {edits[2:]}  name: GPU-fa4e{minor:04d}-0000-0000-0000-000000000000\n")
        devices.append(f"- {edits[2:]}  name: \"{index_of(minor)}\"\n")
    every = "".join(f"    - path: /dev/nvidia{m}\n" for m in range(gpus))
    devices.append(f"- containerEdits:\n    deviceNodes:\n{every}  name: all\n")
    return ("---\ncdiVersion: 0.5.0\ncontainerEdits:\n  deviceNodes:\n  - path: /dev/nvidiactl\n"
            "devices:\n" + "".join(devices) + "kind: nvidia.com/gpu\n")


# ---------------------------------------------------------------- the spec, read from files

def test_each_gpu_gets_the_cdi_name_of_the_device_that_holds_its_node(tmp_path):
    (tmp_path / "nvidia.yaml").write_text(toolkit_spec())
    found = containers.cdi_spec([str(tmp_path)])
    assert found == {"spec": str(tmp_path / "nvidia.yaml"), "devices": {
        "/dev/nvidia0": "nvidia.com/gpu=3", "/dev/nvidia1": "nvidia.com/gpu=2",
        "/dev/nvidia2": "nvidia.com/gpu=1", "/dev/nvidia3": "nvidia.com/gpu=0"}}
    assert containers.gpu_devices([0, 2], cdi=found["devices"]) == [
        "nvidia.com/gpu=3", "nvidia.com/gpu=1"]


def test_a_json_spec_counts_and_a_spec_of_another_kind_does_not(tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    (other / "fpga.yaml").write_text(toolkit_spec().replace("nvidia.com/gpu", "vendor.com/fpga"))
    assert containers.cdi_spec([str(other)]) == {}
    spec = {"cdiVersion": "0.5.0", "kind": "nvidia.com/gpu", "devices": [
        {"name": "0", "containerEdits": {"deviceNodes": [{"path": "/dev/nvidia0"}]}}]}
    (tmp_path / "nvidia.json").write_text(json.dumps(spec))
    assert containers.cdi_spec([str(other), str(tmp_path)])["devices"] == {
        "/dev/nvidia0": "nvidia.com/gpu=0"}


def test_gpus_the_spec_does_not_name_go_by_device_node(tmp_path):
    (tmp_path / "nvidia.yaml").write_text(toolkit_spec(gpus=2, index_of=lambda m: m))
    names = containers.cdi_spec([str(tmp_path)])["devices"]
    dev = tmp_path / "dev"
    dev.mkdir()
    (dev / "nvidiactl").touch()
    assert containers.gpu_devices([1], cdi=names) == ["nvidia.com/gpu=1"]
    assert containers.gpu_devices([1, 3], dev=str(dev), cdi={
        str(dev / "nvidia1"): "nvidia.com/gpu=1"}) == [
        str(dev / "nvidia1"), str(dev / "nvidia3"), str(dev / "nvidiactl")]


# ---------------------------------------------------------------- a node with a CDI spec

@pytest.fixture
def cdi_cluster(base, node_factory, users, lab):  # noqa: F811
    """A daemon and one 4-GPU podman node whose /var/run/cdi holds the toolkit's spec."""
    spec = base / "nvidia.yaml"
    spec.write_text(toolkit_spec())
    run = base / "cdi-run"  # the node's own /run: an overlay, upper layer here
    setup = (f"mkdir -p {run}/upper {run}/work\n"
             f"mount -t overlay overlay -o lowerdir=/run,upperdir={run}/upper,"
             f"workdir={run}/work /run\n"
             f"mkdir -p /run/cdi && cp {spec} /run/cdi/nvidia.yaml")
    d = start_daemon(base, {"alice": "alice"})
    node = node_factory("cdi1", authorized=d.public_key, gpus=GPUS, setup=setup)
    use_podman_config(node, podman_config(node.dir / "podman", [lab["open"].address]))
    add_node(d, node)
    yield d, node
    d.stop()


def test_the_node_reports_its_cdi_spec(cdi_cluster):
    d, node = cdi_cluster
    assert not Path("/run/cdi").exists(), "the spec leaked out of the node's /run"
    shown = json.loads(d.cli("node", "show", node.name, "--json", check=True).stdout)
    found = shown["agent"]["containers"]
    assert found["runtime"] == "podman" and found["cdi"] is True
    assert found["cdi_spec"] == "/var/run/cdi/nvidia.yaml"
    assert found["cdi_devices"]["/dev/nvidia0"] == "nvidia.com/gpu=3"


def containers_on(node) -> dict[str, dict]:
    """The node's running containers: name -> what podman was asked for and what it set up."""
    names = node.run("podman ps --format '{{.Names}}'").stdout.split()
    out = {}
    for name in names:
        r = node.run(f"podman inspect --format '{{{{json .Config.CreateCommand}}}}"
                     f"\t{{{{json .HostConfig.Devices}}}}' {name}")
        assert r.returncode == 0, r.stderr
        argv, devices = (json.loads(x) for x in r.stdout.strip().split("\t"))
        out[name] = {"argv": argv, "devices": sorted(d["PathOnHost"] for d in devices)}
    return out


def listing(log: str) -> str:
    """What the job printed (its log without the job step's own `trainyard:` lines)."""
    return "".join(x for x in log.splitlines() if x and not x.startswith("trainyard:"))


def requested(argv: list[str]) -> list[str]:
    return [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--device"]


def test_two_jobs_get_their_gpus_by_cdi_name_and_see_only_their_own(cdi_cluster, base, lab):  # noqa: F811
    d, node = cdi_cluster
    gate = base / "gate"  # the jobs wait for `release` here while the test looks at them
    gate.mkdir(mode=0o755)
    c = d.client(d.client().create_token("alice", "user")["token"])
    script = ("ls /dev | grep nvidia | tr '\\n' ' '; echo; "
              "while [ ! -e /gate/release ]; do sleep 0.1; done")
    jobs = [c.submit({"command": ["sh", "-c", script], "image": lab["image"], "gpus": 2,
                      "container_mounts": [f"{gate}:/gate:ro"]}) for _ in range(2)]
    running = [wait_job(c, j["id"], "RUNNING", timeout=120) for j in jobs]
    gpus = {j["id"]: j["allocation"][0]["gpus"] for j in running}
    assert sorted(gpus[jobs[0]["id"]] + gpus[jobs[1]["id"]]) == [0, 1, 2, 3]

    seen = wait_for(lambda: len(s := containers_on(node)) == 2 and s, 60,
                    what="both jobs' containers running")
    spec_names = {m: f"nvidia.com/gpu={GPUS - 1 - m}" for m in range(GPUS)}
    for job in jobs:
        mine = gpus[job["id"]]
        (name,) = [n for n in seen if n.startswith(f"trainyard-{job['id']}.")]
        assert requested(seen[name]["argv"]) == [spec_names[g] for g in mine]
        assert seen[name]["devices"] == sorted([f"/dev/nvidia{g}" for g in mine]
                                               + ["/dev/nvidiactl"])
        inside = wait_for(lambda j=job: listing(c.log(j["id"])[0]), 30, what="the job's listing")
        assert inside.split() == [f"nvidia{g}" for g in sorted(mine)] + ["nvidiactl"]

    (gate / "release").touch()
    for job in jobs:
        assert wait_job(c, job["id"], ("COMPLETED", "FAILED"), timeout=60)["state"] == "COMPLETED"
    assert os.listdir(gate) == ["release"]
