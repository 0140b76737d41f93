"""The SLURM_* variables a job sees on a node: of its batch step, and of each srun task."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

from .hostlist import compress
from .layout import format_tasks_per_node, task_variables, tasks_per_node


@dataclass(frozen=True)
class JobContext:
    """One job's allocation as the node sees it (what the daemon sends with a launch)."""

    job_id: int
    name: str
    user: str
    nodes: list[str]  # node names in rank order
    ntasks: int
    cpus_per_task: int
    cpus_per_node: int
    gpus: dict[str, list[int]] = field(default_factory=dict)  # node -> GPU indices
    ntasks_per_node: int | None = None  # as requested; None when not given
    mem_per_node_mb: int | None = None
    partition: str = "default"
    account: str = ""
    qos: str = ""
    submit_dir: str = ""
    submit_host: str = ""
    restart_count: int = 0
    cluster: str = "trainyard"
    array_job_id: int | None = None
    array_task_id: int | None = None
    array_indices: tuple[int, ...] = ()
    time_limit_s: int | None = None
    start_time: int | None = None
    uid: int | None = None

    @property
    def task_counts(self) -> list[int]:
        return tasks_per_node(max(self.ntasks, len(self.nodes)), len(self.nodes))


def _array_step(indices: tuple[int, ...]) -> int:
    steps = {b - a for a, b in zip(indices, indices[1:], strict=False)}
    return steps.pop() if len(steps) == 1 else 1


@lru_cache(maxsize=256)
def _array_facts(indices: tuple[int, ...]) -> tuple[str, str, str, str]:
    """SLURM_ARRAY_TASK_MIN, _MAX, _COUNT and _STEP of an array: the same for each of its tasks
    (worked out once per array, not once per task: O(tasks) each time)."""
    ordered = tuple(sorted(indices))
    return str(ordered[0]), str(ordered[-1]), str(len(ordered)), str(_array_step(ordered))


def job_environment(ctx: JobContext, node: str) -> dict[str, str]:
    """The variables every process of the job on `node` sees (the batch step's set)."""
    index = ctx.nodes.index(node)
    counts = ctx.task_counts
    nodelist = compress(ctx.nodes)
    gpus = ctx.gpus.get(node, [])
    env = {
        "SLURM_JOB_ID": str(ctx.job_id), "SLURM_JOBID": str(ctx.job_id),
        "SLURM_JOB_NAME": ctx.name, "SLURM_JOB_USER": ctx.user,
        "SLURM_JOB_NODELIST": nodelist, "SLURM_NODELIST": nodelist,
        "SLURM_JOB_NUM_NODES": str(len(ctx.nodes)), "SLURM_NNODES": str(len(ctx.nodes)),
        "SLURM_NODEID": str(index), "SLURMD_NODENAME": node, "SLURM_TOPOLOGY_ADDR": node,
        "SLURM_NTASKS": str(ctx.ntasks), "SLURM_NPROCS": str(ctx.ntasks),
        "SLURM_TASKS_PER_NODE": format_tasks_per_node(counts),
        "SLURM_CPUS_ON_NODE": str(ctx.cpus_per_node),
        "SLURM_JOB_CPUS_PER_NODE": format_tasks_per_node([ctx.cpus_per_node] * len(ctx.nodes)),
        "SLURM_CPUS_PER_TASK": str(ctx.cpus_per_task),
        "SLURM_GPUS_ON_NODE": str(len(gpus)),
        "SLURM_JOB_PARTITION": ctx.partition, "SLURM_CLUSTER_NAME": ctx.cluster,
        "SLURM_SUBMIT_DIR": ctx.submit_dir, "SLURM_SUBMIT_HOST": ctx.submit_host,
        "SLURM_RESTART_COUNT": str(ctx.restart_count),
        # the batch step is task 0 on the first node
        "SLURM_PROCID": "0", "SLURM_LOCALID": "0",
    }
    if gpus:
        env["SLURM_JOB_GPUS"] = ",".join(map(str, gpus))
        env["SLURM_STEP_GPUS"] = env["SLURM_JOB_GPUS"]
    if ctx.ntasks_per_node is not None:
        env["SLURM_NTASKS_PER_NODE"] = str(ctx.ntasks_per_node)
    if ctx.account:
        env["SLURM_JOB_ACCOUNT"] = ctx.account
    if ctx.qos:
        env["SLURM_JOB_QOS"] = ctx.qos
    if ctx.mem_per_node_mb:
        env["SLURM_MEM_PER_NODE"] = str(ctx.mem_per_node_mb)
    if ctx.uid is not None:
        env["SLURM_JOB_UID"] = str(ctx.uid)
    if ctx.start_time is not None:
        env["SLURM_JOB_START_TIME"] = str(ctx.start_time)
        if ctx.time_limit_s:
            env["SLURM_JOB_END_TIME"] = str(ctx.start_time + ctx.time_limit_s)
    if ctx.array_task_id is not None:
        low, high, count, step = _array_facts(tuple(ctx.array_indices) or (ctx.array_task_id,))
        env.update({
            "SLURM_ARRAY_JOB_ID": str(ctx.array_job_id if ctx.array_job_id is not None else ctx.job_id),
            "SLURM_ARRAY_TASK_ID": str(ctx.array_task_id),
            "SLURM_ARRAY_TASK_MIN": low, "SLURM_ARRAY_TASK_MAX": high,
            "SLURM_ARRAY_TASK_COUNT": count, "SLURM_ARRAY_TASK_STEP": step,
        })
    return env


def task_environment(ctx: JobContext, node: str, procid: int, step_id: int = 0) -> dict[str, str]:
    """The variables of one srun task: the job's plus its rank, local rank and step."""
    env = job_environment(ctx, node)
    env.update(task_variables(env["SLURM_JOB_NODELIST"], ctx.task_counts, ctx.nodes.index(node),
                              procid, step_id))
    return env
