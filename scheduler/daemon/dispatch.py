"""Dispatch: turn a committed allocation (CONFIGURING) into launch messages to each rank's agent."""

from __future__ import annotations

from collections.abc import Callable

from ..models import Job
from .lifecycle import job_key
from .links import NodeLinks


def master_port(job: Job) -> int:
    """A rendezvous port that differs between jobs and attempts sharing a first node."""
    return 29500 + (job.id * 7 + job.attempt) % 20000


class Dispatcher:
    """Write-ahead: dispatch runs only after the allocation is committed; a lost launch is resent."""

    def __init__(self, links: NodeLinks, unix_user: Callable[[str], str]):
        self.links = links
        self.unix_user = unix_user

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
        return env

    def dispatch(self, job: Job) -> None:
        for a in job.allocation:
            self.dispatch_rank(job, a["node"])

    def dispatch_rank(self, job: Job, node: str) -> None:
        ranks = [a["node"] for a in job.allocation]
        if node not in ranks:
            return
        rank = ranks.index(node)
        self.links.send(node, {
            "op": "launch", "key": job_key(job), "job_id": job.id, "argv": job.command,
            "script": job.script, "env": self.environment(job, rank), "workdir": job.workdir,
            "gpus": job.allocation[rank]["gpus"], "user": self.unix_user(job.user),
            "cpus": job.cpus, "mem_mb": job.mem_mb,
        })
