"""Builders for planner tests: nodes, jobs and snapshots from plain values."""

from __future__ import annotations

from scheduler.planner import JobView, NodeView, Snapshot


def node(name: str, gpus: int = 8, free: int | None = None, **kw) -> NodeView:
    free_n = gpus if free is None else free
    return NodeView(name, gpus, tuple(range(gpus - free_n, gpus)), **kw)


def job(id: int, gpus: int = 1, queue: str = "default", user: str = "alice", **kw) -> JobView:
    kw.setdefault("submit_time", float(id))
    return JobView(id=id, user=user, queue=queue, gpus=gpus, **kw)


def running(id: int, alloc: dict[str, int] | list, start: float = 0.0, gpus: int | None = None,
            **kw) -> JobView:
    """A running job holding `n` GPUs on each named node (GPU indices from 0 up)."""
    if isinstance(alloc, dict):
        allocation = tuple((n, tuple(range(c))) for n, c in alloc.items())
    else:
        allocation = tuple(alloc)
    per_node = gpus if gpus is not None else len(allocation[0][1])
    return job(id, per_node, nodes=len(allocation), start_time=start, allocation=allocation, **kw)


def cluster(nodes, running_jobs=()) -> tuple[NodeView, ...]:
    """The nodes, less the GPUs the running jobs' allocations hold."""
    used: dict[str, set[int]] = {}
    for j in running_jobs:
        for n, g in j.allocation:
            used.setdefault(n, set()).update(g)
    out = []
    for n in nodes:
        free = tuple(g for g in n.free_gpus if g not in used.get(n.name, set()))
        out.append(NodeView(n.name, n.gpus_total, free, n.cpus_total, n.cpus_free, n.mem_total_mb,
                            n.mem_free_mb, n.gpu_model, n.labels, n.schedulable))
    return tuple(out)


def snap(nodes, pending=(), running_jobs=(), **kw) -> Snapshot:
    return Snapshot(cluster(nodes, running_jobs), tuple(pending), tuple(running_jobs), **kw)


def started(d) -> list[int]:
    return [s.job_id for s in d.starts]


def reason(d, job_id: int):
    for w in d.waits:
        if w.job_id == job_id:
            return w.reason
    return None


def wait_of(d, job_id: int):
    return next(w for w in d.waits if w.job_id == job_id)
