"""Jobs in containers on real nodes: only their GPUs, as their owners, images pulled once per node."""

from __future__ import annotations

import json
import shutil
import tempfile
import time
import uuid

import pytest

from scheduler import containers
from scheduler import nodes as node_links
from tests.conftest import require_or_skip
from tests.nodes.conftest import TEST_BASE
from tests.nodes.registry import (
    Hanging,
    Registry,
    build_image,
    missing,
    podman_config,
    use_podman_config,
)

SECRET = f"pw-{uuid.uuid4().hex}"  # the private registry's password: must never be seen


@pytest.fixture(autouse=True)
def bundle_with_containers(monkeypatch):
    """The agent's bundle with containers.py (until scheduler/nodes.py lists it)."""
    if "containers" in node_links.BUNDLE_MODULES:
        yield
        return
    monkeypatch.setattr(node_links, "BUNDLE_MODULES",
                        node_links.BUNDLE_MODULES + ("containers",))
    node_links.agent_bundle.cache_clear()
    yield
    node_links.agent_bundle.cache_clear()


@pytest.fixture(scope="module")
def lab():
    """Two registries (open, and private with a password) holding one busybox image, and a
    registry that never answers."""
    require_or_skip(not missing(), f"container tests need {missing()}")
    TEST_BASE.mkdir(mode=0o755, exist_ok=True)
    work = tempfile.mkdtemp(prefix="containers-", dir=TEST_BASE)
    from pathlib import Path

    work = Path(work)
    data = work / "registry-data"
    open_reg = Registry(work, "open", data)
    private = Registry(work, "private", data, users={"trainer": SECRET})
    hanging = Hanging()
    etc = podman_config(work / "builder", [open_reg.address], work / "builder" / "run")
    digest = build_image(work / "builder", etc, f"{open_reg.address}/tiny:1")
    yield {"open": open_reg, "private": private, "hanging": hanging, "digest": digest,
           "image": f"{open_reg.address}/tiny:1", "work": work}
    for r in (open_reg, private, hanging):
        r.stop()
    shutil.rmtree(work, ignore_errors=True)


@pytest.fixture
def container_node(node_factory, link_factory, lab):
    """A node with podman (its own configuration and image storage) and its link, up."""
    def make(name: str = "n1"):
        node = node_factory(name, gpus=4)
        etc = podman_config(node.dir / "podman", [lab["open"].address, lab["private"].address,
                                                  lab["hanging"].address])
        use_podman_config(node, etc)
        link = link_factory(node)
        hello = link.wait_up()
        return node, link, hello
    return make


def until(link, ev: str, key: str | None = None, timeout: float = 30.0) -> list[dict]:
    """Every message the node sends up to and including the first `ev` (for `key`)."""
    seen = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            msg = link.messages.get(timeout=max(0.01, deadline - time.monotonic()))
        except Exception:
            break
        seen.append(msg)
        if msg.get("ev") == ev and (key is None or msg.get("key") == key):
            return seen
    raise AssertionError(f"no {ev} for {key} within {timeout} s; saw {seen[-5:]}")


def test_the_node_says_which_runtime_runs_containers(container_node):
    _node, _link, hello = container_node()
    assert hello["containers"]["runtime"] == "podman"
    assert hello["containers"]["reason"] == ""
    assert "docker" not in hello["containers"]["runtimes"]  # a CLI without a daemon is no runtime


def test_a_container_job_sees_exactly_its_gpus_and_runs_as_its_owner(container_node, users, lab):
    _node, link, _ = container_node()
    alice = users["alice"]
    link.send(op="launch", key="1.0", job_id=1, user="alice", gpus=[1, 3], image=lab["image"],
              env={"TRAINYARD_JOB_ID": "1"}, argv=["sh", "-c", (
                  "id -u; id -g; ls /dev | grep nvidia | tr '\\n' ' '; echo; "
                  "echo $CUDA_VISIBLE_DEVICES $TRAINYARD_JOB_ID $HOME")])
    started = link.wait_for("started", "1.0")
    assert started["image"] == lab["image"] and started["image_digest"] == lab["digest"]
    assert link.wait_for("exited", "1.0")["rc"] == 0
    out = link.request(op="log", key="1.0")["data"].splitlines()
    assert out[-4:] == [str(alice.pw_uid), str(alice.pw_gid), "nvidia1 nvidia3 nvidiactl ",
                        f"0,1 1 {alice.pw_dir}"]


