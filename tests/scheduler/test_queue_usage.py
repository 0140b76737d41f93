"""`GET /v1/queues`: the GPUs each queue's active jobs hold, summed by the database: a job holds
its GPUs per node on each of its nodes; pending and finished jobs hold none."""

from __future__ import annotations

import pytest

from scheduler import models as m
from scheduler.daemon import Daemon, ManualClock
from scheduler.models import Job, Queue
from tests.conftest import leading_daemon


@pytest.fixture(params=["sqlite", "postgresql"])
def daemon(request, tmp_path):
    clock = ManualClock()
    d = leading_daemon(request, tmp_path, "queue_usage", clock)
    yield d
    d.engine.dispose()


def job(d: Daemon, queue: str, state: str, gpus: int, nodes: list[str], exclusive: bool = False) -> None:
    with d.store.tx() as s:
        j = Job(user="ann", queue=queue, command=["true"], gpus=gpus, nodes=max(1, len(nodes)),
                exclusive=exclusive, submit_time=0.0, eligible_time=0.0,
                start_time=0.0 if nodes else None,
                allocation=[{"node": n, "gpus": list(range(gpus))} for n in nodes])
        s.add(j)
        s.flush()
        if state != m.PENDING:
            d.store.set_state(s, j, state)


def test_each_queue_counts_the_gpus_its_active_jobs_hold(daemon):
    d = daemon
    with d.store.tx() as s:
        s.add(Queue(name="vision", priority=10))
    job(d, "default", m.RUNNING, 4, ["n1", "n2"])  # 2 nodes x 4 GPUs
    job(d, "default", m.CONFIGURING, 1, ["n3"])
    job(d, "default", m.PENDING, 8, [])
    job(d, "default", m.COMPLETED, 8, ["n4"])
    job(d, "vision", m.RUNNING, 8, ["n5"], exclusive=True)
    job(d, "vision", m.RUNNING, 2, ["n6", "n7", "n8"])
    got = {q["name"]: (q["gpus_used"], q["running"], q["pending"]) for q in d.overview.queues()}
    assert got == {"default": (9, 2, 1), "vision": (14, 2, 0)}
