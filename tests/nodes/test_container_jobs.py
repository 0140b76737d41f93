"""Container jobs through the daemon and the CLI: pulled on every node of a gang before any rank
starts (CONFIGURING, the pull as reason), the digest recorded, a missing image failing the job
with its name, each node's runtime shown, nodes without one avoided, OOM as for bare jobs."""

from __future__ import annotations

import json
import os
import pwd
import re

import pytest

from tests.conftest import wait_for, wait_job
from tests.nodes.conftest import add_node, start_daemon
from tests.nodes.registry import Throttled, podman_config, use_podman_config
from tests.nodes.test_containers import SECRET, lab  # noqa: F401 - the registries and the image


@pytest.fixture
def cluster(base, node_factory, users, lab):  # noqa: F811
    d = start_daemon(base, {"alice": "alice"})
    nodes = []
    for name in ("c1", "c2"):
        node = node_factory(name, authorized=d.public_key, gpus=4)
        use_podman_config(node, podman_config(node.dir / "podman", [lab["open"].address]))
        add_node(d, node)
        nodes.append(node)
    yield d, nodes
    d.stop()


def events_of(c, job_id: int) -> list[dict]:
    return [e for e in c.events(since=0, limit=10000) if e["target"] == str(job_id)]


def test_a_two_node_image_job_is_pulled_on_both_nodes_before_either_rank_starts(cluster, lab):  # noqa: F811
    d, nodes = cluster
    admin = d.client()
    alice = d.client(admin.create_token("alice", "user")["token"])
    job = alice.submit({"command": ["sh", "-c", "id -u; ls /dev | grep nvidia | tr '\\n' ' '"],
                        "image": lab["image"], "nodes": 2, "gpus": 1})
    done = wait_job(alice, job["id"], ("COMPLETED", "FAILED"), timeout=120)
    assert done["state"] == "COMPLETED", done
    assert done["image"] == lab["image"] and done["image_digest"] == lab["digest"]
    trail = events_of(admin, job["id"])
    pulled = [i for i, e in enumerate(trail) if e["action"] == "job.pulled"]
    running = next(i for i, e in enumerate(trail) if e["action"] == "job.state"
                   and e["detail"]["state"] == "RUNNING")
    assert {trail[i]["detail"]["node"] for i in pulled} == {n.name for n in nodes} and max(pulled) < running
    shown = d.cli("node", "show", nodes[0].name, check=True).stdout
    assert "images (podman" in shown and lab["image"] in shown and lab["digest"][:19] in shown
    out = alice.log(job["id"])[0].split("\n")
    # alice's own uid (the image has no passwd entry for her), and only her one GPU
    assert out[0] == str(pwd.getpwnam("alice").pw_uid) and out[1].split() == ["nvidia0", "nvidiactl"]


def test_a_missing_image_fails_the_job_naming_it_and_the_node(cluster, lab):  # noqa: F811
    d, _ = cluster
    c = d.client()
    missing = lab["image"].rsplit(":", 1)[0] + ":nope"
    job = c.submit({"command": ["true"], "image": missing, "gpus": 1})
    failed = wait_job(c, job["id"], "FAILED", timeout=120)
    assert missing in failed["reason"] and "failed on c" in failed["reason"], failed["reason"]


def test_an_unparsable_image_reference_is_refused_at_submit(cluster):
    d, _ = cluster
    from scheduler.client import ApiError

    with pytest.raises(ApiError) as e:
        d.client().submit({"command": ["true"], "image": "UPPER/Case:tag"})
    assert e.value.status == 422 and "not a valid image reference" in e.value.detail


