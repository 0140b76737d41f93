"""Jobs by (state, queue), as `GET /v1/cluster`, `GET /v1/queues` and `/metrics` show them: the
finished jobs' counts are kept from the committed state changes instead of counting every job
ever run on each call, and after any mix of submissions, starts, ends (some failing, some
retried), cancels, preemptions and requeues of finished jobs they equal a full count."""

from __future__ import annotations

import random

import pytest
from sqlalchemy import func
from sqlmodel import col, select

from scheduler import models as m
from scheduler.daemon import ManualClock
from scheduler.daemon.caller import Caller
from scheduler.daemon.errors import DomainError
from scheduler.daemon.jobs import JobRequest
from scheduler.daemon.lifecycle import RankExit
from scheduler.models import Job, Queue
from tests.conftest import leading_daemon

ADMIN = Caller("root", "admin")


@pytest.fixture(params=["sqlite", "postgresql"])
def daemon(request, tmp_path):
    d = leading_daemon(request, tmp_path, "counts", ManualClock())
    d.links.send = lambda node, msg: None  # no agents: what is committed is what counts here
    with d.store.tx() as s:
        s.add(Queue(name="short", priority=10))
    yield d
    d.engine.dispose()


def full_count(d) -> dict[tuple[str, str], int]:
    with d.store.read() as s:
        rows = s.exec(select(Job.state, Job.queue, func.count()).group_by(Job.state, Job.queue)).all()
    return {(st, q): n for st, q, n in rows}


def kept_count(d) -> dict[tuple[str, str], int]:
    with d.store.read() as s:
        rows = d.store.job_counts(s)
    out: dict[tuple[str, str], int] = {}
    for st, q, n in rows:
        assert (st, q) not in out, f"({st}, {q}) counted twice"
        out[st, q] = n
    return out


def submit(d, rng: random.Random) -> int:
    req = JobRequest(command=["true"], gpus=1, queue=rng.choice(("default", "short")),
                     retries=rng.choice((0, 0, 1)))
    return d.jobs.submit(ADMIN, req)["id"]


def start(d, job_id: int) -> None:
    with d.store.tx() as s:
        job = s.get(Job, job_id)
        job.allocation = [{"node": "n1", "gpus": [0]}]
        job.start_time = d.clock.time()
        d.store.set_state(s, job, m.RUNNING)


def ids_in(d, states) -> list[int]:
    with d.store.read() as s:
        return list(s.exec(select(Job.id).where(col(Job.state).in_(states))).all())


def test_the_kept_counts_equal_a_full_count_after_any_mix_of_changes(daemon):
    d = daemon
    rng = random.Random(7)
    seen: set[str] = set()
    requeued = 0
    for step in range(400):
        if step == 40:
            assert kept_count(d) == full_count(d)  # the first call counts; the rest are kept
        pending, active = ids_in(d, m.WAITING_STATES), ids_in(d, m.ACTIVE_STATES)
        finished = ids_in(d, m.FINAL_STATES)
        op = rng.choice(("submit", "submit", "start", "end", "end", "cancel", "preempt", "requeue"))
        try:
            if op == "submit" or not (pending or active):
                submit(d, rng)
            elif op == "start" and pending:
                start(d, rng.choice(pending))
            elif op == "end" and active:
                with d.store.tx() as s:
                    d.lifecycle.finish(s, s.get(Job, rng.choice(active)),
                                       {"n1": RankExit(rng.choice((0, 0, 1, 137)))})
            elif op == "cancel":
                d.jobs.act(ADMIN, rng.choice(pending + active), "cancel")
            elif op == "preempt" and active:
                with d.store.tx() as s:
                    job = s.get(Job, rng.choice(active))
                    job.kill_grace_s = 0.0
                    d.lifecycle.kill(s, job, "preempt")
            elif op == "requeue" and finished:  # a finished job back to PENDING
                d.jobs.act(ADMIN, rng.choice(finished), "requeue")
                requeued += 1
        except DomainError:
            pass
        for ev in ("end", "preempt"):  # a kill's end comes from the node: end it here
            if op == ev:
                for jid in ids_in(d, m.ACTIVE_STATES):
                    with d.store.read() as s:
                        if s.get(Job, jid).kill_reason and rng.random() < 0.5:
                            with d.store.tx() as tx:
                                d.lifecycle.finish(tx, tx.get(Job, jid), {"n1": RankExit(143)})
        if step > 40 and step % 7 == 0:
            assert kept_count(d) == full_count(d), f"step {step} ({op})"
        seen |= {st for st, _ in full_count(d)}
    assert kept_count(d) == full_count(d)
    assert {m.COMPLETED, m.FAILED, m.CANCELLED, m.PENDING} <= seen and requeued > 10  # the mix reached them
    # what the API shows is built from the same counts
    by_state: dict[str, int] = {}
    for (st, _), n in full_count(d).items():
        by_state[st] = by_state.get(st, 0) + n
    assert d.overview.cluster("test")["jobs_by_state"] == by_state
    queues = {q["name"]: q for q in d.overview.queues()}
    for name in ("default", "short"):
        full = full_count(d)
        assert queues[name]["pending"] == full.get((m.PENDING, name), 0)
        assert queues[name]["running"] == sum(full.get((st, name), 0) for st in m.ACTIVE_STATES)


def test_finished_jobs_are_not_counted_again_until_taking_office_and_a_standby_counts_them(daemon):
    """Rows another daemon wrote (here: behind the kept counts' back) are seen once the counts are
    forgotten, as on taking office; a daemon that does not lead counts in the database."""
    d = daemon
    rng = random.Random(3)
    jid = submit(d, rng)
    start(d, jid)
    with d.store.tx() as s:
        d.lifecycle.finish(s, s.get(Job, jid), {"n1": RankExit(0)})
    queue = full_count(d)
    assert kept_count(d) == queue
    with d.engine.begin() as c:  # another daemon's change, not through this one's commits
        c.execute(Job.__table__.update().where(Job.__table__.c.id == jid).values(state=m.FAILED))
    kept = kept_count(d)
    assert kept != full_count(d), "counted again: the finished jobs' counts are not kept"
    assert kept == queue
    d.store.keeps_counts = lambda: False  # a standby
    assert kept_count(d) == full_count(d)
    d.store.keeps_counts = lambda: True
    d.store.forget_counts()  # taking office
    assert kept_count(d) == full_count(d)
