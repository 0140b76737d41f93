"""Slurm's commands against a real trainyard daemon: sbatch --hold, squeue, scancel, sacct."""

from __future__ import annotations

import json
import subprocess
import sys

import click
import pytest

from scheduler.slurm import sacct_fields
from scheduler.slurm.api import job_refs, sacct_time, squeue_time
from scheduler.slurm.commands import format_of_fields, format_squeue

SCRIPT = """#!/bin/bash
#SBATCH --job-name=ddp-train
#SBATCH --nodes=1 --ntasks-per-node=2 --cpus-per-task=2
#SBATCH --time=10
#SBATCH --qos=high
echo hello
"""


def slurm(daemon, *args: str, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    env = {**daemon.env, "TRAINYARD_URL": daemon.url, "TRAINYARD_TOKEN": daemon.token, **(env_extra or {})}
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
    for since in ("now-1hours", "today", "midnight"):  # Slurm's relative and named times
        r = slurm(daemon, "sacct", "-S", since, "-P", "-n", "--format", "JobID,State")
        assert r.returncode == 0 and f"{job_id}|CANCELLED" in r.stdout.splitlines(), (since, r.stderr)
    r = slurm(daemon, "sacct", "-S", "yesterday-ish")
    assert r.returncode == 2 and "is not a time" in r.stderr


def test_sbatch_refuses_a_directive_slurm_rejects(daemon):
    script = daemon.base / "bad.sh"
    script.write_text("#!/bin/bash\n#SBATCH --nodes=NUM_NODES\nsrun hostname\n")
    r = slurm(daemon, "sbatch", str(script))
    assert r.returncode == 2
    assert "script line 2: #SBATCH --nodes=NUM_NODES" in r.stderr


def test_squeue_format_widths_and_justification():
    job = {"id": 7, "queue": "gpu", "name": "a-very-long-name", "user": "alice", "state": "RUNNING",
           "start_time": 100.0, "end_time": None, "nodes": 2, "allocation": [{"node": "n01"}, {"node": "n02"}]}
    assert format_squeue([job], "%.5i|%-4j|%t|%R|%M", False, now=165.0) == ["    7|a-ve|R|n[01-02]|1:05"]


def test_squeue_and_sacct_print_times_and_array_tasks_as_slurm_does():
    """Scripts parse these: squeue's TIME is M:SS until an hour, sacct's Elapsed and Timelimit
    are HH:MM:SS; an array task is ARRAY_TASK in squeue's %i and sacct's JobID."""
    assert [squeue_time(s) for s in (0, 65, 3600, 3661, 90061, None)] == [
        "0:00", "1:05", "1:00:00", "1:01:01", "1-01:01:01", "UNLIMITED"]
    assert [sacct_time(s) for s in (0, 65, 3661, 90061, None)] == [
        "00:00:00", "00:01:05", "01:01:01", "1-01:01:01", "UNLIMITED"]
    task = {"id": 9, "array_job_id": 5, "array_task_id": 4, "queue": "gpu", "name": "sweep", "user": "alice",
            "state": "PENDING", "time_limit": 600, "nodes": 1}
    plain = {**task, "id": 3, "array_job_id": None, "array_task_id": None}
    assert format_squeue([task, plain], "%i|%A|%F|%K|%l", True, now=0.0) == [
        "JOBID|JOBID|ARRAY_JOB_ID|ARRAY_TASK_ID|TIME_LIMIT", "5_4|9|5|4|10:00", "3|3|3|N/A|10:00"]
    fields = sacct_fields.resolve("JobID,JobIDRaw,Timelimit")
    assert sacct_fields.rows([task, plain], fields) == [["5_4", "9", "00:10:00"], ["3", "3", "00:10:00"]]


def test_sacct_fields_are_matched_named_and_laid_out_as_slurm_does():
    """Any prefix of a field's name names the first field it starts (case-insensitive), ALL every
    field, NAME%WIDTH a width; the header says the field's own name; the job ids are left-justified
    in 12 columns and the rest right-justified in Slurm's widths; a value too long ends in '+'."""
    assert [n for n, _ in sacct_fields.resolve("jobid,jobn,STATE,exit,alloccpu,elapsedr,nnod")] == [
        "JobID", "JobName", "State", "ExitCode", "AllocCPUS", "ElapsedRaw", "NNodes"]
    assert sacct_fields.resolve("JobName%30,maxrss") == [("JobName", 30), ("MaxRSS", 10)]
    assert len(sacct_fields.resolve("ALL")) == len(sacct_fields.FIELDS)
    for bad, shown in (("Bogus", "Bogus"), ("JobID,Stat3", "Stat3"), ("jobidx", "jobidx")):
        with pytest.raises(ValueError, match=f'Invalid field requested: "{shown}"'):
            sacct_fields.resolve(bad)
    job = {"id": 12, "name": "a-very-long-job-name", "queue": "gpu", "account": "ml", "state": "COMPLETED",
           "exit_code": 0, "user": "alice", "nodes": 2, "cpus": 4, "gpus": 2, "mem": 16384,
           "submit_time": 1000.0, "start_time": 1010.0, "end_time": 1135.0, "time_limit": 3600,
           "allocation": [{"node": "n01"}, {"node": "n02"}]}
    lines = sacct_fields.render([job], sacct_fields.resolve("JobID,JobName,AllocCPUS,State,Elapsed"))
    assert lines == ["JobID           JobName  AllocCPUS      State    Elapsed",
                     "------------ ---------- ---------- ---------- ----------",
                     "12           a-very-lo+          8  COMPLETED   00:02:05"]
    fields = sacct_fields.resolve("CPUTimeRAW,ElapsedRaw,TimelimitRaw,AllocTRES,ReqMem,NodeList,MaxRSS")
    assert sacct_fields.rows([job], fields) == [
        ["1000", "125", "60", "billing=8,cpu=8,gres/gpu=4,mem=32G,node=2", "16G", "n[01-02]", ""]]
    pending = {**job, "state": "PENDING", "start_time": None, "end_time": None, "exit_code": None}
    assert sacct_fields.rows([pending], sacct_fields.resolve("AllocCPUS,ReqCPUS,Start,Elapsed")) == [
        ["0", "8", "Unknown", "00:00:00"]]


def test_job_ids_are_read_as_slurm_writes_them():
    refs = job_refs("12, 34_5,7_[1-3,9],8.batch,40_2.0")
    assert refs.jobs == {12, 8} and refs.tasks == {(34, 5), (7, 1), (7, 2), (7, 3), (7, 9), (40, 2)}
    assert refs.ids() == [7, 8, 12, 34, 40]
    assert refs.wants({"id": 100, "array_job_id": 12, "array_task_id": 0})  # a task of array 12
    assert refs.wants({"id": 101, "array_job_id": 7, "array_task_id": 2})
    assert not refs.wants({"id": 102, "array_job_id": 7, "array_task_id": 4})
    assert list(job_refs(",".join(map(str, range(2500)))).pages()) == [
        ",".join(map(str, range(a, min(a + 1000, 2500)))) for a in (0, 1000, 2000)]
    for bad in ("x", "12;drop", "1_x", "1_[3-1]", "1_[0-999999]", ",", "-1"):
        with pytest.raises(click.BadParameter):
            job_refs(bad)


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
                                     f"{old}|ddp-train|CANCELLED|00:10:00|0"]  # never ran: no CPUs
    r = slurm(daemon, "sacct", "-j", str(old), "-P", "-n", "--format", "jobn,reqcpus,st")
    assert r.stdout.splitlines() == ["ddp-train|4|Unknown"]  # "st" is Start, the first field it begins
    r = slurm(daemon, "sacct", "-j", str(old), "--format", "JobID,Bogus")
    assert r.returncode == 1 and r.stderr.strip() == 'sacct: error: Invalid field requested: "Bogus"'
    assert r.stdout == ""
    r = slurm(daemon, "sacct", "-j", str(old), "-P", "-n", env_extra={"SACCT_FORMAT": "jobid,state"})
    assert r.stdout.splitlines() == [f"{old}|CANCELLED"]
    assert "MaxRSS" in slurm(daemon, "sacct", "-e").stdout
    r = slurm(daemon, "sacct", "-j", f"{array},{old}", "-P", "-n", "--format", "JobID,JobName,State")
    lines = r.stdout.splitlines()
    assert len(lines) == 5002 and lines[0] == f"{old}|ddp-train|CANCELLED"
    assert lines[1:] == [f"{array}_{k}|sweep|PENDING" for k in range(5001)]
    r = slurm(daemon, "sacct", "-j", f"{array}_7,{array}_[4999-5000]", "-P", "-n", "--format", "JobID,JobIDRaw")
    assert r.stdout.splitlines() == [f"{array}_7|{array + 7}", f"{array}_4999|{array + 4999}",
                                     f"{array}_5000|{array + 5000}"]
    r = slurm(daemon, "sacct", "-j", "x", "-n")
    assert r.returncode == 2 and "invalid job id 'x'" in r.stderr

    env = {**daemon.env, "TRAINYARD_URL": daemon.url, "TRAINYARD_TOKEN": daemon.token}

    def trainyard(*args):
        return subprocess.run([sys.executable, "-m", "scheduler.cli", *args], env=env, capture_output=True,
                              text=True, timeout=60, cwd=daemon.base)
    r = trainyard("sacct", "-j", str(old), "-P", "-o", "JobID,JobName,State")
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[1:] == [f"{old}|ddp-train|CANCELLED"]
    r = trainyard("sacct", "-j", f"{old},{array}", "--json")
    assert len(json.loads(r.stdout)) == 5002
    r = trainyard("sacct", "-j", f"{array}_[10-12]", "--json")
    assert [j["JobID"] for j in json.loads(r.stdout)] == [str(array + k) for k in (10, 11, 12)]
    r = trainyard("sacct", "-j", "12;drop")
    assert r.returncode == 2 and "invalid job id '12;drop'" in r.stderr
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
    r = squeue("-h", "-j", "999999")  # scripts loop `while squeue -j $ID`: an unknown id fails
    assert r.returncode == 1 and "Invalid job id specified" in r.stderr and r.stdout == ""
    r = squeue("-h", "-o", "%i", "-j", str(mine), "-t", "R")  # known, filtered out: nothing, no error
    assert r.returncode == 0 and r.stdout == ""
    r = squeue("-h", "-o", "%i", "-j", str(backlog))
    assert r.stdout.splitlines() == [f"{backlog}_{k}" for k in range(5001)]
    r = squeue("-h", "-o", "%i %A", "-j", f"{backlog}_7")  # Slurm's ARRAY_TASK: that task
    assert r.stdout.splitlines() == [f"{backlog}_7 {backlog + 7}"]
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


