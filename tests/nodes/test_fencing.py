"""Each job in its own cgroup: only its GPUs, its memory, and nothing left behind when it ends.

Each test runs on a cgroup v1 node and on a pure cgroup v2 node (the node's view holds only the
unified hierarchy, as Ubuntu 22.04+ and RHEL 9 hosts do): v2 fences GPUs with an eBPF device
program and ends a job's processes with cgroup.kill and cgroup.freeze, on the real kernel."""

import os

import pytest

from tests.conftest import wait_for
from tests.nodes.conftest import job_pids

CGROUPS = pytest.mark.parametrize("cgroup", ["v1", "v2"])


def unified_controllers() -> set[str]:
    """The controllers this kernel offers to cgroup v2 (on a hybrid machine such as this one,
    those no v1 hierarchy holds)."""
    for root in ("/sys/fs/cgroup/unified", "/sys/fs/cgroup"):
        path = os.path.join(root, "cgroup.controllers")
        if os.path.exists(path):
            with open(path) as f:
                return set(f.read().split())
    return set()

OPEN_GPUS = """
import errno, os
for i in range(4):
    try:
        os.close(os.open(f"/dev/nvidia{i}", os.O_RDWR))
        print(i, "opened")
    except OSError as e:
        print(i, errno.errorcode[e.errno])
"""


def start_double_forking(node, link, key: str, user: str, child: str, job: str) -> None:
    """Launch job `key` as `user`: `sleep <job>`, and a `sleep <child>` that leaves the job's
    session and is orphaned (only its cgroup still knows it); return once both run."""
    link.send(op="launch", key=key, job_id=int(key.split(".")[0]), user=user,
              argv=["sh", "-c", f"(setsid sh -c 'sleep {child} &' &); exec sleep {job}"])
    link.wait_for("started", key)
    wait_for(lambda: job_pids(node, child) and job_pids(node, job), 10, what="both sleeps")


@CGROUPS
def test_a_job_opens_only_its_own_gpu(node_factory, link_factory, cgroup):
    node = node_factory(gpus=4, cgroup=cgroup)
    link = link_factory(node)
    link.wait_up()
    link.send(op="launch", key="1.0", job_id=1, user="alice", gpus=[1],
              argv=["python3", "-c", OPEN_GPUS])
    assert link.wait_for("exited", "1.0")["rc"] == 0
    # ENXIO: allowed, but no driver behind the fake device; EPERM: the devices cgroup (v1) or
    # the job cgroup's device program (v2) said no
    assert link.request(op="log", key="1.0")["data"].split("\n")[:4] == [
        "0 EPERM", "1 ENXIO", "2 EPERM", "3 EPERM"]


@CGROUPS
def test_a_job_over_its_memory_ends_out_of_memory(node_factory, link_factory, cgroup):
    if cgroup == "v2" and "memory" not in unified_controllers():
        pytest.skip("this kernel's memory controller is bound to a cgroup v1 hierarchy, so no "
                    "cgroup v2 memory limit can be set here (cgroup.controllers of the unified "
                    f"hierarchy: {' '.join(sorted(unified_controllers())) or 'none'})")
    node = node_factory(cgroup=cgroup)
    link = link_factory(node)
    link.wait_up()
    link.send(op="launch", key="2.0", job_id=2, user="bob", mem_mb=64,
              argv=["python3", "-c", "x = bytearray(512 * 2**20); print('survived')"])
    end = link.wait_for("exited", "2.0")
    assert end["oom"] is True and end["rc"] == 137
    assert "survived" not in link.request(op="log", key="2.0")["data"]
    link.send(op="launch", key="3.0", job_id=3, user="bob", mem_mb=256,
              argv=["python3", "-c", "x = bytearray(32 * 2**20); print('fits')"])
    end = link.wait_for("exited", "3.0")
    assert end["oom"] is False and end["rc"] == 0


@CGROUPS
def test_cancel_ends_every_process_even_a_double_forked_one(node_factory, link_factory, cgroup):
    node = node_factory(cgroup=cgroup)
    link = link_factory(node)
    link.wait_up()
    start_double_forking(node, link, "4.0", "alice", "401.5", "402.5")
    link.send(op="signal", key="4.0", sig="TERM")
    assert link.wait_for("exited", "4.0")["rc"] == 143
    wait_for(lambda: not job_pids(node, "401.5"), 5, what="the double-forked sleep to end")
    assert not job_pids(node, "402.5")


@CGROUPS
def test_a_job_that_ends_takes_what_it_left_running_with_it(node_factory, link_factory, cgroup):
    node = node_factory(cgroup=cgroup)
    link = link_factory(node)
    link.wait_up()
    link.send(op="launch", key="5.0", job_id=5, user="bob",
              argv=["sh", "-c", "setsid sleep 403.5 > /dev/null 2>&1 & exit 3"])
    assert link.wait_for("exited", "5.0")["rc"] == 3
    assert not job_pids(node, "403.5")


