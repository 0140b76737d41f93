"""Jobs on real sshd nodes, through the daemon's API and CLI, as a user sees them."""

import contextlib
import json
import time

import pytest

from scheduler.client import ApiError
from tests.conftest import wait_for, wait_job


@pytest.fixture
def c(shared_cluster):
    d, _ = shared_cluster
    client = d.client()
    yield client
    # leave the nodes idle for the next test
    for j in client.jobs():
        with contextlib.suppress(ApiError):  # it may have ended meanwhile
            client.cancel(j["id"])
    wait_for(lambda: not client.jobs(), 15, what="cluster idle")


def test_job_sees_exactly_its_allocated_gpus(c):
    job = c.submit({"command": ["sh", "-c", "echo CVD=$CUDA_VISIBLE_DEVICES JOB=$TRAINYARD_JOB_ID"], "gpus": 2})
    done = wait_job(c, job["id"], "COMPLETED")
    (alloc,) = done["allocation"]
    assert len(alloc["gpus"]) == 2
    text, _ = c.log(job["id"])
    assert text.strip() == f"CVD={','.join(map(str, alloc['gpus']))} JOB={job['id']}"


def test_concurrent_jobs_never_share_a_gpu(c):
    ids = [c.submit({"command": ["sleep", "3"], "gpus": 1})["id"] for _ in range(8)]
    running = wait_for(lambda: len(rs := [j for j in c.jobs() if j["state"] == "RUNNING"]) == 8 and rs, 15,
                       what="8 jobs running")
    held = [(a["node"], g) for j in running for a in j["allocation"] for g in a["gpus"]]
    assert len(held) == len(set(held)) == 8
    extra = c.submit({"command": ["true"], "gpus": 1})
    waiting = wait_for(lambda: (j := c.job(extra["id"]))["reason"] and j, 10, what="a pending reason")
    assert (waiting["state"], waiting["reason"]) == ("PENDING", "Resources")
    for i in ids:
        c.cancel(i)


def test_multi_node_job_starts_together_with_torchrun_variables(c):
    job = c.submit({"command": ["sh", "-c", "echo $MASTER_ADDR $MASTER_PORT $WORLD_SIZE $NNODES $NODE_RANK"],
                    "nodes": 2, "gpus": 4})
    done = wait_job(c, job["id"], "COMPLETED")
    assert sorted(a["node"] for a in done["allocation"]) == ["n1", "n2"]
    lines = [c.log(job["id"], rank=r)[0].split() for r in (0, 1)]
    assert lines[0][0] == lines[1][0] == "127.0.0.1"
    assert lines[0][1] == lines[1][1]  # one rendezvous port for all ranks
    assert [ln[2:] for ln in lines] == [["2", "2", "0"], ["2", "2", "1"]]


def test_failing_job_reports_its_exit_code_and_retries(c):
    job = c.submit({"command": ["sh", "-c", "exit 3"], "retries": 2})
    done = wait_job(c, job["id"], "FAILED")
    assert done["exit_code"] == 3
    assert done["failures"] == 2 and done["attempt"] == 2
    events = [e for e in c.events(limit=500) if e["target"] == str(job["id"]) and e["action"] == "job.state"]
    assert [e["detail"]["state"] for e in events].count("FAILED") == 3


def test_time_limit_ends_the_job_as_timeout(c):
    job = c.submit({"command": ["sleep", "60"], "time_limit": 2})
    done = wait_job(c, job["id"], "TIMEOUT", timeout=20)
    assert done["end_time"] - done["start_time"] < 10


def test_cancel_running_job(c):
    job = c.submit({"command": ["sleep", "60"], "gpus": 1})
    wait_job(c, job["id"], "RUNNING")
    c.cancel(job["id"])
    assert wait_job(c, job["id"], "CANCELLED")["exit_code"] == 143


def test_hold_release_and_requeue(c):
    job = c.submit({"command": ["true"], "hold": True})
    held = c.job(job["id"])
    assert (held["state"], held["reason"]) == ("PENDING", "JobHeldUser")
    time.sleep(0.5)
    held = c.job(job["id"])
    assert (held["state"], held["reason"]) == ("PENDING", "JobHeldUser")
    c.release(job["id"])
    wait_job(c, job["id"], "COMPLETED")
    c.requeue(job["id"])
    again = wait_job(c, job["id"], "COMPLETED")
    assert again["attempt"] == 1 and again["failures"] == 0


