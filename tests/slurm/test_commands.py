"""Slurm's commands against a real trainyard daemon: sbatch --hold, squeue, scancel, sacct."""

from __future__ import annotations

import json
import subprocess
import sys

from scheduler.slurm.commands import format_squeue

SCRIPT = """#!/bin/bash
#SBATCH --job-name=ddp-train
#SBATCH --nodes=1 --ntasks-per-node=2 --cpus-per-task=2
#SBATCH --time=10
#SBATCH --qos=high
echo hello
"""


def slurm(daemon, *args: str) -> subprocess.CompletedProcess:
    env = {**daemon.env, "TRAINYARD_URL": daemon.url, "TRAINYARD_TOKEN": daemon.token}
    return subprocess.run([sys.executable, "-m", "scheduler.slurm.commands_main", *args], env=env,
                          capture_output=True, text=True, timeout=60, cwd=daemon.base)


def test_sbatch_hold_then_squeue_scancel_and_sacct(daemon):
    script = daemon.base / "train.sh"
    script.write_text(SCRIPT)
    r = slurm(daemon, "sbatch", "--hold", "--parsable", str(script))
    assert r.returncode == 0, r.stderr
    job_id = int(r.stdout.strip())
    assert "recorded but not acted on by trainyard: --qos" in r.stderr

    r = slurm(daemon, "squeue")
    header, row = r.stdout.splitlines()
    assert header.split() == ["JOBID", "PARTITION", "NAME", "USER", "ST", "TIME", "NODES", "NODELIST(REASON)"]
    fields = row.split()
    assert fields[0] == str(job_id) and fields[2] == "ddp-trai" and fields[4] == "PD"
    assert fields[-1].startswith("(JobHeld")

    r = slurm(daemon, "squeue", "--noheader", "-t", "R")
    assert r.stdout == ""

    assert slurm(daemon, "scancel", str(job_id)).returncode == 0
    r = slurm(daemon, "sacct", "-j", str(job_id), "--parsable2", "--format", "JobID,JobName,State")
    assert r.stdout.splitlines() == ["JobID|JobName|State", f"{job_id}|ddp-train|CANCELLED"]


def test_sbatch_refuses_a_directive_slurm_rejects(daemon):
    script = daemon.base / "bad.sh"
    script.write_text("#!/bin/bash\n#SBATCH --nodes=NUM_NODES\nsrun hostname\n")
    r = slurm(daemon, "sbatch", str(script))
    assert r.returncode == 2
    assert "script line 2: #SBATCH --nodes=NUM_NODES" in r.stderr


def test_squeue_format_widths_and_justification():
    job = {"id": 7, "queue": "gpu", "name": "a-very-long-name", "user": "alice", "state": "RUNNING",
           "start_time": 100.0, "end_time": None, "nodes": 2, "allocation": [{"node": "n01"}, {"node": "n02"}]}
    assert format_squeue([job], "%.5i|%-4j|%t|%R|%M", False, now=165.0) == ["    7|a-ve|R|n[01-02]|0:01:05"]