def test_a_second_job_with_the_same_image_does_not_pull(container_node, lab):
    node, link, _ = container_node()
    registry = lab["open"]
    before = registry.requests("tiny")
    link.send(op="pull", id=7, image=lab["image"], key="2.0")
    pulled = link.wait_for("pulled", timeout=60)
    assert pulled["error"] == "" and pulled["cached"] is False
    assert pulled["digest"] == lab["digest"] and pulled["size"] > 0
    after_pull = registry.requests("tiny")
    assert after_pull > before
    for key in ("2.0", "3.0"):
        link.send(op="launch", key=key, job_id=int(key[0]), user="bob", image=lab["image"],
                  argv=["echo", "ran"])
        assert link.wait_for("exited", key)["rc"] == 0
        assert link.request(op="log", key=key)["data"].endswith("ran\n")
    assert registry.requests("tiny") == after_pull, "a cached image was pulled again"
    link.send(op="pull", id=8, image=lab["image"])
    assert link.wait_for("pulled")["cached"] is True
    listing = link.request(op="images")
    assert [(i["digest"], i["refs"]) for i in listing["images"]] == [
        (lab["digest"], [lab["image"]])]
    assert node.run("podman ps -a --format '{{.Names}}'").stdout == ""  # containers removed


def test_a_missing_image_fails_the_launch_with_its_name(container_node, lab):
    node, link, _ = container_node()
    image = f"{lab['open'].address}/no-such-image:3"
    link.send(op="launch", key="4.0", job_id=4, user="alice", image=image, argv=["true"])
    reason = link.wait_for("launch_failed", "4.0", timeout=60)["reason"]
    assert f"cannot pull {image} on {node.name}" in reason and "manifest unknown" in reason


def test_an_image_reference_that_does_not_parse_is_refused(container_node):
    _node, link, _ = container_node()
    link.send(op="launch", key="5.0", job_id=5, user="alice", image="Not A/Image!", argv=["true"])
    reason = link.wait_for("launch_failed", "5.0")["reason"]
    assert "image 'Not A/Image!' is not a valid image reference" in reason


def test_a_pull_that_hangs_times_out_with_the_reason(container_node, lab):
    node, link, _ = container_node()
    image = f"{lab['hanging'].address}/stuck:1"
    t0 = time.monotonic()
    link.send(op="pull", id=9, image=image, timeout_s=2)
    error = link.wait_for("pulled", timeout=30)["error"]
    assert f"pulling {image} on {node.name} timed out after 2 s" in error
    assert time.monotonic() - t0 < 20


def test_a_mount_the_owner_cannot_read_fails_and_a_readable_one_works(container_node, users, lab):
    node, link, _ = container_node()
    link.send(op="launch", key="6.0", job_id=6, user="bob", image=lab["image"],
              mounts=["/root:/data"], argv=["ls", "/data"])
    reason = link.wait_for("launch_failed", "6.0", timeout=60)["reason"]
    assert "the job's user bob cannot read /root" in reason and "Permission denied" in reason
    home = users["alice"].pw_dir
    node.run(f"echo hello > {home}/in.txt && chown alice: {home}/in.txt")
    link.send(op="launch", key="7.0", job_id=7, user="alice", image=lab["image"],
              mounts=[f"{home}:/data:ro"], container_workdir="/data",
              argv=["sh", "-c", "cat in.txt; { echo x > out.txt; } 2>&1 || echo read-only"])
    assert link.wait_for("exited", "7.0", timeout=60)["rc"] == 0
    assert link.request(op="log", key="7.0")["data"].endswith(
        "hello\nsh: can't create out.txt: Read-only file system\nread-only\n")


def test_cancel_ends_the_container(container_node, lab):
    node, link, _ = container_node()
    link.send(op="launch", key="8.0", job_id=8, user="alice", image=lab["image"],
              argv=["sleep", "300"])
    link.wait_for("started", "8.0", timeout=60)
    link.send(op="signal", key="8.0", sig="TERM")
    assert link.wait_for("exited", "8.0", timeout=30)["rc"] == 143
    assert node.run("podman ps -a --format '{{.Names}}'").stdout == ""


