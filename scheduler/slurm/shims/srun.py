#!/usr/bin/env python3
"""srun inside a trainyard job: run a command as the step's tasks on this node, wait for all,
exit with the first failure (as `srun` does under a batch script).

Stdlib only; loads hostlist.py and layout.py from the directory above this one. Each task gets
SLURM_PROCID, SLURM_LOCALID, SLURM_NODEID and the step's SLURM_STEP_* variables, with Slurm's
block distribution of tasks over the job's nodes. This node's tasks are the ranks of node
SLURM_NODEID; trainyard runs the batch script on each node of a job, so each node's srun starts
its own share and together they make the whole step.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.realpath(__file__))))

from hostlist import compress, expand  # noqa: E402
from layout import parse_tasks_per_node, ranks_of_node, task_variables, tasks_per_node  # noqa: E402

# srun options that take a value; the ones not read here only shape placement or binding
WITH_VALUE = {
    "-n": "ntasks", "--ntasks": "ntasks", "-N": "nodes", "--nodes": "nodes",
    "--ntasks-per-node": "ntasks-per-node", "-w": "nodelist", "--nodelist": "nodelist",
    "-c": None, "--cpus-per-task": None, "--mpi": None, "--cpu-bind": None, "--cpu_bind": None,
    "--gpu-bind": None, "--export": None, "--gres": None, "--gpus": None, "-G": None,
    "--gpus-per-node": None, "--gpus-per-task": None, "--mem": None, "-J": None, "--job-name": None,
    "--container-image": None, "--container-mounts": None, "--distribution": None, "-m": None,
    "--accel-bind": None, "--kill-on-bad-exit": None, "-K": None, "-o": None, "--output": None,
    "-e": None, "--error": None, "-x": None, "--exclude": None, "-t": None, "--time": None,
    "--mem-per-cpu": None, "--hint": None, "-p": None, "--partition": None,
}
FLAGS = {"-l", "--label", "-u", "--unbuffered", "--overlap", "--exclusive", "-v", "--verbose",
         "--pty", "-Q", "--quiet", "--exact", "--no-kill", "--cpu-bind=none"}


def parse(argv: list[str]) -> tuple[dict[str, str], list[str]]:
    opts: dict[str, str] = {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("-") or arg == "--":
            return opts, argv[i + (arg == "--"):]
        name, eq, value = arg.partition("=")
        if not eq and len(arg) > 2 and arg[:2] in WITH_VALUE and not arg.startswith("--"):
            name, value, eq = arg[:2], arg[2:], "="
        if name in WITH_VALUE:
            if not eq:
                i += 1
                if i >= len(argv):
                    raise SystemExit(f"srun: error: option {name} requires an argument")
                value = argv[i]
            if WITH_VALUE[name]:
                opts[WITH_VALUE[name]] = value
        elif arg in FLAGS or name.startswith("--"):
            pass  # accepted; placement and binding are the node's business
        else:
            raise SystemExit(f"srun: error: invalid option {arg!r}")
        i += 1
    return opts, []


def step_layout(opts: dict[str, str], env: dict[str, str]) -> tuple[list[str], list[int]]:
    """The step's nodes and tasks per node, from srun's options and the job's allocation."""
    nodes = expand(env.get("SLURM_JOB_NODELIST") or env.get("SLURMD_NODENAME") or "localhost")
    if "nodelist" in opts:
        wanted = expand(opts["nodelist"])
        nodes = [n for n in nodes if n in wanted] or wanted
    if "nodes" in opts:
        nodes = nodes[: int(opts["nodes"].split("-")[0])]
    if "ntasks" in opts:
        counts = tasks_per_node(int(opts["ntasks"]), len(nodes))
    elif "ntasks-per-node" in opts:
        counts = [int(opts["ntasks-per-node"])] * len(nodes)
    elif "nodes" not in opts and "nodelist" not in opts and env.get("SLURM_TASKS_PER_NODE"):
        counts = parse_tasks_per_node(env["SLURM_TASKS_PER_NODE"])[: len(nodes)]
    else:
        counts = [1] * len(nodes)  # Slurm's default: one task per node
    return nodes, counts


def main(argv: list[str]) -> int:
    if "SLURM_JOB_ID" not in os.environ:
        print("srun: error: not inside a job (SLURM_JOB_ID is not set); submit with "
              "`trainyard slurm sbatch` or run the command directly", file=sys.stderr)
        return 1
    opts, command = parse(argv)
    if not command:
        print("srun: error: no command to run", file=sys.stderr)
        return 2
    env = dict(os.environ)
    nodes, counts = step_layout(opts, env)
    here = env.get("SLURMD_NODENAME") or nodes[0]
    if here not in nodes:
        return 0  # this node takes no part in the step
    index = nodes.index(here)
    step_id = int(env.get("SLURM_STEP_ID", "-1")) + 1
    tasks = []
    for procid in ranks_of_node(counts, index):
        task_env = {**env, **task_variables(compress(nodes), counts, index, procid, step_id)}
        try:
            tasks.append(subprocess.Popen(command, env=task_env))
        except OSError as e:
            print(f"srun: error: {command[0]}: {e.strerror}", file=sys.stderr)
            for t in tasks:
                t.terminate()
            return 2

    def forward(signum, _frame):
        for t in tasks:
            if t.poll() is None:
                t.send_signal(signum)

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, forward)
    first_failure = 0
    pending = list(tasks)
    while pending:
        pid, status = os.wait()
        for t in pending:
            if t.pid == pid:
                pending.remove(t)  # Python 3.8 has no os.waitstatus_to_exitcode
                code = os.WEXITSTATUS(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status)
                t.returncode = code
                if code and not first_failure:
                    first_failure = code
                break
    return first_failure


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
