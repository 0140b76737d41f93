"""`scontrol update TimeLimit=` and PATCH /v1/jobs/{id}: Slurm's rules for changing a job's time
limit, against a real daemon with a real sshd node."""

from __future__ import annotations

import subprocess
import sys

import pytest

from scheduler.client import ApiError
from tests.conftest import DaemonProc, SshdNode, add_sshd_node, wait_job


@pytest.fixture(scope="module")
def limits(tmp_path_factory):
    base = tmp_path_factory.mktemp("timelimit")
    d = DaemonProc(base).start()
    node = SshdNode(base, "tl-01", d.public_key)
    try:
        node.start()
        add_sshd_node(d, node, gpus=2)
        d.bob = d.cli("token", "create", "bob", "--role", "user", check=True).stdout.strip()
        yield d
    finally:
        node.stop()
        d.stop()


def scontrol(d: DaemonProc, *args: str, token: str) -> subprocess.CompletedProcess:
    env = {**d.env, "TRAINYARD_URL": d.url, "TRAINYARD_TOKEN": token}
    return subprocess.run([sys.executable, "-m", "scheduler.slurm.commands_main", "scontrol", *args],
                          env=env, capture_output=True, text=True, timeout=60)


def bob_submits(d: DaemonProc, time_limit: str, hold: bool = True) -> int:
    job = d.client(d.bob).submit({"command": ["sleep", "600"], "time_limit": time_limit, "hold": hold})
    return job["id"]


def test_the_owner_lowers_a_limit_with_slurm_time_formats(limits):
    d = limits
    job_id = bob_submits(d, "2:00:00")
    r = scontrol(d, "update", f"JobId={job_id}", "TimeLimit=1-00:00:00", token=d.bob)
    assert r.returncode == 1
    assert "raising job" in r.stderr and "needs the operator role" in r.stderr and "bob is user" in r.stderr
    assert d.client(d.bob).job(job_id)["time_limit"] == 7200

    r = scontrol(d, "update", f"JobId={job_id}", "TimeLimit=90", token=d.bob)  # minutes
    assert r.returncode == 0, r.stderr
    assert d.client(d.bob).job(job_id)["time_limit"] == 5400
    r = scontrol(d, "update", f"JobId={job_id}", "TimeLimit=-29:30", token=d.bob)  # rounded up: 30 min
    assert r.returncode == 0, r.stderr
    assert d.client(d.bob).job(job_id)["time_limit"] == 3600
    r = scontrol(d, "update", f"JobId={job_id}", "TimeLimit=+1", token=d.bob)
    assert r.returncode == 1 and "needs the operator role" in r.stderr
    r = scontrol(d, "update", f"JobId={job_id}", "TimeLimit=soon", token=d.bob)
    assert r.returncode == 2 and "Invalid time limit specified TimeLimit='soon'" in r.stderr


def test_only_an_operator_raises_a_limit_or_makes_it_unlimited(limits):
    d = limits
    job_id = bob_submits(d, "30:00")
    with pytest.raises(ApiError) as e:
        d.client(d.bob)._call("PATCH", f"/v1/jobs/{job_id}", json={"time_limit": "UNLIMITED"})
    assert e.value.status == 403 and "users may only lower a limit" in e.value.detail

    r = scontrol(d, "update", f"JobId={job_id}", "TimeLimit=+1:00:00", token=d.token)  # alice: admin
    assert r.returncode == 0, r.stderr
    assert d.client().job(job_id)["time_limit"] == 5400
    r = scontrol(d, "update", f"JobId={job_id}", "TimeLimit=UNLIMITED", token=d.token)
    assert r.returncode == 0, r.stderr
    assert "TimeLimit=UNLIMITED" in scontrol(d, "show", "job", str(job_id), token=d.bob).stdout
    changes = [(e["actor"], e["detail"]["from"], e["detail"]["to"])
               for e in d.client()._call("GET", "/v1/events", params={"limit": 1000})
               if e["action"] == "job.time_limit" and e["target"] == str(job_id)]
    assert changes == [("alice", 1800, 5400), ("alice", 5400, None)]


def test_someone_elses_job_and_a_finished_job_are_refused(limits):
    d = limits
    job_id = bob_submits(d, "30:00")
    carol = d.cli("token", "create", "carol", "--role", "user", check=True).stdout.strip()
    r = scontrol(d, "update", f"JobId={job_id}", "TimeLimit=10", token=carol)
    assert r.returncode == 1 and f"job {job_id} belongs to bob" in r.stderr

    d.client(d.bob).cancel(job_id)
    r = scontrol(d, "update", f"JobId={job_id}", "TimeLimit=10", token=d.bob)
    assert r.returncode == 1
    assert f"job {job_id} is CANCELLED; only a pending or running job's time limit can change" in r.stderr


def test_a_running_job_times_out_at_its_lowered_limit(limits):
    d = limits
    bob = d.client(d.bob)
    job_id = bob_submits(d, "1:00:00", hold=False)
    wait_job(bob, job_id, "RUNNING", timeout=30)
    bob._call("PATCH", f"/v1/jobs/{job_id}", json={"time_limit": 2})  # seconds, through the API
    job = wait_job(bob, job_id, ("TIMEOUT", "COMPLETED", "FAILED", "CANCELLED"), timeout=30)
    assert job["state"] == "TIMEOUT"
    assert job["reason"] == "time limit 2s reached"
    assert job["time_limit"] == 2
