"""Slurm batch scripts run unchanged on a real daemon with real sshd nodes: SLURM_* variables,
Slurm-style output files written as the job's user, features, node lists, partition aliases."""

from __future__ import annotations

import io
import json
import os
import pwd
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.conftest import DaemonProc, add_sshd_node, shared_dir, wait_job

ALIASES = """
[queues.gpu]
aliases = ["defq", "a100"]
"""


@pytest.fixture(scope="module")
def slurm_cluster(tmp_path_factory):
    from tests.conftest import SshdNode

    base = tmp_path_factory.mktemp("slurmjobs")
    d = DaemonProc(base, extra_config=ALIASES).start()
    nodes = []
    try:
        for name, labels in (("gpu-01", {"a100": "", "ib": ""}), ("gpu-02", {"v100": ""})):
            n = SshdNode(base, name, d.public_key)
            n.start()
            nodes.append(n)
            add_sshd_node(d, n, gpus=4, labels=labels)
        yield d
    finally:
        for n in nodes:
            n.stop()
        d.stop()


@pytest.fixture
def submit_dir():
    """A directory the job's account can write (as root, jobs run as another user)."""
    return shared_dir("submit-")


def sbatch(d: DaemonProc, cwd: Path, script: str, *args: str) -> subprocess.CompletedProcess:
    path = cwd / "job.sh"
    path.write_text(script)
    env = {**d.env, "TRAINYARD_URL": d.url, "TRAINYARD_TOKEN": d.token}
    return subprocess.run([sys.executable, "-m", "scheduler.slurm.commands_main", "sbatch", "--parsable",
                           *args, str(path)], env=env, capture_output=True, text=True, timeout=60, cwd=cwd)


def test_a_slurm_script_runs_with_slurm_variables_and_its_output_file(slurm_cluster, submit_dir):
    d = slurm_cluster
    r = sbatch(d, submit_dir, """#!/bin/bash
#SBATCH --job-name=probe
#SBATCH -p defq
#SBATCH --gres=gpu:2 --ntasks-per-node=2 --cpus-per-task=1
#SBATCH --time=23:59:59
#SBATCH --output=%x-%j.log
echo "ID=$SLURM_JOB_ID NAME=$SLURM_JOB_NAME PART=$SLURM_JOB_PARTITION NODES=$SLURM_JOB_NODELIST"
echo "NTASKS=$SLURM_NTASKS GPUS=$SLURM_GPUS_ON_NODE SUBMIT=$SLURM_SUBMIT_DIR"
echo "HOSTS=$(scontrol show hostnames $SLURM_JOB_NODELIST 2>/dev/null || echo none)"
id -un
""")
    assert r.returncode == 0, r.stderr
    job_id = int(r.stdout.strip())
    done = wait_job(d.client(), job_id, "COMPLETED", timeout=30)
    assert done["queue"] == "gpu" and done["time_limit"] == 86400  # rounded up to the minute
    out = submit_dir / f"probe-{job_id}.log"
    text = out.read_text()
    assert f"ID={job_id} NAME=probe PART=gpu NODES={done['allocation'][0]['node']}" in text
    assert f"NTASKS=2 GPUS=2 SUBMIT={submit_dir}" in text
    owner = pwd.getpwuid(out.stat().st_uid).pw_name
    assert text.strip().splitlines()[-1] == owner  # written as the job's own account
    if os.geteuid() == 0:
        assert owner != "root"


def test_features_and_nodelist_choose_the_node(slurm_cluster, submit_dir):
    d = slurm_cluster
    c = d.client()
    for args, node in ((("-C", "a100&ib"), "gpu-01"), (("-C", "v100"), "gpu-02"), (("-w", "gpu-02"), "gpu-02"),
                       (("-x", "gpu-01"), "gpu-02")):
        r = sbatch(d, submit_dir, "#!/bin/sh\ntrue\n", *args)
        assert r.returncode == 0, r.stderr
        done = wait_job(c, int(r.stdout.strip()), "COMPLETED", timeout=30)
        assert done["allocation"][0]["node"] == node, (args, done)


