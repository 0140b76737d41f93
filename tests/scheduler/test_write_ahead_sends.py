"""Write-ahead on the way to the agents: a signal, a preemption notice or a `forget` leaves for a
node only once the change that caused it is committed. Before, a job's end sent `forget` from
inside the transaction that recorded the end: a daemon that died in between had made the agent
delete the job's directory and exit status while its database still said RUNNING, and the next
daemon could only call the job lost.

Each message is checked against what a separate connection reads of the database at the moment
it is sent, on SQLite and on PostgreSQL."""

from __future__ import annotations

import pytest

from scheduler import models as m
from scheduler.daemon import ManualClock
from scheduler.daemon.caller import Caller
from scheduler.daemon.lifecycle import RankExit
from scheduler.models import Job
from tests.conftest import leading_daemon

ADMIN = Caller("root", "admin")


@pytest.fixture(params=["sqlite", "postgresql"])
def daemon(request, tmp_path):
    clock = ManualClock()
    d = leading_daemon(request, tmp_path, "writeahead", clock, kill_grace_s=10.0)
    sent: list[tuple[str, dict, tuple]] = []

    def send(node: str, msg: dict) -> bool:
        job_id = int(str(msg.get("key") or msg.get("keys", ["0"])[0]).split(".")[0])
        with d.store.read() as s:  # another connection: it sees only what is committed
            job = s.get(Job, job_id)
            seen = (job.state, job.kill_reason) if job is not None else None
        sent.append((node, msg, seen))
        return True

    d.links.send = send
    yield d, clock, sent
    d.engine.dispose()


def running(d, clock, nodes: list[str]) -> Job:
    with d.store.tx() as s:
        job = Job(user="ann", queue="default", command=["sleep", "1000"], gpus=1, nodes=len(nodes),
                  submit_time=clock.time(), eligible_time=clock.time(), start_time=clock.time(),
                  allocation=[{"node": n, "gpus": [0]} for n in nodes])
        s.add(job)
        s.flush()
        d.store.set_state(s, job, m.RUNNING)
        job_id, key = job.id, f"{job.id}.{job.attempt}"
    return job_id, key


def test_forget_leaves_only_once_the_jobs_end_is_committed(daemon):
    d, clock, sent = daemon
    job_id, key = running(d, clock, ["n1"])
    d.reconciler.on_exited("n1", key, RankExit(0), clock.time())
    forgets = [(n, seen) for n, msg, seen in sent if msg["op"] == "forget"]
    assert forgets == [("n1", (m.COMPLETED, ""))], sent


def test_a_failed_rank_stops_the_others_only_once_the_failure_is_committed(daemon):
    d, clock, sent = daemon
    job_id, key = running(d, clock, ["n1", "n2", "n3"])
    d.reconciler.on_exited("n2", key, RankExit(3), clock.time())
    signals = [(n, msg["sig"], seen) for n, msg, seen in sent if msg["op"] == "signal"]
    assert signals == [("n1", "TERM", (m.RUNNING, "rank_failed")), ("n3", "TERM", (m.RUNNING, "rank_failed"))]
    sent.clear()
    for n in ("n1", "n3"):
        d.reconciler.on_exited(n, key, RankExit(143), clock.time())
    assert {(n, seen) for n, msg, seen in sent if msg["op"] == "forget"} == \
        {(n, (m.FAILED, "")) for n in ("n1", "n2", "n3")}


def test_cancel_signals_only_once_the_cancel_is_committed(daemon):
    d, clock, sent = daemon
    job_id, key = running(d, clock, ["n1", "n2"])
    d.jobs.act(ADMIN, job_id, "cancel")
    assert [(n, msg["sig"], seen) for n, msg, seen in sent] == \
        [("n1", "TERM", (m.RUNNING, "cancel")), ("n2", "TERM", (m.RUNNING, "cancel"))]
    # the grace period passes: SIGKILL, after the new kill time is committed
    sent.clear()
    clock.advance(11.0)
    with d.store.tx() as s:
        d.lifecycle.enforce_limits(s, clock.time())
    assert [(n, msg["sig"], seen) for n, msg, seen in sent] == \
        [("n1", "KILL", (m.RUNNING, "cancel")), ("n2", "KILL", (m.RUNNING, "cancel"))]


def test_nothing_leaves_when_the_transaction_that_caused_it_rolls_back(daemon):
    d, clock, sent = daemon
    job_id, key = running(d, clock, ["n1", "n2"])
    with pytest.raises(RuntimeError), d.store.tx() as s:
        job = s.get(Job, job_id)
        d.lifecycle.kill(s, job, "cancel")
        raise RuntimeError("the commit never happens")
    assert sent == []
    with d.store.read() as s:
        assert s.get(Job, job_id).kill_reason == ""


def test_the_ends_of_one_tick_reach_each_node_as_one_forget_after_their_commit(daemon):
    """Agent reports that arrive in the same turn of the event loop are committed together; the
    forgets of the jobs they ended go out as one message per node (one SSH packet, not one per
    job), each key's job already ended in the database."""
    import asyncio

    d, clock, sent = daemon
    jobs = {n: [running(d, clock, [n])[1] for _ in range(3)] for n in ("n1", "n2")}

    async def tick():
        for n, keys in jobs.items():
            for key in keys:
                d.reconciler.on_exited(n, key, RankExit(0), clock.time())
        await asyncio.sleep(0)  # the reports' flush runs here, once

    asyncio.run(tick())
    forgets = [(n, msg["keys"]) for n, msg, _ in sent if msg["op"] == "forget"]
    assert sorted(forgets) == sorted(jobs.items())
    with d.store.read() as s:
        for keys in jobs.values():
            for key in keys:
                assert s.get(Job, int(key.split(".")[0])).state == m.COMPLETED