def test_private_registry_credentials_reach_the_pull_and_nothing_else(base, node_factory, users, lab):  # noqa: F811
    import os
    import subprocess

    from tests.conftest import TEST_CONFIG, DaemonProc

    secret_file = base / "registries.toml"
    secret_file.write_text(f'["{lab["private"].address}"]\nusername = "trainer"\npassword = "{SECRET}"\n')
    os.chmod(secret_file, 0o600)
    where = base / "daemon-private"
    where.mkdir(exist_ok=True)
    d = DaemonProc(where)
    d.config.write_text(TEST_CONFIG.format(grace=3.0) + '\n[users]\n"alice" = "alice"\n'
                        f'\n[nodes]\nregistry_credentials = "{secret_file}"\n')
    d.start()
    try:
        node = node_factory("p1", authorized=d.public_key, gpus=4)
        use_podman_config(node, podman_config(node.dir / "podman", [lab["private"].address]))
        add_node(d, node)
        c = d.client()
        image = lab["image"].replace(lab["open"].address, lab["private"].address)
        job = c.submit({"command": ["echo", "pulled privately"], "image": image, "gpus": 1})
        done = wait_job(c, job["id"], ("COMPLETED", "FAILED"), timeout=120)
        assert done["state"] == "COMPLETED", done["reason"]
        seen = [c.job(job["id"]), c.events(since=0, limit=10000), c.log(job["id"])[0], c.nodes()]
        assert SECRET not in repr(seen)
        assert SECRET not in d.log.read_text()
        leaked = subprocess.run(["grep", "-rl", SECRET, str(where / "state")], capture_output=True, text=True)
        assert leaked.stdout == ""
        os.chmod(secret_file, 0o644)
        d.stop()
        with pytest.raises(AssertionError, match="readable by others"):
            d.start()
    finally:
        d.stop()


def column(out: str, name: str) -> dict[str, str]:
    """Node name -> the cell under the header `name` of a `trainyard nodes` table."""
    header, *rows = out.splitlines()
    cell = re.search(rf"\b{name}\s*", header)
    return {row.split()[0]: row[cell.start():cell.end()].strip() for row in rows}


def test_nodes_shows_the_container_runtime_each_agent_found(cluster):
    d, nodes = cluster
    out = d.cli("nodes", check=True).stdout
    assert out.splitlines()[0].split() == [
        "NAME", "STATE", "GPUS", "MODEL", "POOL", "ADDRESS", "FENCE", "RUNTIME", "REASON"]
    assert column(out, "RUNTIME") == {n.name: "podman" for n in nodes}


def test_a_node_without_a_runtime_takes_no_image_job_and_says_why(base, node_factory, users):
    d = start_daemon(base, {"alice": "alice"})
    try:  # podman hidden on this node: /usr/bin/podman is not executable there
        node = node_factory("bare", authorized=d.public_key, gpus=4,
                            setup="mount --bind /dev/null /usr/bin/podman")
        add_node(d, node)
        c = d.client()
        found = c.node(node.name)["agent"]["containers"]
        assert found["runtime"] == "" and found["reason"].startswith(
            "no container runtime on this node (install podman, docker or enroot)")
        assert column(d.cli("nodes", check=True).stdout, "RUNTIME") == {node.name: "none"}
        assert "images: no container runtime on this node" in d.cli(
            "node", "show", node.name, check=True).stdout
        job = c.submit({"command": ["true"], "image": "busybox", "gpus": 1})
        waiting = wait_for(lambda: (j := c.job(job["id"]))["reason"] and j, 15,
                           what="a pending reason")
        assert waiting["state"] == "PENDING" and waiting["reason"] == "BadConstraints"
        bare = c.submit({"command": ["true"], "gpus": 1})  # the node itself is free and well
        assert wait_job(c, bare["id"], ("COMPLETED", "FAILED"), timeout=60)["state"] == "COMPLETED"
        assert c.job(job["id"])["state"] == "PENDING"
        c.cancel(job["id"])
    finally:
        d.stop()


def test_a_container_job_over_its_mem_ends_out_of_memory(cluster, lab):  # noqa: F811
    d, _ = cluster
    c = d.client()
    job = c.submit({"command": ["busybox", "tail", "/dev/zero"], "image": lab["image"],
                    "gpus": 1, "mem": 48})
    done = wait_job(c, job["id"], ("COMPLETED", "FAILED", "OUT_OF_MEMORY"), timeout=120)
    assert done["state"] == "OUT_OF_MEMORY", done
    assert "memory limit of 48 MiB exceeded" in done["reason"]


@pytest.fixture
def alice_data(base, users):
    """A directory only alice may read, with one file, on every node (they share this machine's
    file systems)."""
    alice = users["alice"]
    data = base / "alice-data"
    data.mkdir()
    (data / "in.txt").write_text("from alice's data\n")
    for path in (data, data / "in.txt"):
        os.chown(path, alice.pw_uid, alice.pw_gid)
    os.chmod(data, 0o700)  # the container reads it as alice, not as root
    return data


