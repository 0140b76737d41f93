"""sinfo, scontrol, sacct and squeue's filters against a real daemon with two real sshd nodes."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.conftest import DaemonProc, SshdNode, add_sshd_node, wait_for, wait_job

CONFIG = """
[queues.gpu]
aliases = ["defq"]
max_time = "1d"
"""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    base = tmp_path_factory.mktemp("slurmcmds")
    d = DaemonProc(base, extra_config=CONFIG).start()
    d.submit_dir = submit_dir()
    nodes = []
    try:
        for name in ("gpu-01", "gpu-02"):
            n = SshdNode(base, name, d.public_key)
            n.start()
            nodes.append(n)
            add_sshd_node(d, n, gpus=2, labels={"a100": ""})
        yield d
    finally:
        for n in nodes:
            n.stop()
        d.stop()


def submit_dir() -> Path:
    """A directory every job account can write its slurm-%j.out into (as root, jobs run as another)."""
    root = Path("/var/tmp/trainyard-tests")
    root.mkdir(mode=0o711, exist_ok=True)
    d = Path(tempfile.mkdtemp(prefix="slurmcmds-", dir=root))
    os.chmod(d, 0o1777)
    return d


def slurm(d: DaemonProc, *args: str) -> subprocess.CompletedProcess:
    env = {**d.env, "TRAINYARD_URL": d.url, "TRAINYARD_TOKEN": d.token}
    return subprocess.run([sys.executable, "-m", "scheduler.slurm.commands_main", *args], env=env,
                          capture_output=True, text=True, timeout=60, cwd=d.submit_dir)


def submit(d: DaemonProc, *args: str, script: str = "#!/bin/sh\nsleep 60\n") -> int:
    path = d.submit_dir / f"job-{time.monotonic_ns()}.sh"
    path.write_text(script)
    r = slurm(d, "sbatch", "--parsable", *args, str(path))
    assert r.returncode == 0, r.stderr
    return int(r.stdout.strip())


def test_sinfo_shows_partitions_and_node_states_as_they_change(cluster):
    d = cluster
    r = slurm(d, "sinfo")
    assert r.returncode == 0, r.stderr
    lines = [line.split() for line in r.stdout.splitlines()]
    assert lines[0] == ["PARTITION", "AVAIL", "TIMELIMIT", "NODES", "STATE", "NODELIST"]
    assert ["default*", "up", "infinite", "2", "idle", "gpu-[01-02]"] in lines
    assert ["gpu", "up", "1-00:00:00", "2", "idle", "gpu-[01-02]"] in lines

    c = d.client()
    whole = submit(d, "-p", "defq", "-w", "gpu-01", "--gres=gpu:2")
    half = submit(d, "-w", "gpu-02", "--gres=gpu:1")
    for job_id in (whole, half):
        j = wait_job(c, job_id, ("RUNNING", "FAILED", "CANCELLED"), timeout=30)
        assert j["state"] == "RUNNING", j
    wait_for(lambda: c.node("gpu-01")["gpus_used"] == 2 and c.node("gpu-02")["gpus_used"] == 1, 20)
    r = slurm(d, "sinfo", "-N", "-p", "gpu", "-h")
    assert [line.split() for line in r.stdout.splitlines()] == [
        ["gpu-01", "1", "gpu", "alloc"], ["gpu-02", "1", "gpu", "mix"]]
    assert slurm(d, "sinfo", "-h", "-o", "%P %T %D", "-t", "mix").stdout.splitlines() == [
        "default* mixed 1", "gpu mixed 1"]

    c.drain_node("gpu-02", "bad fan")
    r = slurm(d, "sinfo", "--Node", "-p", "gpu", "-o", "%N %t %E")
    assert r.stdout.splitlines() == ["NODELIST STATE REASON", "gpu-01 alloc none", "gpu-02 drng bad fan"]
    for job_id in (whole, half):
        c.cancel(job_id)
        wait_job(c, job_id, "CANCELLED", timeout=30)
    wait_for(lambda: slurm(d, "sinfo", "-N", "-h", "-p", "gpu").stdout.split() ==
             ["gpu-01", "1", "gpu", "idle", "gpu-02", "1", "gpu", "drain"], 20, what="idle and drain")
    c.resume_node("gpu-02")


def test_sinfo_names_the_partitions_it_knows(cluster):
    r = slurm(cluster, "sinfo", "-p", "nope")
    assert r.returncode == 1
    assert "invalid partition name 'nope'" in r.stderr and "default, defq, gpu" in r.stderr  # defq: an alias


def test_scontrol_hold_release_update_and_show(cluster):
    d = cluster
    job_id = submit(d, "--hold", "-J", "held-one", "--time=90")
    r = slurm(d, "scontrol", "show", "job", str(job_id))
    assert r.returncode == 0, r.stderr
    assert f"JobId={job_id} JobName=held-one" in r.stdout
    assert "JobState=PENDING Reason=JobHeldUser" in r.stdout and "TimeLimit=1:30:00" in r.stdout

    assert slurm(d, "scontrol", "update", f"JobId={job_id}", "Priority=-5").returncode == 0
    assert "Priority=-5 " in slurm(d, "scontrol", "show", "job", str(job_id)).stdout
    r = slurm(d, "scontrol", "update", f"JobId={job_id}", "TimeLimit=2:00:00")  # an admin raises
    assert r.returncode == 0, r.stderr
    assert "TimeLimit=2:00:00" in slurm(d, "scontrol", "show", "job", str(job_id)).stdout
    assert slurm(d, "scontrol", "update", f"JobId={job_id}", "TimeLimit=-45").returncode == 0
    assert "TimeLimit=1:15:00" in slurm(d, "scontrol", "show", "job", str(job_id)).stdout

    assert slurm(d, "scontrol", "release", str(job_id)).returncode == 0
    c = d.client()
    attempt = wait_job(c, job_id, "RUNNING", timeout=30)["attempt"]
    assert slurm(d, "scontrol", "requeue", str(job_id)).returncode == 0
    wait_for(lambda: c.job(job_id)["attempt"] > attempt, 20, what="a new attempt after requeue")
    slurm(d, "scancel", str(job_id))

    r = slurm(d, "scontrol", "show", "node", "gpu-01")
    assert r.stdout.startswith("NodeName=gpu-01 ") and "AvailableFeatures=a100" in r.stdout
    assert slurm(d, "scontrol", "show", "hostnames", "gpu-[01-02]").stdout == "gpu-01\ngpu-02\n"
    r = slurm(d, "scontrol", "hold", "abc")
    assert r.returncode == 2 and "Invalid job id specified: invalid job id 'abc'" in r.stderr
    r = slurm(d, "scontrol", "show", "partition", "gpu")
    assert r.stdout.startswith("PartitionName=gpu\n") and "MaxTime=1-00:00:00" in r.stdout


def test_sacct_reads_the_accounting_window(cluster):
    d = cluster
    job_id = submit(d, "-J", "short", script="#!/bin/sh\nexit 3\n")
    wait_job(d.client(), job_id, "FAILED", timeout=30)
    r = slurm(d, "sacct", "-P", "--format", "JobID,JobName,State,ExitCode,NNodes", "-s", "F")
    assert r.returncode == 0, r.stderr
    assert f"{job_id}|short|FAILED|3:0|1" in r.stdout.splitlines()
    tomorrow = time.strftime("%Y-%m-%d", time.localtime(time.time() + 86400))
    r = slurm(d, "sacct", "-P", "-n", "-S", tomorrow, "-E", tomorrow + "T01:00")
    assert r.returncode == 0 and r.stdout == ""


def test_squeue_filters_by_name_nodelist_and_sorts(cluster):
    d = cluster
    a = submit(d, "--hold", "-J", "alpha", "-p", "gpu")
    b = submit(d, "--hold", "-J", "beta")
    r = slurm(d, "squeue", "-h", "-o", "%i %j %P", "-n", "alpha,beta", "-S", "-i")
    assert r.stdout.splitlines() == [f"{b} beta default", f"{a} alpha gpu"]
    assert slurm(d, "squeue", "-h", "-o", "%j", "-p", "gpu").stdout.split() == ["alpha"]
    assert slurm(d, "squeue", "-h", "-w", "gpu-01").stdout == ""
    r = slurm(d, "squeue", "-l", "-j", str(a))
    assert r.stdout.splitlines()[0].split()[4:6] == ["STATE", "TIME"]
    for job_id in (a, b):
        slurm(d, "scancel", str(job_id))


def test_node_states_in_slurm_words():
    from scheduler.slurm.sinfo import node_state

    def node(state, used=0, connected=True):
        return {"name": "n1", "state": state, "gpus_total": 4, "gpus_used": used, "connected": connected}

    assert [node_state(node("UP"), set()), node_state(node("UP", 2), {"n1"}), node_state(node("UP", 4), {"n1"}),
            node_state(node("DRAINING", 1), {"n1"}), node_state(node("DRAINING"), set()),
            node_state(node("DRAINED"), set()), node_state(node("DOWN"), set()),
            node_state(node("UP", connected=False), set()), node_state(node("BOOTSTRAPPING"), set())] == [
        "idle", "mix", "alloc", "drng", "drain", "drain", "down", "down", "boot"]
    cpu_only = {"name": "c1", "state": "UP", "gpus_total": 0, "gpus_used": 0}
    assert node_state(cpu_only, {"c1"}) == "mix"
