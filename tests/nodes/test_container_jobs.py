"""Container jobs through the daemon: pulled on every node of a gang before any rank starts, the
digest recorded, a missing image failing the job with its name, nodes without a runtime avoided."""

from __future__ import annotations

import pwd

import pytest

from tests.conftest import wait_for, wait_job
from tests.nodes.conftest import add_node, start_daemon
from tests.nodes.registry import podman_config, use_podman_config
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


def test_nodes_without_a_runtime_are_not_chosen(cluster):
    d, nodes = cluster
    c = d.client()
    assert all(n["agent"]["containers"]["runtime"] == "podman" for n in c.nodes())
    job = c.submit({"command": ["true"], "image": "busybox", "gpus": 1, "nodes": 2,
                    "exclude": [nodes[1].name]})  # only one node left for a 2-node gang
    waiting = wait_for(lambda: (j := c.job(job["id"]))["reason"] and j, 15, what="a pending reason")
    assert waiting["state"] == "PENDING" and waiting["reason"] == "BadConstraints"
    c.cancel(job["id"])


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