def test_scancel_of_an_array_task_cancels_that_task_and_of_an_array_every_task(daemon):
    """Slurm's scancel ARRAY_TASK ends one task, scancel ARRAY the array's unfinished tasks (a
    job's id alone still ends that job); a task that does not exist is an error, not the array."""
    c = daemon.client()
    array = c.submit({"command": ["true"], "array": "0-5", "hold": True, "name": "sweep"})["id"]
    other = c.submit({"command": ["true"], "hold": True})["id"]

    def states():
        return {j["id"] - array: j["state"] for j in c.jobs(all=True, ids=str(array))}
    assert slurm(daemon, "scancel", f"{array}_2").returncode == 0
    assert states() == {0: "PENDING", 1: "PENDING", 2: "CANCELLED", 3: "PENDING", 4: "PENDING", 5: "PENDING"}
    assert slurm(daemon, "scancel", f"{array}_[4-5]").returncode == 0
    assert sorted(k for k, st in states().items() if st == "CANCELLED") == [2, 4, 5]
    r = slurm(daemon, "scancel", f"{array}_9")
    assert r.returncode == 1 and f"job id {array}_9: Invalid job id specified" in r.stderr
    assert list(states().values()).count("PENDING") == 3
    assert slurm(daemon, "scancel", str(array)).returncode == 0
    assert set(states().values()) == {"CANCELLED"}
    assert c.job(other)["state"] == "PENDING"
    r = slurm(daemon, "scancel", "12;drop")
    assert r.returncode == 2 and "invalid job id '12;drop'" in r.stderr
    assert slurm(daemon, "scancel", str(other)).returncode == 0 and c.job(other)["state"] == "CANCELLED"
    r = slurm(daemon, "scancel", str(other))  # ended already: Slurm says so, and -Q keeps quiet
    assert r.returncode == 1 and f"Kill job error on job id {other}: job {other} is already CANCELLED" in r.stderr
    r = slurm(daemon, "scancel", "-Q", str(other))
    assert r.returncode == 0 and r.stderr == ""
    # a big array goes in one call (its tasks are one transaction), each task cancelled once
    big = c.submit({"command": ["true"], "array": "0-2499", "hold": True, "name": "big"})["id"]
    assert slurm(daemon, "scancel", str(big)).returncode == 0
    ended = [e for e in c.events(limit=10_000) if e["action"] == "job.cancel" and int(e["target"]) >= big]
    assert len(ended) == 2500 and len({e["target"] for e in ended}) == 2500
    assert {j["state"] for j in c.jobs(all=True, ids=str(big), limit=5000)} == {"CANCELLED"}