def test_higher_priority_starts_first_when_the_cluster_frees_up(c):
    blocker = c.submit({"command": ["sleep", "2"], "gpus": 4, "nodes": 2})
    wait_job(c, blocker["id"], "RUNNING")
    low = c.submit({"command": ["sleep", "5"], "gpus": 4, "nodes": 2})
    high = c.submit({"command": ["sleep", "5"], "gpus": 4, "nodes": 2, "priority": 10})
    assert wait_for(lambda: c.job(low["id"])["reason"], 10, what="a pending reason") in ("Priority", "Resources")
    wait_job(c, high["id"], "RUNNING", timeout=15)
    assert c.job(low["id"])["state"] == "PENDING"


def test_dependency_waits_then_runs(c):
    first = c.submit({"command": ["sleep", "1"]})
    second = c.submit({"command": ["true"], "after": first["id"]})
    assert wait_for(lambda: c.job(second["id"])["reason"], 10, what="a pending reason") == "Dependency"
    wait_job(c, second["id"], "COMPLETED")


def test_cli_submit_jobs_logs_follow(shared_cluster, c):
    d, _ = shared_cluster
    r = d.cli("submit", "--json", "--gpus", "1", "--", "sh", "-c", "for i in 1 2 3; do echo line$i; sleep 0.3; done",
              check=True)
    job = json.loads(r.stdout)
    assert {"id", "name", "user", "queue", "state", "reason", "gpus", "nodes", "submit_time", "start_time",
            "end_time", "exit_code", "allocation"} <= job.keys()
    out = d.cli("logs", str(job["id"]), "--follow", check=True).stdout
    assert out == "line1\nline2\nline3\n"
    listing = d.cli("jobs", "--all", check=True).stdout
    assert f"{job['id']} " in listing and "COMPLETED" in listing
    logged = json.loads(d.cli("logs", str(job["id"]), "--json", check=True).stdout)
    assert logged["data"] == "line1\nline2\nline3\n" and logged["state"] == "COMPLETED"
    shown = json.loads(d.cli("job", str(job["id"]), "--json", check=True).stdout)
    assert shown["state"] == "COMPLETED" and shown["exit_code"] == 0


def test_sbatch_script_directives_apply(shared_cluster, c, tmp_path):
    d, _ = shared_cluster
    script = tmp_path / "train.sh"
    script.write_text("#!/bin/sh\n#SBATCH --job-name=tiny\n#SBATCH --gpus=3\necho gpus=$CUDA_VISIBLE_DEVICES\n")
    job = json.loads(d.cli("submit", "--json", str(script), check=True).stdout)
    assert job["name"] == "tiny" and job["gpus"] == 3
    wait_job(c, job["id"], "COMPLETED")
    assert c.log(job["id"])[0].count(",") == 2


def test_constraint_places_the_job_on_matching_nodes(shared_cluster, c):
    d, _ = shared_cluster
    job = json.loads(d.cli("submit", "--json", "--constraint", "rack=nowhere", "--", "true", check=True).stdout)
    assert job["constraint"] == {"rack": "nowhere"}
    reason = wait_for(lambda: c.job(job["id"])["reason"], 10, what="a pending reason")
    assert reason == "BadConstraints"
    shown = d.cli("job", str(job["id"]), check=True).stdout  # the reason, and why in words
    assert "Reason: BadConstraints (no 1 schedulable node(s) with 0 GPUs match queue default's nodes, " \
           "--gpu-type and --constraint)" in " ".join(shown.split())
    c.cancel(job["id"])
    assert c.job(job["id"])["reason_detail"] is None  # words only while it waits


def test_more_gpus_than_any_node_is_refused_and_nothing_is_queued(shared_cluster, c):
    d, _ = shared_cluster
    before = len(c.jobs(all=True))
    r = d.cli("submit", "--gpus", "16", "--", "true")
    assert r.returncode == 1
    assert "16 GPUs per node is more than any node has (largest: 4" in r.stderr
    r = d.cli("submit", "--gpus", "4", "--nodes", "3", "--", "true")
    assert r.returncode == 1 and "only 2 such nodes" in r.stderr
    assert len(c.jobs(all=True)) == before
