"""Dispatch: turn a committed allocation (CONFIGURING) into launch messages to each rank's agent."""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache

from ..models import Job
from ..planner import parse_array
from ..slurm.environment import JobContext, job_environment
from ..slurm.patterns import PatternContext, output_path
from .lifecycle import job_key, runs_batch_step
from .links import NodeLinks

# what a batch job's other nodes run while its script runs on the first (Slurm's batch step)
HOLD_ALLOCATION = ("sleep", "infinity")


def master_port(job: Job) -> int:
    """A rendezvous port that differs between jobs and attempts sharing a first node."""
    return 29500 + (job.id * 7 + job.attempt) % 20000


@lru_cache(maxsize=1024)
def array_indices(spec: str) -> tuple[int, ...]:
    if not spec:
        return ()
    try:
        return tuple(sorted(parse_array(spec)[0]))
    except ValueError:
        return ()


def slurm_context(job: Job, cluster: str) -> JobContext:
    """The job as Slurm's variables describe it (scheduler/slurm/environment.py)."""
    nodes = [a["node"] for a in job.allocation]
    per_node = job.ntasks_per_node
    ntasks = job.ntasks or (per_node * len(nodes) if per_node else len(nodes))
    cpus_per_task = job.cpus_per_task or max(1, job.cpus // max(1, per_node or 1))
    return JobContext(
        job_id=job.id, name=job.name, user=job.user, nodes=nodes, ntasks=ntasks,
        cpus_per_task=cpus_per_task, cpus_per_node=job.cpus,
        gpus={a["node"]: list(a["gpus"]) for a in job.allocation}, ntasks_per_node=per_node,
        mem_per_node_mb=job.mem_mb or None, partition=job.queue, account=job.account, qos=job.qos,
        submit_dir=job.submit_dir or job.workdir or "", submit_host=job.submit_host,
        restart_count=job.attempt, cluster=cluster,
        array_job_id=(job.array_parent or job.id) if job.array_task_id is not None else None,
        array_task_id=job.array_task_id, array_indices=array_indices(job.array_spec),
        time_limit_s=job.time_limit_s, start_time=int(job.start_time) if job.start_time else None,
    )


def output_files(job: Job, rank: int, node: str, workdir: str | None) -> tuple[str | None, str | None]:
    """Slurm-style output files of one rank, as absolute paths on the node (None: none).

    The batch step's file (rank 0) is `--output`, by default slurm-%j.out (slurm-%A_%a.out for an
    array task) in the working directory. Other ranks write files only when the pattern names the
    node or task (%N, %n, %t), so that ranks never write into one file together."""
    base = workdir or job.submit_dir
    if not base:
        return None, None  # no working directory: the output stays in the agent's job directory
    array = job.array_task_id is not None
    out = job.output or ("slurm-%A_%a.out" if array else "slurm-%j.out")
    ctx = PatternContext(job_id=job.id, job_name=job.name, user=job.user, node=node,
                         array_job_id=(job.array_parent or job.id) if array else None,
                         array_task_id=job.array_task_id, node_index=rank, task=rank)

    def one(pattern: str) -> str | None:
        if rank > 0 and not any(f"%{c}" in pattern for c in "Nnt"):
            return None
        return output_path(pattern, ctx, base)

    return one(out), (one(job.error) if job.error else None)


class Dispatcher:
    """Write-ahead: dispatch runs only after the allocation is committed; a lost launch is resent."""

    def __init__(self, links: NodeLinks, unix_user: Callable[[str], str], cluster: str = "trainyard"):
        self.links = links
        self.unix_user = unix_user
        self.cluster = cluster
        self.on_dispatch: Callable[[Job], None] | None = None  # the log store records the ranks
        self.pulls: dict[int, dict] = {}  # container jobs whose image is being pulled: id -> state
        self.registry_auth: Callable[[str], dict | None] = lambda image: None

    def environment(self, job: Job, rank: int) -> dict[str, str]:
        ranks = [a["node"] for a in job.allocation]
        gpus = job.allocation[rank]["gpus"]
        env = dict(job.env)
        env.update({
            "TRAINYARD_JOB_ID": str(job.id),
            "TRAINYARD_JOB_NAME": job.name,
            "TRAINYARD_ATTEMPT": str(job.attempt),
            "TRAINYARD_NODELIST": ",".join(ranks),
            "CUDA_VISIBLE_DEVICES": ",".join(str(g) for g in gpus),
            "MASTER_ADDR": self.links.addresses.get(ranks[0], ranks[0]),
            "MASTER_PORT": str(job.allocation[0].get("port") or master_port(job)),
            "WORLD_SIZE": str(len(ranks)),
            "NNODES": str(len(ranks)),
            "NODE_RANK": str(rank),
            "TRAINYARD_NODE_RANK": str(rank),
        })
        if job.array_task_id is not None:
            env["TRAINYARD_ARRAY_TASK_ID"] = str(job.array_task_id)
            env["TRAINYARD_ARRAY_JOB_ID"] = str(job.array_parent or job.id)
        env.update(job_environment(slurm_context(job, self.cluster), ranks[rank]))
        env["TRAINYARD_NODE_ADDRS"] = ",".join(self.links.addresses.get(n, n) for n in ranks)
        return env

    def dispatch(self, job: Job) -> None:
        if self.on_dispatch is not None:
            self.on_dispatch(job)
        if job.image:  # pull on every node of the gang first, so that the ranks start together
            nodes = [a["node"] for a in job.allocation]
            self.pulls[job.id] = {"job": job, "key": job_key(job), "waiting": set(nodes)}
            pull = {"op": "pull", "image": job.image, "key": job_key(job)}
            auth = self.registry_auth(job.image)
            if auth:  # for this pull only; the agent writes it nowhere but the runtime's auth file
                pull["auth"] = auth
            for n in nodes:
                self.links.send(n, pull)
            return
        for a in job.allocation:
            self.dispatch_rank(job, a["node"])

    def on_pulled(self, node: str, msg: dict) -> tuple[Job, str] | None:
        """A node has the image (or failed to get it): launch once every node has it; a failure
        is returned as (job, reason) for the job to fail with."""
        key = msg.get("key")
        entry = next((e for e in self.pulls.values() if e["key"] == key), None)
        if entry is None or node not in entry["waiting"]:
            return None
        job = entry["job"]
        if msg.get("error"):
            del self.pulls[job.id]
            return job, f"pulling {job.image} failed on {node}: {msg['error']}"
        entry["waiting"].discard(node)
        if not entry["waiting"]:
            del self.pulls[job.id]
            for a in job.allocation:
                self.dispatch_rank(job, a["node"])
        return None

    def dispatch_rank(self, job: Job, node: str) -> None:
        ranks = [a["node"] for a in job.allocation]
        if node not in ranks:
            return
        rank = ranks.index(node)
        workdir = job.workdir or job.submit_dir or None
        stdout, stderr = output_files(job, rank, node, workdir)
        argv, script, batch_step = job.command, job.script, runs_batch_step(job)
        if batch_step and rank > 0:  # holds the node for the tasks srun starts here
            argv, script, stdout, stderr = list(HOLD_ALLOCATION), None, None, None
        self.links.send(node, {
            "op": "launch", "key": job_key(job), "job_id": job.id, "argv": argv,
            "script": script, "env": self.environment(job, rank), "workdir": workdir,
            "batch_step": batch_step,
            "gpus": job.allocation[rank]["gpus"], "user": self.unix_user(job.user),
            "cpus": job.cpus, "mem_mb": job.mem_mb, "stdout": stdout, "stderr": stderr,
            "image": job.image or None, "mounts": list(job.container_mounts or ()),
            "container_workdir": job.container_workdir or None,
        })
