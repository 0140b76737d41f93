"""What a job sees on its node: hostlists, output file names, SLURM_* variables, srun, scontrol."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from scheduler.slurm.environment import JobContext, job_environment, task_environment
from scheduler.slurm.hostlist import HostlistError, compress, expand
from scheduler.slurm.layout import format_tasks_per_node, parse_tasks_per_node, tasks_per_node
from scheduler.slurm.patterns import NO_ARRAY_TASK, PatternContext
from scheduler.slurm.patterns import expand as expand_pattern

SHIMS = Path(__file__).resolve().parents[2] / "scheduler" / "slurm" / "shims"


def test_hostlist_expands_ranges_lists_and_padding():
    assert expand("gpu-[01-04,07],cpu1") == ["gpu-01", "gpu-02", "gpu-03", "gpu-04", "gpu-07", "cpu1"]
    assert expand("r[1-2]-n[1-2]") == ["r1-n1", "r1-n2", "r2-n1", "r2-n2"]


def test_hostlist_compresses_back_in_order():
    assert compress(["gpu-02", "gpu-01", "gpu-04", "cpu1"]) == "cpu1,gpu-[01-02,04]"
    assert compress(["n09", "n10", "n11"]) == "n[09-11]"
    assert compress(expand("gpu-[01-04,07],cpu1")) == "cpu1,gpu-[01-04,07]"


def test_bad_hostlist_is_refused():
    with pytest.raises(HostlistError, match="not closed"):
        expand("gpu-[01-04")


def test_tasks_per_node_in_slurm_notation():
    assert tasks_per_node(3, 2) == [2, 1]
    assert format_tasks_per_node([4, 4, 2]) == "4(x2),2"
    assert parse_tasks_per_node("4(x2),2") == [4, 4, 2]


def test_output_patterns():
    ctx = PatternContext(job_id=42, job_name="train", user="alice", node="gpu-01.cluster",
                         array_job_id=40, array_task_id=3)
    assert expand_pattern("slurm-%A_%a.out", ctx) == "slurm-40_3.out"
    assert expand_pattern("%x-%j-%N-%u-%t-%%.log", ctx) == "train-42-gpu-01-alice-0-%.log"
    assert expand_pattern("%4j.out", ctx) == "0042.out"
    assert expand_pattern("raw\\%j", ctx) == "raw%j"
    plain = PatternContext(job_id=7, job_name="x", user="a", node="n")
    assert expand_pattern("%A_%a", plain) == f"7_{NO_ARRAY_TASK}"


CTX = JobContext(job_id=12, name="ddp", user="alice", nodes=["gpu-01", "gpu-02"], ntasks=8,
                 cpus_per_task=10, cpus_per_node=40, gpus={"gpu-01": [0, 1, 2, 3], "gpu-02": [4, 5, 6, 7]},
                 ntasks_per_node=4, partition="gpu", account="ml", submit_dir="/home/alice",
                 submit_host="login1", array_job_id=10, array_task_id=2, array_indices=(0, 2, 4))


def test_job_environment_of_the_second_node():
    env = job_environment(CTX, "gpu-02")
    assert {k: env[k] for k in ("SLURM_JOB_ID", "SLURM_JOB_NODELIST", "SLURM_NNODES", "SLURM_NODEID",
                                "SLURM_NTASKS", "SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE",
                                "SLURM_CPUS_PER_TASK", "SLURM_GPUS_ON_NODE", "SLURM_JOB_GPUS",
                                "SLURM_JOB_PARTITION", "SLURM_JOB_ACCOUNT", "SLURM_SUBMIT_DIR")} == {
        "SLURM_JOB_ID": "12", "SLURM_JOB_NODELIST": "gpu-[01-02]", "SLURM_NNODES": "2", "SLURM_NODEID": "1",
        "SLURM_NTASKS": "8", "SLURM_NTASKS_PER_NODE": "4", "SLURM_TASKS_PER_NODE": "4(x2)",
        "SLURM_CPUS_PER_TASK": "10", "SLURM_GPUS_ON_NODE": "4", "SLURM_JOB_GPUS": "4,5,6,7",
        "SLURM_JOB_PARTITION": "gpu", "SLURM_JOB_ACCOUNT": "ml", "SLURM_SUBMIT_DIR": "/home/alice",
    }
    assert (env["SLURM_ARRAY_TASK_MIN"], env["SLURM_ARRAY_TASK_MAX"], env["SLURM_ARRAY_TASK_COUNT"],
            env["SLURM_ARRAY_TASK_STEP"]) == ("0", "4", "3", "2")


def test_task_environment_has_global_and_local_rank():
    env = task_environment(CTX, "gpu-02", 6)
    assert (env["SLURM_PROCID"], env["SLURM_LOCALID"], env["SLURM_NODEID"]) == ("6", "2", "1")
    with pytest.raises(ValueError, match="does not run on node 1"):
        task_environment(CTX, "gpu-02", 1)


def run_shim(name: str, *args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SHIMS / f"{name}.py"), *args], env={**os.environ, **env},
                          capture_output=True, text=True, timeout=30)


def test_scontrol_show_hostnames_defaults_to_the_job_nodelist():
    r = run_shim("scontrol", "show", "hostnames", env={"SLURM_JOB_NODELIST": "gpu-[01-02],cpu1"})
    assert (r.returncode, r.stdout) == (0, "gpu-01\ngpu-02\ncpu1\n")
    r = run_shim("scontrol", "show", "hostnames", "n[8-10]", env={})
    assert r.stdout.splitlines() == ["n8", "n9", "n10"]


def test_scontrol_other_verbs_say_where_they_work():
    r = run_shim("scontrol", "show", "job", "1", env={})
    assert r.returncode == 1 and "trainyard slurm scontrol" in r.stderr


def test_srun_runs_this_nodes_tasks_with_their_ranks(tmp_path):
    env = {**job_environment(CTX, "gpu-02"), "SLURMD_NODENAME": "gpu-02"}
    # one write per task, so lines from concurrent tasks do not interleave
    probe = ("import os; e = os.environ; os.write(1, ' '.join(e[k] for k in ('SLURM_PROCID', "
             "'SLURM_LOCALID', 'SLURM_NODEID', 'SLURM_STEP_NUM_TASKS')).encode() + b'\\n')")
    r = run_shim("srun", sys.executable, "-c", probe, env=env)
    assert r.returncode == 0, r.stderr
    assert sorted(r.stdout.splitlines()) == ["4 0 1 8", "5 1 1 8", "6 2 1 8", "7 3 1 8"]


def test_srun_ntasks_option_and_first_failure_is_the_exit_status():
    env = {**job_environment(CTX, "gpu-01"), "SLURMD_NODENAME": "gpu-01"}
    code = "import os,sys; sys.exit(3 if os.environ['SLURM_PROCID'] == '1' else 0)"
    r = run_shim("srun", "-N", "1", "-n", "2", sys.executable, "-c", code, env=env)
    assert r.returncode == 3


def test_srun_outside_a_job_is_refused():
    r = subprocess.run([sys.executable, str(SHIMS / "srun.py"), "true"], capture_output=True, text=True,
                       env={k: v for k, v in os.environ.items() if not k.startswith("SLURM_")})
    assert r.returncode == 1 and "not inside a job" in r.stderr


def test_the_agent_installs_runnable_shims_from_its_own_files(tmp_path):
    """What a job's PATH gets: srun and scontrol, readable by any account, working from there."""
    from scheduler import agent, nodefiles

    top = tmp_path / "slurm"
    for rel, source in agent.SLURM_SHIM_FILES:
        nodefiles.install_public(str(top), rel, nodefiles.own_file(source))
    assert oct((top / "bin" / "srun").stat().st_mode & 0o777) == "0o755"
    assert oct((top / "hostlist.py").stat().st_mode & 0o777) == "0o644"
    env = {"PATH": f"{top / 'bin'}:{os.environ['PATH']}", "SLURM_JOB_NODELIST": "gpu-[01-02]"}
    r = subprocess.run(["scontrol", "show", "hostnames"], env=env, capture_output=True, text=True, timeout=30)
    assert r.stdout == "gpu-01\ngpu-02\n", r.stderr
    env.update(SLURM_JOB_ID="5", SLURMD_NODENAME="gpu-02", SLURM_NODEID="1")
    r = subprocess.run(["srun", "--ntasks-per-node=2", "sh", "-c", "echo $SLURM_PROCID"], env=env,
                       capture_output=True, text=True, timeout=30)
    assert sorted(r.stdout.split()) == ["2", "3"], r.stderr
