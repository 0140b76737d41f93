"""Task layout: how many of a job's tasks run on each node, and which global ranks they are.

Slurm's default (block) distribution: tasks are spread as evenly as possible, the first nodes
taking one more when the count does not divide, and consecutive ranks share a node. Stdlib
only and free of package imports: the `srun` shim loads this file on the nodes.
"""

from __future__ import annotations

import re

_GROUP = re.compile(r"(\d+)(?:\(x(\d+)\))?")


def tasks_per_node(ntasks: int, nnodes: int) -> list[int]:
    """3 tasks on 2 nodes -> [2, 1]; every node gets at least one task when ntasks >= nnodes."""
    if nnodes < 1 or ntasks < 1:
        raise ValueError(f"need at least one node and one task, got {nnodes} nodes, {ntasks} tasks")
    base, extra = divmod(ntasks, nnodes)
    return [base + (1 if i < extra else 0) for i in range(nnodes)]


def format_tasks_per_node(counts: list[int]) -> str:
    """[4, 4, 2] -> '4(x2),2', as Slurm writes SLURM_TASKS_PER_NODE."""
    out: list[str] = []
    i = 0
    while i < len(counts):
        j = i
        while j + 1 < len(counts) and counts[j + 1] == counts[i]:
            j += 1
        run = j - i + 1
        out.append(f"{counts[i]}(x{run})" if run > 1 else str(counts[i]))
        i = j + 1
    return ",".join(out)


def parse_tasks_per_node(text: str) -> list[int]:
    """'4(x2),2' -> [4, 4, 2]."""
    counts: list[int] = []
    for part in text.split(","):
        m = _GROUP.fullmatch(part.strip())
        if not m:
            raise ValueError(f"cannot read tasks per node {text!r}; expected e.g. 4(x2),2")
        counts.extend([int(m.group(1))] * int(m.group(2) or 1))
    return counts


def ranks_of_node(counts: list[int], node_index: int) -> range:
    """The global task ranks (SLURM_PROCID) that run on node `node_index`, block distribution."""
    first = sum(counts[:node_index])
    return range(first, first + counts[node_index])


def task_variables(nodelist: str, counts: list[int], node_index: int, procid: int,
                   step_id: int) -> dict[str, str]:
    """The SLURM_* variables that differ between the tasks of one srun step. As srun does, the
    step's own size replaces the job's in SLURM_NNODES, SLURM_NODELIST and SLURM_NTASKS (the
    job's stay in SLURM_JOB_NUM_NODES and SLURM_JOB_NODELIST)."""
    ranks = ranks_of_node(counts, node_index)
    if procid not in ranks:
        raise ValueError(f"task {procid} does not run on node {node_index} "
                         f"(its tasks are {ranks.start}-{ranks.stop - 1})")
    per_node = format_tasks_per_node(counts)
    return {
        "SLURM_PROCID": str(procid), "SLURM_LOCALID": str(procid - ranks.start),
        "SLURM_NODEID": str(node_index), "SLURM_STEP_ID": str(step_id), "SLURM_STEPID": str(step_id),
        "SLURM_STEP_NODELIST": nodelist, "SLURM_STEP_NUM_NODES": str(len(counts)),
        "SLURM_STEP_NUM_TASKS": str(sum(counts)), "SLURM_STEP_TASKS_PER_NODE": per_node,
        "SLURM_NTASKS": str(sum(counts)), "SLURM_NPROCS": str(sum(counts)),
        "SLURM_NNODES": str(len(counts)), "SLURM_NODELIST": nodelist,
        "SLURM_TASKS_PER_NODE": per_node, "SLURM_GTIDS": ",".join(map(str, ranks)),
    }
