"""A drained node stays DRAINING while jobs hold it and becomes DRAINED when the last one ends,
whatever the order of drains, resumes, starts and ends (the draining nodes are kept between job
ends, per committed node version)."""

from __future__ import annotations

import asyncio
import random

import pytest
from sqlmodel import select

from scheduler import models as m
from scheduler.daemon import Daemon, ManualClock
from scheduler.daemon.caller import Caller
from scheduler.daemon.lifecycle import RankExit
from scheduler.models import Job, Node
from tests.conftest import leading_daemon

ADMIN = Caller("root", "admin")
NODES = ("n0", "n1", "n2", "n3")


@pytest.fixture(params=["sqlite", "postgresql"])
def daemon(request, tmp_path):
    clock = ManualClock()
    d = leading_daemon(request, tmp_path, "drains", clock)
    d.links.send = lambda node, msg: None
    d.links.connected = lambda name: True  # nodes without agents: their rows are what counts here
    with d.store.tx() as s:
        for n in NODES:
            s.add(Node(name=n, address="127.0.0.1", state=m.UP, gpus_total=8, gpu_indices=list(range(8)),
                       cpus=32, mem_mb=64000))
    yield d, clock
    d.engine.dispose()


def start(d: Daemon, clock: ManualClock, nodes: list[str]) -> None:
    with d.store.tx() as s:
        job = Job(user="ann", queue="default", command=["true"], gpus=1, nodes=len(nodes),
                  submit_time=clock.time(), eligible_time=clock.time(), start_time=clock.time(),
                  allocation=[{"node": n, "gpus": [0]} for n in nodes])
        s.add(job)
        s.flush()
        d.store.set_state(s, job, m.RUNNING)


def states(d: Daemon) -> dict[str, str]:
    with d.store.read() as s:
        return {n.name: n.state for n in s.exec(select(Node)).all()}


def busy(d: Daemon) -> set[str]:
    with d.store.read() as s:
        jobs = s.exec(select(Job).where(Job.state == m.RUNNING)).all()
    return {a["node"] for j in jobs for a in j.allocation}


def test_draining_becomes_drained_exactly_when_the_last_job_on_the_node_ends(daemon):
    d, clock = daemon
    rng = random.Random(13)
    drained: set[str] = set()
    ends = 0
    for step in range(300):
        clock.advance(1)
        op = rng.choice(("start", "start", "end", "end", "drain", "resume", "health"))
        if op == "start":
            up = [n for n in NODES if n not in drained]
            if up:
                start(d, clock, rng.sample(up, rng.randint(1, min(2, len(up)))))
        elif op == "end":
            with d.store.tx() as s:
                running = s.exec(select(Job).where(Job.state == m.RUNNING)).all()
                if running:
                    job = rng.choice(running)
                    d.lifecycle.finish(s, job, {a["node"]: RankExit(0) for a in job.allocation})
                    ends += 1
        elif op in ("drain", "health"):
            name = rng.choice(NODES)
            if op == "drain":
                d.inventory.drain(ADMIN, name, "maintenance")
            else:
                d.inventory.drain_for_health(name, ["gpu 0: XID 79"])
            drained.add(name)
        elif drained:
            name = rng.choice(sorted(drained))
            asyncio.run(d.inventory.resume(ADMIN, name, force=True))
            drained.discard(name)
        now, held = states(d), busy(d)
        for n in NODES:
            want = (m.DRAINING if n in held else m.DRAINED) if n in drained else m.UP
            assert now[n] == want, f"step {step} ({op}): {n} is {now[n]}, should be {want}"
    assert ends > 50 and drained


def test_a_node_drained_and_freed_in_one_transaction_ends_drained(daemon):
    """The kept names are those of committed versions: a transaction that drains a node itself
    (not yet committed) and ends the node's last job in the same breath still settles it."""
    d, clock = daemon
    start(d, clock, ["n1"])
    start(d, clock, ["n2"])
    with d.store.tx() as s:  # a job end elsewhere: the draining nodes are read (none)
        first, job = s.exec(select(Job).order_by(Job.id)).all()
        d.lifecycle.finish(s, first, {"n1": RankExit(0)})
    with d.store.tx() as s:
        job = s.get(Job, job.id)
        d.lifecycle.drain(s, s.get(Node, "n2"), "maintenance", "root")
        d.lifecycle.finish(s, job, {"n2": RankExit(0)})
    assert states(d)["n2"] == m.DRAINED