def test_registry_credentials_are_used_for_the_pull_and_never_shown(container_node, lab):
    node, link, _ = container_node()
    image = f"{lab['private'].address}/tiny:1"
    link.send(op="pull", id=10, image=image)
    refused = link.wait_for("pulled", timeout=60)
    assert "authentication required" in refused["error"]
    seen = []
    link.send(op="pull", id=11, image=image, auth={"username": "trainer", "password": "wrong"})
    seen += until(link, "pulled", timeout=60)
    assert "authentication required" in seen[-1]["error"]
    link.send(op="pull", id=12, image=image, auth={"username": "trainer", "password": SECRET})
    seen += until(link, "pulled", timeout=60)
    assert seen[-1]["error"] == "" and seen[-1]["digest"] == lab["digest"]
    link.send(op="launch", key="9.0", job_id=9, user="alice", image=image, argv=["env"])
    seen += until(link, "exited", "9.0", timeout=60)
    assert seen[-1]["rc"] == 0
    log = link.request(op="log", key="9.0")["data"]
    link.send(op="images", id=13)
    seen += until(link, "images")
    for text in (json.dumps(seen), log):
        assert SECRET not in text
    leaks = node.run(f"grep -rl {SECRET} /var/lib/trainyard /tmp /var/tmp {node.dir}/podman "
                     f"{lab['private'].log}")
    assert leaks.stdout == "", f"the password was written to {leaks.stdout}"


def test_a_container_over_its_memory_ends_out_of_memory(container_node, lab):
    node, link, _ = container_node()
    # tail keeps its last lines in memory, and /dev/zero is one line without end
    link.send(op="launch", key="10.0", job_id=10, user="bob", mem_mb=48, image=lab["image"],
              argv=["busybox", "tail", "/dev/zero"])
    end = link.wait_for("exited", "10.0", timeout=120)
    assert end["oom"] is True and end["rc"] == 137, link.request(op="log", key="10.0")["data"]
    left = node.run(f"find /sys/fs/cgroup -path '*trainyard/{node.name}/10.0*'").stdout
    assert left == "", f"cgroups left behind: {left}"
    link.send(op="launch", key="11.0", job_id=11, user="bob", mem_mb=48, image=lab["image"],
              argv=["sh", "-c", "busybox head -c 8000000 /dev/zero | busybox wc -c"])
    end = link.wait_for("exited", "11.0", timeout=60)
    assert end["oom"] is False and end["rc"] == 0
    assert link.request(op="log", key="11.0")["data"].endswith("8000000\n")


def test_a_podman_without_an_init_still_runs_jobs_and_the_node_says_so(
        node_factory, link_factory, lab, tmp_path):
    # Debian installs podman's catatonit only as a recommendation: without it `podman run
    # --init` fails every container with exit 125. The node says so, and runs jobs without it.
    node = node_factory("n1", gpus=2)
    etc = podman_config(node.dir / "podman", [lab["open"].address])
    with (etc / "containers.conf").open("a") as f:
        f.write('init_path = "/nonexistent/catatonit"\n')  # under [engine], the last section
    use_podman_config(node, etc)
    link = link_factory(node)
    hello = link.wait_up()
    assert hello["containers"]["runtime"] == "podman" and hello["containers"]["init"] is False
    assert "install the catatonit package" in hello["containers"]["init_note"]
    link.send(op="launch", key="1.0", job_id=1, user="bob", image=lab["image"],
              argv=["sh", "-c", "echo pid $$"])
    assert link.wait_for("exited", "1.0", timeout=60)["rc"] == 0
    assert link.request(op="log", key="1.0")["data"].splitlines()[-1] == "pid 1"


def test_podman_init_is_found_as_podman_finds_it(tmp_path):
    init = tmp_path / "catatonit"
    init.write_text("#!/bin/sh\n")
    init.chmod(0o755)
    conf = tmp_path / "containers.conf"
    conf.write_text(f'[engine]\ninit_path = "{init}"\n')
    assert containers.podman_init({"CONTAINERS_CONF": str(conf)}) == str(init)
    conf.write_text('[engine]\ninit_path = "/nonexistent/catatonit"\n')
    assert containers.podman_init({"CONTAINERS_CONF": str(conf)}) == ""
    argv = containers.run_argv("podman", image_id="i", name="n", argv=["true"], devices=[],
                               mounts=[], workdir="", env_file="e", uid=1, gid=1, groups=[],
                               init=False)
    assert "--init" not in argv and argv[-2:] == ["i", "true"]