def test_a_feature_no_node_has_is_refused_at_submit(slurm_cluster, submit_dir):
    r = sbatch(slurm_cluster, submit_dir, "#!/bin/sh\ntrue\n", "-C", "h100")
    assert r.returncode != 0 and "no node has the features 'h100'" in r.stderr


def test_an_unknown_partition_names_the_queues_and_aliases(slurm_cluster, submit_dir):
    r = sbatch(slurm_cluster, submit_dir, "#!/bin/sh\n#SBATCH -p nope\ntrue\n")
    assert r.returncode != 0
    assert "'nope'" in r.stderr and "gpu" in r.stderr and "defq (= gpu)" in r.stderr


def test_an_array_writes_one_file_per_task(slurm_cluster, submit_dir):
    d = slurm_cluster
    r = sbatch(d, submit_dir, "#!/bin/sh\n#SBATCH --array=0-2\necho task=$SLURM_ARRAY_TASK_ID "
               "of $SLURM_ARRAY_TASK_COUNT max=$SLURM_ARRAY_TASK_MAX\n")
    assert r.returncode == 0, r.stderr
    parent = int(r.stdout.strip().split("_")[0])
    c = d.client()
    tasks = [j for j in c.jobs(all=True) if j["array_job_id"] == parent]
    for t in tasks:
        wait_job(c, t["id"], "COMPLETED", timeout=30)
    for i in range(3):
        assert (submit_dir / f"slurm-{parent}_{i}.out").read_text() == f"task={i} of 3 max=2\n"


def _bundle_ships_shims() -> bool:
    from scheduler.nodes import agent_bundle

    with zipfile.ZipFile(io.BytesIO(agent_bundle()[0])) as z:
        return "slurm/shims/srun.py" in z.namelist()


@pytest.mark.skipif(not _bundle_ships_shims(), reason="the agent bundle does not carry the srun and "
                    "scontrol shims yet (scheduler/nodes.py BUNDLE_MODULES)")
def test_a_multi_node_srun_torchrun_script_runs_unchanged(slurm_cluster, submit_dir):
    """The shape of a typical multi-node DDP script: the master is the first host of the
    allocation, and srun starts one torchrun per node that spawns its node's workers."""
    from tests.conftest import free_port

    d = slurm_cluster
    shutil.copy(Path(__file__).parent / "fake_torchrun.py", submit_dir / "fake_torchrun.py")
    r = sbatch(d, submit_dir, f"""#!/bin/bash
#SBATCH --job-name=ddp --nodes=2 --ntasks-per-node=1 --gres=gpu:2
#SBATCH --output=%x-%j-%N.out
echo "batch step on $SLURMD_NODENAME"
export MASTER_ADDR=$(scontrol show hostnames $SLURM_JOB_NODELIST | head -n 1)
export MASTER_PORT={free_port()}
srun bash -c 'python3 fake_torchrun.py --nnodes=$SLURM_NNODES --node_rank=$SLURM_NODEID \\
    --nproc_per_node=2 --out=$SLURM_SUBMIT_DIR'
srun bash -c 'echo "task $SLURM_PROCID of $SLURM_NTASKS on $SLURMD_NODENAME sees MASTER_ADDR=$MASTER_ADDR"'
""")
    assert r.returncode == 0, r.stderr
    job_id = int(r.stdout.strip())
    done = wait_job(d.client(), job_id, ("COMPLETED", "FAILED"), timeout=60)
    files = sorted(submit_dir.glob("ddp-*.out"))
    logs = "".join(p.read_text() for p in files)
    assert done["state"] == "COMPLETED", logs
    nodes = sorted(a["node"] for a in done["allocation"])
    assert nodes == ["gpu-01", "gpu-02"]
    # Slurm's batch step: the script ran once, on the first node, and srun's tasks on the other
    # node wrote into the batch step's output, as they do under Slurm
    first = done["allocation"][0]["node"]
    assert [p.name for p in files] == [f"ddp-{job_id}-{first}.out"]
    lines = logs.splitlines()
    assert lines.count(f"batch step on {first}") == 1 and sum("batch step" in x for x in lines) == 1
    assert sorted(x for x in lines if x.startswith("task ")) == [
        f"task 0 of 2 on {first} sees MASTER_ADDR=gpu-01",
        f"task 1 of 2 on {[n for n in nodes if n != first][0]} sees MASTER_ADDR=gpu-01"]
    peers = json.loads((submit_dir / "rendezvous.json").read_text())
    assert [p["RANK"] for p in peers] == ["1", "2", "3"]
    for rank in range(4):
        seen = json.loads((submit_dir / f"rank-{rank}.json").read_text())
        node = rank // 2
        assert seen == {
            "RANK": str(rank), "LOCAL_RANK": str(rank % 2), "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2",
            "GROUP_RANK": str(node), "MASTER_ADDR": "gpu-01", "MASTER_PORT": seen["MASTER_PORT"],
            "SLURM_PROCID": str(node), "SLURM_LOCALID": "0", "SLURM_NODEID": str(node),
            "SLURM_NTASKS": "2", "SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "gpu-[01-02]",
            "SLURMD_NODENAME": nodes[node], "SLURM_JOB_ID": str(job_id), "SLURM_STEP_ID": "0",
        }, rank