def test_scontrol_acts_on_the_array_task_it_is_given(daemon):
    """`scontrol hold ARRAY_TASK` holds that task, not the array's first; `release ARRAY` every
    held task; `show job ARRAY_TASK` shows that task."""
    c = daemon.client()
    array = c.submit({"command": ["true"], "array": "0-3", "name": "sweep"})["id"]

    def held():
        return sorted(j["id"] - array for j in c.jobs(all=True, ids=str(array)) if j["reason"].startswith("JobHeld"))
    assert slurm(daemon, "scontrol", "hold", f"{array}_3").returncode == 0
    assert held() == [3]
    assert slurm(daemon, "scontrol", "hold", f"{array}_[0-1]").returncode == 0
    assert held() == [0, 1, 3]
    r = slurm(daemon, "scontrol", "show", "job", f"{array}_1")
    assert r.stdout.startswith(f"JobId={array + 1} ") and f"ArrayJobId={array} ArrayTaskId=1" in r.stdout
    assert slurm(daemon, "scontrol", "release", str(array)).returncode == 0
    assert held() == []
    r = slurm(daemon, "scontrol", "hold", f"{array}_7")
    assert r.returncode == 1 and f"no task {array}_7" in r.stderr and held() == []
    assert slurm(daemon, "scancel", str(array)).returncode == 0