def ran_in_the_image(d, token: str, job_id: int, lab, alice) -> None:  # noqa: F811
    """The job completed in the image, read the mount from the workdir as alice, and had the
    job's trainyard and Slurm variables."""
    c = d.client(token)
    done = wait_job(c, job_id, ("COMPLETED", "FAILED"), timeout=120)
    assert done["state"] == "COMPLETED" and done["image"] == lab["image"], done
    assert done["image_digest"] == lab["digest"]
    assert c.log(job_id)[0].splitlines()[-4:] == [
        "from alice's data", "/data", str(alice.pw_uid), f"{job_id} {job_id}"]


def test_submit_image_with_container_mounts_and_workdir(cluster, lab, users, alice_data):  # noqa: F811
    d, _ = cluster
    token = d.client().create_token("alice", "user")["token"]
    job = json.loads(d.cli(
        "submit", "--json", "--gpus", "1", "--image", lab["image"],
        "--container-mounts", f"{alice_data}:/data:ro", "--container-workdir", "/data",
        "--", "sh", "-c", "cat in.txt; pwd; id -u; echo $TRAINYARD_JOB_ID $SLURM_JOB_ID",
        token=token, check=True).stdout)
    ran_in_the_image(d, token, job["id"], lab, users["alice"])


def test_pyxis_sbatch_lines_run_the_script_in_the_image(cluster, lab, users, alice_data, base):  # noqa: F811
    d, _ = cluster
    token = d.client().create_token("alice", "user")["token"]
    script = base / "train.sbatch"
    script.write_text(f"#!/bin/sh\n#SBATCH --gpus=1\n#SBATCH --container-image={lab['image']}\n"
                      f"#SBATCH --container-mounts={alice_data}:/data:ro\n"
                      "#SBATCH --container-workdir=/data\n"
                      "cat in.txt; pwd; id -u; echo $TRAINYARD_JOB_ID $SLURM_JOB_ID\n")
    job = json.loads(d.cli("submit", "--json", str(script), token=token, check=True).stdout)
    ran_in_the_image(d, token, job["id"], lab, users["alice"])


def test_a_job_is_configuring_with_the_pull_and_its_progress_as_reason(base, node_factory, users, lab):  # noqa: F811
    slow = Throttled(lab["open"].address)
    d = start_daemon(base, {"alice": "alice"})
    try:
        node = node_factory("s1", authorized=d.public_key, gpus=4)
        use_podman_config(node, podman_config(node.dir / "podman", [slow.address]))
        add_node(d, node)
        c = d.client()
        image = f"{slow.address}/tiny:1"
        job = c.submit({"command": ["echo", "ran"], "image": image, "gpus": 1})
        pulling = wait_for(lambda: (j := c.job(job["id"]))["reason"].startswith("pulling") and j,
                           60, interval=0.02, what="the pull's progress as the job's reason")
        assert pulling["state"] == "CONFIGURING"
        assert re.fullmatch(rf"pulling {re.escape(image)} on {node.name} \(\d+(/\d+)? layers\)",
                            pulling["reason"]), pulling["reason"]
        done = wait_job(c, job["id"], ("COMPLETED", "FAILED"), timeout=120)
        assert done["state"] == "COMPLETED" and done["image_digest"] == lab["digest"], done
    finally:
        d.stop()
        slow.stop()


def test_the_daemons_pull_timeout_fails_a_job_whose_registry_hangs(base, node_factory, users, lab):  # noqa: F811
    from tests.conftest import TEST_CONFIG, DaemonProc

    where = base / "daemon-hanging"
    where.mkdir(exist_ok=True)
    d = DaemonProc(where)
    d.config.write_text(TEST_CONFIG.format(grace=3.0) + '\n[users]\n"alice" = "alice"\n'
                        '\n[nodes]\npull_timeout = 3\nimage_cache_gb = 50\n')
    d.start()
    try:
        node = node_factory("h1", authorized=d.public_key, gpus=4)
        use_podman_config(node, podman_config(node.dir / "podman", [lab["hanging"].address]))
        add_node(d, node)
        assert "cache limit 50.0 GB" in d.cli("node", "show", node.name, check=True).stdout
        c = d.client()
        image = f"{lab['hanging'].address}/stuck:1"
        job = c.submit({"command": ["true"], "image": image, "gpus": 1})
        failed = wait_job(c, job["id"], ("FAILED", "COMPLETED"), timeout=60)
        assert failed["state"] == "FAILED"
        assert f"pulling {image} on {node.name} timed out after 3 s" in failed["reason"], failed
    finally:
        d.stop()
