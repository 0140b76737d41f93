#!/usr/bin/env python3
"""srun inside a trainyard job: run a command as a step's tasks across the job's nodes, wait for
all, exit with the first failure (as `srun` does under a batch script).

Stdlib only; loads hostlist.py and layout.py from the directory above this one. Each task gets
SLURM_PROCID, SLURM_LOCALID, SLURM_NODEID and the step's SLURM_STEP_* variables, with Slurm's
block distribution of tasks over the step's nodes. This node's tasks start here; in a batch job
(TRAINYARD_STEP_SOCKET set: the script runs on the first node only, as in Slurm) each other node
of the step gets its share through the node's agent and the daemon, and its output comes back
here. Where the job runs its script on every node instead (a container job), each node's srun
starts its own share and together they make the whole step.
"""

from __future__ import annotations

import base64
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.realpath(__file__))))

from hostlist import compress, expand  # noqa: E402
from layout import parse_tasks_per_node, ranks_of_node, task_variables, tasks_per_node  # noqa: E402

NODE_TASKS_FLAG = "--trainyard-node-tasks"  # run this node's share only (the agent's step_exec)

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


class RemoteShare:
    """This step's tasks on another node: one connection to this node's agent, which has the
    daemon run them there and relays their output and exit status back."""

    def __init__(self, node: str, request: dict, path: str, out_lock: threading.Lock):
        self.node = node
        self.request = request
        self.path = path
        self.out_lock = out_lock
        self.rc: int | None = None
        self.ended_at = 0.0
        self.sock: socket.socket | None = None
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        try:
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.sock.connect(self.path)
            self.sock.sendall((json.dumps({**self.request, "node": self.node}) + "\n").encode())
            for line in self.sock.makefile("rb"):
                frame = json.loads(line)
                if "end" in frame:
                    self.rc = frame["end"]
                    if self.rc is None:
                        self.say(f"srun: error: {self.node}: {frame.get('reason') or 'the step did not start'}")
                        self.rc = 1
                    elif frame.get("reason"):
                        self.say(f"srun: {self.node}: {frame['reason']}")
                    break
                stream = sys.stdout.buffer if "o" in frame else sys.stderr.buffer
                with self.out_lock:
                    stream.write(base64.b64decode(frame.get("o") or frame.get("e") or ""))
                    stream.flush()
            else:
                self.say(f"srun: error: {self.node}: the node's agent went away before the step ended")
                self.rc = 1
        except (OSError, ValueError) as e:
            self.say(f"srun: error: {self.node}: cannot start the step there: {e}")
            self.rc = 1
        finally:
            self.ended_at = time.monotonic()
            if self.sock is not None:
                self.sock.close()

    def say(self, text: str) -> None:
        with self.out_lock:
            print(text, file=sys.stderr, flush=True)

    def signal(self, name: str) -> None:
        """Pass a signal on to this share's tasks (through the agents; srun there forwards it)."""
        if self.sock is not None:
            try:
                self.sock.sendall((json.dumps({"signal": name}) + "\n").encode())
            except OSError:
                pass

    def cancel(self) -> None:
        """srun was told to stop: hanging up ends the tasks on that node (SIGTERM)."""
        if self.sock is not None:
            try:
                self.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def main(argv: list[str]) -> int:
    if "SLURM_JOB_ID" not in os.environ:
        print("srun: error: not inside a job (SLURM_JOB_ID is not set); submit with "
              "`trainyard slurm sbatch` or run the command directly", file=sys.stderr)
        return 1
    node_tasks = argv[:1] == [NODE_TASKS_FLAG]
    if node_tasks:
        argv = argv[1:]
    opts, command = parse(argv)
    if not command:
        print("srun: error: no command to run", file=sys.stderr)
        return 2
    env = dict(os.environ)
    nodes, counts = step_layout(opts, env)
    here = env.get("SLURMD_NODENAME") or nodes[0]
    socket_path, token = env.get("TRAINYARD_STEP_SOCKET"), env.get("TRAINYARD_STEP_TOKEN")
    out_lock = threading.Lock()
    remote: list[RemoteShare] = []
    if not node_tasks and socket_path and token:
        options = argv[:len(argv) - len(command)]
        if options[-1:] == ["--"]:
            options = options[:-1]
        request = {"token": token, "argv": command, "srun": options, "env": env,
                   "cwd": os.getcwd()}
        remote = [RemoteShare(n, request, socket_path, out_lock) for n in nodes if n != here]
    if here not in nodes and not remote:
        return 0  # this node takes no part in the step
    for share in remote:
        share.thread.start()
    step_id = int(env.get("SLURM_STEP_ID", "-1")) + 1
    tasks = []
    if here in nodes:
        index = nodes.index(here)
        for procid in ranks_of_node(counts, index):
            task_env = {**env, **task_variables(compress(nodes), counts, index, procid, step_id)}
            try:
                tasks.append(subprocess.Popen(command, env=task_env))
            except OSError as e:
                print(f"srun: error: {command[0]}: {e.strerror}", file=sys.stderr)
                for t in tasks:
                    t.terminate()
                for share in remote:
                    share.cancel()
                return 2

    def forward(signum, _frame):
        for t in tasks:
            if t.poll() is None:
                t.send_signal(signum)
        for share in remote:
            if signum in (signal.SIGINT, signal.SIGTERM):
                share.cancel()  # the tasks there get SIGTERM, then SIGKILL, as with srun's KillWait
            else:
                share.signal(signal.Signals(signum).name[3:])

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, forward)
    failures: list[tuple[float, int]] = []  # (when, exit status) of each failed share
    pending = list(tasks)
    while pending:
        pid, status = os.wait()
        for t in pending:
            if t.pid == pid:
                pending.remove(t)  # Python 3.8 has no os.waitstatus_to_exitcode
                code = os.WEXITSTATUS(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status)
                t.returncode = code
                if code:
                    failures.append((time.monotonic(), code))
                break
    for share in remote:
        while share.thread.is_alive():  # a join that signals can interrupt
            share.thread.join(0.2)
        if share.rc:
            failures.append((share.ended_at, share.rc))
    return min(failures)[1] if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