@pytest.mark.skipif(not _bundle_ships_shims(), reason="the agent bundle does not carry the srun and "
                    "scontrol shims yet (scheduler/nodes.py BUNDLE_MODULES)")
def test_srun_on_another_node_returns_its_exit_status_and_stderr(slurm_cluster, submit_dir):
    """srun -w names one node of the allocation: its tasks run there, their stderr comes back to
    the batch step's error file, srun exits with their status, and the job ends with the
    script's own exit code (not the status of the nodes that held the allocation)."""
    d = slurm_cluster
    r = sbatch(d, submit_dir, """#!/bin/bash
#SBATCH -J remote -N 2 --ntasks-per-node=1 -o %x-%j.out -e %x-%j.err
other=$(scontrol show hostnames $SLURM_JOB_NODELIST | tail -n 1)
srun -w "$other" bash -c 'echo "stderr from $SLURMD_NODENAME" >&2; exit 3'
echo "srun rc=$?"
TRAINYARD_STEP_TOKEN=0123456789abcdef0123456789abcdef srun -w "$other" true
echo "forged token rc=$?"
srun -w gpu-99 true
echo "bad node rc=$?"
python3 - <<'PY'
import json, os, socket
s = socket.socket(socket.AF_UNIX)
s.connect(os.environ["TRAINYARD_STEP_SOCKET"])
s.sendall(b"{not json\\n")
print("garbage:", json.loads(s.makefile().readline())["reason"].split(":")[0])
PY
srun -N1 -w "$other" bash -c 'echo "one node: $SLURM_NNODES $SLURM_NTASKS $SLURMD_NODENAME"'
exit 5
""")
    assert r.returncode == 0, r.stderr
    job_id = int(r.stdout.strip())
    done = wait_job(d.client(), job_id, ("COMPLETED", "FAILED"), timeout=60)
    out = (submit_dir / f"remote-{job_id}.out").read_text()
    err = (submit_dir / f"remote-{job_id}.err").read_text()
    other = done["allocation"][1]["node"]
    assert done["state"] == "FAILED" and done["exit_code"] == 5, (done, out, err)
    assert "srun rc=3" in out.splitlines(), out
    assert f"stderr from {other}" in err.splitlines(), err
    # a step socket request with a token no running job has is refused, and says why
    assert "forged token rc=1" in out.splitlines(), out
    assert "has this TRAINYARD_STEP_TOKEN" in err, err
    # a node outside the allocation is refused by the daemon, naming the job's nodes
    assert "bad node rc=1" in out.splitlines(), out
    assert "gpu-99 is not a node of job" in err, err
    # a malformed request gets an answer, and the node's agent goes on serving the next srun
    assert "garbage: the request is not JSON" in out.splitlines(), out
    assert f"one node: 1 1 {other}" in out.splitlines(), out


@pytest.mark.skipif(not _bundle_ships_shims(), reason="the agent bundle does not carry the srun and "
                    "scontrol shims yet (scheduler/nodes.py BUNDLE_MODULES)")