def test_scancel_by_user_name_and_state_cancels_what_the_filters_select(daemon):
    """`scancel -u $USER`, `scancel --me -n NAME`, `scancel -t PD` as scripts write them: only
    the live jobs the filters select; with ids, only those among them."""
    admin = daemon.client()
    bob = admin.create_token("bob", "user")["token"]
    eve = admin.create_token("eve", "user")["token"]
    c_bob, c_eve = daemon.client(bob), daemon.client(eve)
    a = c_bob.submit({"command": ["true"], "hold": True, "name": "prep"})["id"]
    b = c_bob.submit({"command": ["true"], "hold": True, "name": "train"})["id"]
    sweep = c_bob.submit({"command": ["true"], "hold": True, "name": "train", "array": "0-2"})["id"]
    e = c_eve.submit({"command": ["true"], "hold": True, "name": "train"})["id"]
    env = {**daemon.env, "TRAINYARD_URL": daemon.url, "TRAINYARD_TOKEN": bob}

    def scancel(*args):
        return subprocess.run([sys.executable, "-m", "scheduler.slurm.commands_main", "scancel", *args], env=env,
                              capture_output=True, text=True, timeout=60, cwd=daemon.base)

    def live():
        return sorted(j["id"] for j in admin.jobs() if j["state"] == "PENDING")
    r = scancel()
    assert r.returncode == 1 and "No job identification provided" in r.stderr and len(live()) == 6
    assert scancel("-s", "USR1", str(a)).returncode == 2 and len(live()) == 6
    r = scancel("--me", "-n", "train", str(b), str(e))  # e is eve's: not among bob's, left alone
    assert r.returncode == 0, r.stderr
    assert live() == [a, sweep, sweep + 1, sweep + 2, e]
    assert scancel("--me", "-n", "train", "-t", "PD").returncode == 0
    assert live() == [a, e]
    assert scancel("-u", "bob").returncode == 0
    assert live() == [e]
    r = scancel(str(b))  # already ended: an error, unless -Q
    assert r.returncode == 1 and f"job id {b}:" in r.stderr
    assert scancel("-Q", str(b)).returncode == 0
    r = scancel(str(e))  # eve's job: the daemon refuses bob
    assert r.returncode == 1 and f"job id {e}:" in r.stderr and live() == [e]


def test_squeue_long_field_names_start_and_sacct_brief_long_name_delimiter(daemon):
    """squeue -O (NAME[:[.]WIDTH]) and --start; sacct -b, -l, --name, -A, -r and --delimiter."""
    assert format_of_fields("JobID:8,Name:.10,StateCompact") == "%-8i%.10j%-20t"
    for bad in ("Nonsense", "JobID:wide", ""):
        with pytest.raises(click.BadParameter):
            format_of_fields(bad)
    c = daemon.client()
    a = c.submit({"command": ["true"], "hold": True, "name": "prep"})["id"]
    b = c.submit({"command": ["true"], "name": "train"})["id"]
    r = slurm(daemon, "squeue", "-O", "JobID:8,Name:.10,StateCompact:3")
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == ["JOBID         NAMEST", f"{a:<8}      prepPD", f"{b:<8}     trainPD"]
    assert slurm(daemon, "squeue", "-O", "JobID,Bogus").returncode == 2
    r = slurm(daemon, "squeue", "--start", "-h", "-o", "%i %t %S")
    assert r.stdout.splitlines() == [f"{a} PD N/A", f"{b} PD N/A"]  # no node: no start foreseen
    c._call("POST", f"/v1/jobs/{a}/cancel")
    c._call("POST", f"/v1/jobs/{b}/cancel")
    r = slurm(daemon, "sacct", "-j", f"{a},{b}", "-b", "-p", "-n", "--delimiter", ";")
    assert r.stdout.splitlines() == [f"{a};CANCELLED;0:0;", f"{b};CANCELLED;0:0;"]
    r = slurm(daemon, "sacct", "-j", f"{a},{b}", "--name", "train", "-P", "-n", "-o", "JobName")
    assert r.stdout.splitlines() == ["train"]
    r = slurm(daemon, "sacct", "-j", f"{a},{b}", "-r", "nowhere", "-A", "x", "-P", "-n")
    assert r.returncode == 0 and r.stdout == ""
    header = slurm(daemon, "sacct", "-j", str(a), "-l", "-P").stdout.splitlines()[0]
    assert header.startswith("JobID|JobIDRaw|JobName|") and "Elapsed|Timelimit" in header