def test_sacct_j_finds_a_job_of_any_age_and_an_arrays_tasks(daemon):
    """`sacct -j $JOB` after the job ended is how pipelines check a job's outcome; on a busy
    cluster thousands of jobs come after it, and it must still be found, with what it asked for."""
    script = daemon.base / "train.sh"
    script.write_text(SCRIPT)
    r = slurm(daemon, "sbatch", "--hold", "--parsable", str(script))
    assert r.returncode == 0, r.stderr
    old = int(r.stdout.strip())
    assert slurm(daemon, "scancel", str(old)).returncode == 0
    c = daemon.client()
    array = c.submit({"command": ["true"], "array": "0-5000", "hold": True, "name": "sweep"})["id"]

    r = slurm(daemon, "sacct", "-j", str(old), "-P", "--format", "JobID,JobName,State,Timelimit,AllocCPUS")
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == ["JobID|JobName|State|Timelimit|AllocCPUS",
                                     f"{old}|ddp-train|CANCELLED|0:10:00|4"]
    r = slurm(daemon, "sacct", "-j", f"{array},{old}", "-P", "-n", "--format", "JobID,JobName,State")
    lines = r.stdout.splitlines()
    assert len(lines) == 5002 and lines[0] == f"{old}|ddp-train|CANCELLED"
    assert lines[1] == f"{array}|sweep|PENDING" and all(x.endswith("|sweep|PENDING") for x in lines[1:])
    assert slurm(daemon, "sacct", "-j", "x", "-n").returncode == 2  # no job id in it

    env = {**daemon.env, "TRAINYARD_URL": daemon.url, "TRAINYARD_TOKEN": daemon.token}

    def trainyard(*args):
        return subprocess.run([sys.executable, "-m", "scheduler.cli", *args], env=env, capture_output=True,
                              text=True, timeout=60, cwd=daemon.base)
    r = trainyard("sacct", "-j", str(old), "-P", "-o", "JobID,JobName,State")
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[1:] == [f"{old}|ddp-train|CANCELLED"]
    r = trainyard("sacct", "-j", f"{old},{array}", "--json")
    assert len(json.loads(r.stdout)) == 5002
    r = trainyard("sacct", "-j", "12;drop")
    assert r.returncode != 0 and "--jobs: job ids are numbers" in r.stderr
    c._call("POST", f"/v1/jobs/{array}/cancel")


def test_squeue_and_jobs_find_a_users_jobs_behind_a_backlog_longer_than_a_page(daemon):
    """A busy cluster has more jobs waiting than one page (5,000); `squeue --me`, `squeue -u`,
    `squeue -j` and `-t` ask the daemon for what they show instead of filtering its first page."""
    admin = daemon.client()
    backlog = admin.submit({"command": ["true"], "array": "0-5000", "hold": True, "name": "backlog"})["id"]
    bob = admin.create_token("bob", "user")["token"]
    mine = daemon.client(bob).submit({"command": ["true"], "hold": True, "name": "mine"})["id"]
    env_bob = {**daemon.env, "TRAINYARD_URL": daemon.url, "TRAINYARD_TOKEN": bob}

    def squeue(*args, env=None):
        return subprocess.run([sys.executable, "-m", "scheduler.slurm.commands_main", "squeue", *args],
                              env=env or {**daemon.env, "TRAINYARD_URL": daemon.url, "TRAINYARD_TOKEN": daemon.token},
                              capture_output=True, text=True, timeout=60, cwd=daemon.base)
    for args, env in ((("--me",), env_bob), (("-u", "bob"), None), (("-j", str(mine)), None),
                      (("-t", "PD", "-u", "bob"), None)):
        r = squeue("-h", "-o", "%i %j %u", *args, env=env)
        assert r.returncode == 0, r.stderr
        assert r.stdout.splitlines() == [f"{mine} mine bob"], args
    r = squeue("-h", "-o", "%i", "-j", str(backlog))
    assert len(r.stdout.splitlines()) == 5001
    r = squeue("-h", "-o", "%i", "-j", f"{backlog}_7")  # Slurm's ARRAY_TASK: its array here
    assert len(r.stdout.splitlines()) == 5001
    assert squeue("-j", "x").returncode == 2
    r = squeue("-h", "-o", "%i")
    assert len(r.stdout.splitlines()) == 5002 and r.stderr == ""

    r = daemon.cli("jobs")
    assert r.returncode == 0
    assert "the first 5,000 jobs only" in r.stderr and f"{mine} " not in r.stdout
    r = daemon.cli("jobs", "--limit", "6000")
    assert r.stderr == "" and f"{mine} " in r.stdout
    admin._call("POST", f"/v1/jobs/{backlog}/cancel")


def test_the_commands_know_the_daemons_states():
    """The Slurm commands keep their own list (importing the models would double their start-up)."""
    from scheduler.models import JOB_STATES
    from scheduler.slurm.api import DAEMON_STATES

    assert set(JOB_STATES) == DAEMON_STATES
