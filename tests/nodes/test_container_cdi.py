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
    assert found == {"spec": str(tmp_path / "nvidia.yaml"), "version": "0.5.0", "devices": {
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


def test_a_runtime_that_cannot_read_the_spec_is_told_apart():
    spec = {"spec": "/etc/cdi/nvidia.yaml", "version": "0.6.0", "devices": {}}
    assert containers.cdi_refusal("podman", "4.3.1", {**spec, "version": "0.5.0"}) == ""
    assert containers.cdi_refusal("podman", "4.9.3", spec) == ""
    assert containers.cdi_refusal("podman", "4.3.1", spec).startswith(
        "podman 4.3.1 reads CDI specs up to cdiVersion 0.5.0 and /etc/cdi/nvidia.yaml is 0.6.0")
    assert containers.cdi_refusal("docker", "20.10.24", spec).startswith(
        "docker 20.10.24 does not take CDI names")


# ---------------------------------------------------------------- a node with a CDI spec

def cdi_node_setup(base: Path, spec_text: str) -> str:
    """Shell for a node's namespace: its own /run (an overlay whose upper layer is its own),
    with the spec in /var/run/cdi, seen by nothing outside the node."""
    spec = base / "nvidia.yaml"
    spec.write_text(spec_text)
    run = base / "cdi-run"
    return (f"mkdir -p {run}/upper {run}/work\n"
            f"mount -t overlay overlay -o lowerdir=/run,upperdir={run}/upper,"
            f"workdir={run}/work /run\n"
            f"mkdir -p /run/cdi && cp {spec} /run/cdi/nvidia.yaml")


@pytest.fixture
def cdi_cluster(base, node_factory, users, lab):  # noqa: F811
    """A daemon and one 4-GPU podman node whose /var/run/cdi holds a spec (the toolkit's by
    default, or the text given)."""
    made = []

    def make(spec_text: str = ""):
        d = start_daemon(base, {"alice": "alice"})
        made.append(d)
        node = node_factory("cdi1", authorized=d.public_key, gpus=GPUS,
                            setup=cdi_node_setup(base, spec_text or toolkit_spec()))
        use_podman_config(node, podman_config(node.dir / "podman", [lab["open"].address]))
        add_node(d, node)
        return d, node

    yield make
    for d in made:
        d.stop()


def test_the_node_reports_its_cdi_spec(cdi_cluster):
    d, node = cdi_cluster()
    assert not Path("/run/cdi").exists(), "the spec leaked out of the node's /run"
    shown = json.loads(d.cli("node", "show", node.name, "--json", check=True).stdout)
    found = shown["agent"]["containers"]
    assert found["runtime"] == "podman" and found["cdi"] is True
    assert found["cdi_spec"] == "/var/run/cdi/nvidia.yaml"
    assert found["cdi_devices"]["/dev/nvidia0"] == "nvidia.com/gpu=3"
    text = d.cli("node", "show", node.name, check=True).stdout  # what an operator reads
    assert "GPUs to containers: by CDI name (/var/run/cdi/nvidia.yaml)" in text


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


def run_two_jobs(d, node, base, lab) -> dict[int, dict]:  # noqa: F811
    """Two 2-GPU jobs of alice's at once on the 4-GPU node; for each job id, its GPUs, the
    devices podman was asked for (`--device`), the host devices it set up, and what the job
    saw in its /dev. Both are still running while podman is asked."""
    gate = base / "gate"  # the jobs wait for `release` here while the test looks at them
    gate.mkdir(mode=0o755)
    c = d.client(d.client().create_token("alice", "user")["token"])
    script = ("ls /dev | grep nvidia | tr '\\n' ' '; echo; "
              "while [ ! -e /gate/release ]; do sleep 0.1; done")
    jobs = [c.submit({"command": ["sh", "-c", script], "image": lab["image"], "gpus": 2,
                      "container_mounts": [f"{gate}:/gate:ro"]}) for _ in range(2)]
    out = {}
    try:
        running = [wait_job(c, j["id"], "RUNNING", timeout=120) for j in jobs]
        seen = wait_for(lambda: len(s := containers_on(node)) == 2 and s, 60,
                        what="both jobs' containers running")
        for job in running:
            (name,) = [n for n in seen if n.startswith(f"trainyard-{job['id']}.")]
            inside = wait_for(lambda j=job: listing(c.log(j["id"])[0]), 30, what="the job's listing")
            out[job["id"]] = {"gpus": job["allocation"][0]["gpus"], "inside": inside.split(),
                              "requested": requested(seen[name]["argv"]),
                              "devices": seen[name]["devices"]}
    finally:  # the jobs end whatever happened above: no container is left waiting on the gate
        (gate / "release").touch()
    for job in jobs:
        assert wait_job(c, job["id"], ("COMPLETED", "FAILED"), timeout=60)["state"] == "COMPLETED"
    assert sorted(g for j in out.values() for g in j["gpus"]) == [0, 1, 2, 3]
    return out


def test_two_jobs_get_their_gpus_by_cdi_name_and_see_only_their_own(
        cdi_cluster, base, lab):  # noqa: F811
    d, node = cdi_cluster()
    spec_names = {m: f"nvidia.com/gpu={GPUS - 1 - m}" for m in range(GPUS)}
    for job in run_two_jobs(d, node, base, lab).values():
        mine = job["gpus"]
        assert job["requested"] == [spec_names[g] for g in mine]
        assert job["devices"] == sorted([f"/dev/nvidia{g}" for g in mine] + ["/dev/nvidiactl"])
        assert job["inside"] == [f"nvidia{g}" for g in sorted(mine)] + ["nvidiactl"]


def test_a_spec_newer_than_podman_reads_falls_back_to_device_nodes(
        cdi_cluster, base, lab):  # noqa: F811
    d, node = cdi_cluster(toolkit_spec().replace("cdiVersion: 0.5.0", "cdiVersion: 0.6.0"))
    found = d.client().node(node.name)["agent"]["containers"]
    version = found["runtimes"]["podman"]["version"]
    if containers.version_tuple(version) >= (4, 7):
        pytest.skip(f"podman {version} reads cdiVersion 0.6.0; the fallback is for podman < 4.7")
    assert found["cdi"] is False and found["cdi_spec"] == "/var/run/cdi/nvidia.yaml"
    assert found["cdi_note"].startswith(
        f"GPUs go to containers by device node: podman {version} reads CDI specs up to "
        "cdiVersion 0.5.0 and /var/run/cdi/nvidia.yaml is 0.6.0")
    for job in run_two_jobs(d, node, base, lab).values():
        mine = [f"/dev/nvidia{g}" for g in job["gpus"]]
        assert job["requested"] == mine + ["/dev/nvidiactl"]
        assert job["inside"] == [f"nvidia{g}" for g in sorted(job["gpus"])] + ["nvidiactl"]