def test_a_batch_script_that_ends_ends_the_tasks_it_left_on_other_nodes(slurm_cluster, submit_dir):
    """As under Slurm, the batch script is the job: when it exits, the job ends (with its exit
    code) and a step it left running on another node is killed, not left behind."""
    d = slurm_cluster
    marker = f"{371 + os.getpid() % 1000}"
    r = sbatch(d, submit_dir, f"""#!/bin/bash
#SBATCH -J leftover -N 2 -o %x-%j.out
other=$(scontrol show hostnames $SLURM_JOB_NODELIST | tail -n 1)
srun -w "$other" bash -c 'echo started on $SLURMD_NODENAME; exec sleep {marker}' &
for i in $(seq 100); do grep -q started leftover-$SLURM_JOB_ID.out && break; sleep 0.1; done
echo "script done"
""")
    assert r.returncode == 0, r.stderr
    job_id = int(r.stdout.strip())
    done = wait_job(d.client(), job_id, ("COMPLETED", "FAILED"), timeout=60)
    out = (submit_dir / f"leftover-{job_id}.out").read_text()
    assert done["state"] == "COMPLETED" and done["exit_code"] == 0, (done, out)
    assert "started on" in out and "script done" in out, out
    from tests.conftest import wait_for

    wait_for(lambda: subprocess.run(["pgrep", "-f", f"sleep {marker}"],
                                    capture_output=True).returncode == 1, 20,
             what=f"the step's `sleep {marker}` on the other node to be killed")


@pytest.mark.skipif(not _bundle_ships_shims(), reason="the agent bundle does not carry the srun and "
                    "scontrol shims yet (scheduler/nodes.py BUNDLE_MODULES)")
def test_srun_in_a_salloc_shell_runs_a_step_across_the_allocation(slurm_cluster):
    """salloc -N2 opens its shell on the first node; srun there starts tasks on both nodes."""
    from tests.slurm.test_pty import in_a_terminal

    d = slurm_cluster
    rc, screen = in_a_terminal(
        d, "salloc", "-N2", "--ntasks-per-node=2", "-J", "twonode", "sh", "-c",
        "srun sh -c 'echo task=$SLURM_PROCID node=$SLURMD_NODENAME'; echo srun=$?", token=d.token)
    assert rc == 0, screen
    tasks = dict(line.strip().removeprefix("task=").split(" node=")
                 for line in screen.splitlines() if line.startswith("task="))
    assert sorted(tasks) == ["0", "1", "2", "3"], screen
    # Slurm's block distribution: ranks 0-1 on the first node (the shell's), 2-3 on the other
    assert tasks["0"] == tasks["1"] != tasks["2"] == tasks["3"], screen
    assert {tasks["0"], tasks["2"]} == {"gpu-01", "gpu-02"}, screen
    assert "srun=0" in screen, screen


@pytest.mark.skipif(not _bundle_ships_shims(), reason="the agent bundle does not carry the srun and "
                    "scontrol shims yet (scheduler/nodes.py BUNDLE_MODULES)")
def test_a_signal_to_srun_reaches_its_tasks_on_every_node(slurm_cluster, submit_dir):
    """The checkpoint-on-signal pattern: the batch shell passes USR1 on to srun, and srun to
    every task of its step, on the other node too; each task saves and exits 0."""
    d = slurm_cluster
    r = sbatch(d, submit_dir, """#!/bin/bash
#SBATCH -J ckpt -N 2 -o %x-%j.out
srun bash -c 'trap "echo saved on $SLURMD_NODENAME; exit 0" USR1; echo up $SLURM_PROCID; \\
    while :; do sleep 0.1; done' &
pid=$!
for i in $(seq 200); do [ "$(grep -c '^up ' ckpt-$SLURM_JOB_ID.out)" = 2 ] && break; sleep 0.1; done
kill -USR1 $pid
wait $pid
echo "srun rc=$?"
""")
    assert r.returncode == 0, r.stderr
    job_id = int(r.stdout.strip())
    done = wait_job(d.client(), job_id, ("COMPLETED", "FAILED"), timeout=60)
    out = (submit_dir / f"ckpt-{job_id}.out").read_text()
    nodes = sorted(a["node"] for a in done["allocation"])
    assert done["state"] == "COMPLETED", out
    assert sorted(x for x in out.splitlines() if x.startswith("saved on")) == [
        f"saved on {n}" for n in nodes], out
    assert "srun rc=0" in out.splitlines(), out