def test_a_cgroup_v2_node_says_which_fences_it_has_and_why_any_is_missing(node_factory, link_factory):
    node = node_factory(cgroup="v2")
    fencing = link_factory(node).wait_up()["fencing"]
    offered = unified_controllers()
    missing = [c for c in ("memory", "cpu", "pids") if c not in offered]
    assert fencing["cgroup"] == "v2" and fencing["devices"] is True
    assert {c: fencing[c] for c in ("memory", "cpu", "pids")} == {c: c in offered for c in ("memory", "cpu", "pids")}
    if missing:  # this machine: v1 holds them, and the node says so in words
        assert fencing["reason"].startswith(f"cgroup v2 without the {', '.join(missing)} controller(s)")
    else:
        assert fencing["reason"] == ""


def test_a_cgroup_v2_job_cgroup_holds_the_job_and_is_gone_after_it(node_factory, link_factory):
    node = node_factory(cgroup="v2")
    link = link_factory(node)
    link.wait_up()
    link.send(op="launch", key="6.0", job_id=6, user="alice", gpus=[0],
              argv=["sh", "-c", "cat /proc/self/cgroup; exec sleep 404.5"])
    link.wait_for("started", "6.0")
    wait_for(lambda: job_pids(node, "404.5"), 10, what="the job's sleep")
    # in the unified hierarchy, the job's own cgroup under trainyard/<node>
    lines = link.request(op="log", key="6.0")["data"].splitlines()
    assert f"0::/trainyard/{node.name}/6.0" in lines
    cgroup = f"/sys/fs/cgroup/unified/trainyard/{node.name}/6.0"
    if os.path.isdir("/sys/fs/cgroup/unified"):  # this machine's view of the same cgroup
        with open(os.path.join(cgroup, "cgroup.procs")) as f:
            assert set(job_pids(node, "404.5")) <= {int(p) for p in f.read().split()}
    link.send(op="signal", key="6.0", sig="KILL")
    assert link.wait_for("exited", "6.0")["rc"] == 137
    link.send(op="forget", keys=["6.0"])
    if os.path.isdir("/sys/fs/cgroup/unified"):
        wait_for(lambda: not os.path.exists(cgroup), 10, what="the job's cgroup to be removed")


def test_cgroup_v2_limits_are_written_in_the_kernels_units(tmp_path):
    """The memory, cpu and pids controllers are bound to v1 on this machine, so no kernel here
    takes v2 limits: this writes them into a directory laid out as a v2 hierarchy whose root
    offers them, and reads back what a kernel would have been given."""
    from scheduler import fencing

    (tmp_path / "cgroup.controllers").write_text("cpuset cpu io memory hugetlb pids rdma misc\n")
    (tmp_path / "cgroup.subtree_control").write_text("")
    f = fencing.Fencing("n1", enabled=False)
    f.version = "v2"
    f._set_up_v2(str(tmp_path))
    assert f.mode() == {"cgroup": "v2", "devices": True, "memory": True, "cpu": True, "pids": True,
                        "reason": ""}
    # each level hands the three controllers down to the job cgroups
    for level in (tmp_path, tmp_path / "trainyard", tmp_path / "trainyard" / "n1"):
        assert (level / "cgroup.subtree_control").read_text() == "+memory +cpu +pids"
    [path] = f.create("7.0", gpus=[], cpus=3, mem_mb=512)
    job = tmp_path / "trainyard" / "n1" / "7.0"
    assert path == str(job)
    assert (job / "memory.max").read_text() == str(512 * 2**20)
    assert (job / "cpu.max").read_text() == "300000 100000"  # 3 CPUs: quota per period, in µs
    assert (job / "pids.max").read_text() == str(fencing.DEFAULT_PIDS_MAX)
    assert fencing.oom_killed([path]) is False
    (job / "memory.events").write_text("low 0\nhigh 0\nmax 3\noom 1\noom_kill 1\n")
    assert fencing.oom_killed([path]) is True


def test_a_cgroup_v2_job_survives_its_agent_and_the_next_agent_still_ends_all_of_it(node_factory, link_factory):
    """The link goes and its agent with it; the job runs on in its cgroup. The next agent sets
    the node's cgroups up again over the running job's, and a cancel through it still reaches
    the job's double-forked child."""
    node = node_factory(cgroup="v2")
    first = link_factory(node)
    first.wait_up()
    start_double_forking(node, first, "8.0", "bob", "405.5", "406.5")
    first.close()
    second = link_factory(node)
    assert second.wait_up()["fencing"]["devices"] is True
    assert job_pids(node, "405.5") and job_pids(node, "406.5")  # it outlived the first agent
    second.send(op="signal", key="8.0", sig="TERM")
    wait_for(lambda: not job_pids(node, "405.5") and not job_pids(node, "406.5"), 10,
             what="every process of the job to end")
