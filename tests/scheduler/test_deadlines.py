"""Housekeeping keeps each active job's next deadline (time limit, --signal before it, SIGKILL at
the end of a kill's grace) between ticks instead of scanning every active job: after any mix of
starts, ends, limit changes, cancels, preemptions, requeues and signals, every tick acts on
exactly the jobs a full scan of the active jobs finds due."""

from __future__ import annotations

import random

import pytest
from sqlalchemy import func, or_
from sqlmodel import col, select

from scheduler import models as m
from scheduler.daemon import Daemon, ManualClock
from scheduler.daemon.caller import Caller
from scheduler.daemon.errors import DomainError
from scheduler.daemon.lifecycle import RankExit, signal_spec
from scheduler.models import Event, Job
from tests.conftest import leading_daemon

ADMIN = Caller("root", "admin")
GRACE = 10.0


@pytest.fixture(params=["sqlite", "postgresql"])
def daemon(request, tmp_path):
    """The same daemon code on SQLite and on PostgreSQL (the deadlines are worked out in SQL)."""
    clock = ManualClock()
    d = leading_daemon(request, tmp_path, "deadlines", clock, kill_grace_s=GRACE)
    d.links.send = lambda node, msg: None  # no agents: what is committed is what counts here
    yield d, clock
    d.engine.dispose()


def full_scan_due(d: Daemon, now: float) -> set[int]:
    """What a tick acted on before deadlines were kept: every active job, scanned."""
    t = Job.__table__.c
    grace = func.coalesce(t.kill_grace_s, GRACE)
    waiting = (t.kill_reason == "") & t.start_time.is_not(None) & t.time_limit_s.is_not(None)
    with d.store.read() as s:
        rows = s.exec(select(Job).where(col(Job.state).in_(m.ACTIVE_STATES), or_(
            (t.kill_reason != "") & (t.kill_time + grace < now),
            waiting & (t.start_time + t.time_limit_s < now),
            waiting & t.signal_time.is_(None) & (t.signal != "")))).all()
        out = set()
        for j in rows:  # the Python checks that follow the query in enforce_limits
            if j.kill_reason or (j.time_limit_s and now - j.start_time > j.time_limit_s):
                out.add(j.id)
            elif j.time_limit_s and j.signal_time is None:
                spec = signal_spec(j)
                if spec is not None and now >= j.start_time + j.time_limit_s - spec.seconds:
                    out.add(j.id)
        return out


def snapshot(d: Daemon) -> dict[int, tuple]:
    with d.store.read() as s:
        return {j.id: (j.state, j.kill_reason, j.kill_time, j.signal_time)
                for j in s.exec(select(Job)).all()}


def running_job(d: Daemon, clock: ManualClock, rng: random.Random, **fixed) -> int:
    with d.store.tx() as s:
        job = Job(user="ann", queue="default", command=["sleep", "1000"], gpus=1,
                  time_limit_s=fixed.get("limit", rng.choice((None, 0, 30, 60, 300))),
                  signal=fixed.get("signal", rng.choice(("", "", "USR1@20", "B:USR2@5", "TERM@100"))),
                  submit_time=clock.time(), eligible_time=clock.time(), start_time=clock.time(),
                  allocation=[{"node": "n1", "gpus": [0]}])
        s.add(job)
        s.flush()
        d.store.set_state(s, job, m.RUNNING)
        return job.id


def test_every_tick_acts_on_what_a_full_scan_finds_due(daemon):
    d, clock = daemon
    rng = random.Random(11)
    ids: list[int] = []
    acted = 0
    for step in range(600):
        clock.advance(rng.choice((0.0, 0.5, 1, 3, 7, 15)))
        op = rng.choice(("start", "start", "end", "limit", "cancel", "preempt", "requeue", "tick", "tick"))
        with d.store.read() as s:
            active = [j.id for j in s.exec(select(Job).where(col(Job.state).in_(m.ACTIVE_STATES)))]
        try:
            if op == "start" or not active:
                ids.append(running_job(d, clock, rng))
            elif op == "end":
                with d.store.tx() as s:
                    d.lifecycle.finish(s, s.get(Job, rng.choice(active)), {"n1": RankExit(0)})
            elif op == "limit":
                d.jobs.set_time_limit(ADMIN, rng.choice(active), rng.choice((20, 90, 600)))
            elif op == "cancel":
                d.jobs.act(ADMIN, rng.choice(active), "cancel")
            elif op == "preempt":
                with d.store.tx() as s:
                    job = s.get(Job, rng.choice(active))
                    job.kill_grace_s = rng.choice((None, 0.0, 30.0))
                    d.lifecycle.kill(s, job, "preempt")
            elif op == "requeue":
                with d.store.tx() as s:
                    job = s.get(Job, rng.choice(active))
                    d.lifecycle.requeue(s, job, "requeued")
        except DomainError:
            pass
        if op == "tick" or step % 5 == 0:
            now = clock.time()
            expected = full_scan_due(d, now)
            before = snapshot(d)
            d.housekeeping(now)
            after = snapshot(d)
            changed = {jid for jid in after if after[jid] != before.get(jid)}
            assert changed == expected, f"step {step} ({op}): acted on {sorted(changed)}, due {sorted(expected)}"
            acted += len(changed)
    with d.store.read() as s:
        kinds = {e.action for e in s.exec(select(Event)).all()}
    assert {"job.timeout", "job.signal"} <= kinds and acted > 40  # the mix reached every kind


def test_taking_office_reads_every_deadline_again(daemon):
    """Rows another daemon wrote (here: written behind the kept deadlines' back) are seen once
    the deadlines are forgotten, as on taking office."""
    d, clock = daemon
    jid = running_job(d, clock, random.Random(3), limit=300, signal="")
    d.housekeeping(clock.time())
    d.store.take_deadline_changes()  # as if the change below came from another daemon
    with d.engine.begin() as c:
        c.execute(Job.__table__.update().where(Job.__table__.c.id == jid)
                  .values(time_limit_s=5))
    d.store.take_deadline_changes()
    clock.advance(6)
    d.housekeeping(clock.time())
    assert snapshot(d)[jid][1] == "", "not seen: the kept deadline is what a tick looks at"
    d.lifecycle.deadlines.forget()
    d.housekeeping(clock.time())
    assert snapshot(d)[jid][1] == "timeout"


def test_a_thousand_jobs_reaching_their_limit_together_all_stop_in_one_tick(daemon):
    d, clock = daemon
    rng = random.Random(5)
    ids = [running_job(d, clock, rng, limit=60, signal="") for _ in range(1200)]
    d.housekeeping(clock.time())
    clock.advance(61)
    d.housekeeping(clock.time())
    states = snapshot(d)
    assert {states[j][1] for j in ids} == {"timeout"}
