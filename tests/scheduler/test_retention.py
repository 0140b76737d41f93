"""[accounting] purge_jobs_after_days / purge_events_after_days, on SQLite and PostgreSQL: the
leader removes finished jobs and events past their age, a batch per housekeeping tick, and keeps
what must stay (live jobs, jobs a waiting job depends on, the fair-share window, the newest ids)."""

from __future__ import annotations

from collections import Counter

import pytest
from sqlalchemy import func, insert, select

from scheduler import models as m
from scheduler.daemon import ManualClock
from scheduler.daemon.retention import BATCH
from scheduler.models import Event, Job
from scheduler.settings import Settings
from tests.conftest import leading_daemon

NOW = 1_800_000_000.0
DAY = 86400.0


def make(request, tmp_path, name, half_life_days=1.0, **accounting):
    settings = Settings.from_toml({"accounting": accounting,
                                   "scheduler": {"fairshare_half_life": half_life_days * DAY}}, "test")
    return leading_daemon(request, tmp_path, name, ManualClock(NOW), settings=settings)


def job(name, state, end_days=None, start_days=None, **kw):
    end = None if end_days is None else NOW - end_days * DAY
    start = None if start_days is None else NOW - start_days * DAY
    submit = min(t for t in (start, end, NOW - 0.5) if t is not None) - 60
    return Job(name=name, user="ann", queue="default", state=state, submit_time=submit, start_time=start,
               end_time=end, gpus=1, **kw).model_dump(exclude={"id"})


def add(d, rows):
    with d.store.tx() as s:
        s.execute(insert(Job.__table__), rows)
        return {r.name: r.id for r in s.execute(select(Job.__table__.c.id, Job.__table__.c.name))}


def names(d):
    with d.store.read() as s:
        return {r for r in s.execute(select(Job.__table__.c.name)).scalars()}


def purge(d, ticks=50):
    """Housekeeping ticks until the retention has nothing left; the jobs removed by each."""
    removed = []
    for _ in range(ticks):
        before = d.retention.total.jobs + d.retention.total.events
        d.housekeeping(d.clock.time())
        removed.append(d.retention.total.jobs + d.retention.total.events - before)
        if removed[-1] == 0:
            return removed
    raise AssertionError(f"still purging after {ticks} ticks: {removed}")


@pytest.fixture(params=["sqlite", "postgresql"])
def db(request):
    return request


def test_old_finished_jobs_go_and_what_must_stay_stays(db, tmp_path):
    d = make(db, tmp_path, "purge", purge_jobs_after_days=30, purge_events_after_days=7)
    old = [job(f"old{i}", (m.COMPLETED, m.FAILED, m.CANCELLED)[i % 3], end_days=31 + i % 60, start_days=32 + i % 60)
           for i in range(2 * BATCH + 500)]
    ids = add(d, [*old,
                  job("named", m.COMPLETED, end_days=90, start_days=91),  # a waiting job's afterok names it
                  job("recent", m.FAILED, end_days=29, start_days=30),
                  job("edge", m.COMPLETED, end_days=30 - 1 / DAY, start_days=31),
                  job("running", m.RUNNING, start_days=200, allocation=[])])
    add(d, [job("waiting", m.PENDING, dependency=f"afterok:{ids['named']}")])
    with d.store.tx() as s:  # events a day apart, the oldest 20 days old
        s.execute(insert(Event.__table__), [{"time": NOW - k * DAY, "actor": "t", "action": "x", "target": str(k),
                                             "address": "", "detail": {}} for k in range(20, 0, -1)])
        d.store.job_counts(s)  # the leader keeps the finished counts from here on

    removed = purge(d)
    assert max(removed) <= 2 * BATCH and sum(removed) == len(old) + 13  # a batch of each kind per tick
    assert names(d) == {"named", "recent", "edge", "running", "waiting"}
    with d.store.read() as s:
        kept = sorted(int(t) for t in s.execute(select(Event.__table__.c.target).where(
            Event.__table__.c.action == "x")).scalars())
        counted = Counter({(st, q): n for st, q, n in d.store.job_counts(s)})
        in_table = Counter({(st, q): n for st, q, n in s.execute(
            select(Job.__table__.c.state, Job.__table__.c.queue, func.count()).group_by(
                Job.__table__.c.state, Job.__table__.c.queue)).all()})
    assert kept == [1, 2, 3, 4, 5, 6, 7]  # 7 days and younger (the 7-day one is exactly at the edge)
    assert counted == in_table  # the kept counts followed what was removed
    assert purge(d) == [0]  # nothing more, and the next look is an hour away


def test_the_fair_share_window_and_the_newest_ids_stay(db, tmp_path):
    """With a 5-day half-life the ledger reads 50 days back, so a 30-day purge keeps those runs;
    a table of only old jobs keeps its newest, so ids are never handed out twice."""
    d = make(db, tmp_path, "window", half_life_days=5, purge_jobs_after_days=30, purge_events_after_days=1)
    add(d, [job("45 days", m.COMPLETED, end_days=45, start_days=46), job("55 days", m.COMPLETED, end_days=55,
                                                                           start_days=56),
            job("newest", m.COMPLETED, end_days=60, start_days=61)])
    with d.store.tx() as s:
        s.execute(insert(Event.__table__), [{"time": NOW - 9 * DAY, "actor": "t", "action": "x", "target": "",
                                             "address": "", "detail": {}}] * 3)
        top_event = s.execute(select(func.max(Event.__table__.c.id))).scalar()
    purge(d)
    assert names(d) == {"45 days", "newest"}
    with d.store.read() as s:
        assert s.execute(select(Event.__table__.c.id)).scalars().all() == [top_event]
        top_job = s.execute(select(func.max(Job.__table__.c.id))).scalar()
    new = add(d, [job("next", m.PENDING)])["next"]
    assert new > top_job


def test_nothing_is_removed_unless_asked_and_bad_values_are_refused(db, tmp_path):
    d = make(db, tmp_path, "keep")
    add(d, [job("ancient", m.COMPLETED, end_days=3000, start_days=3001), job("x", m.PENDING)])
    d.housekeeping(NOW)
    assert names(d) == {"ancient", "x"} and not d.retention.active
    for bad in (0, -3, "forever"):
        with pytest.raises(ValueError, match="purge_jobs_after_days"):
            Settings.from_toml({"accounting": {"purge_jobs_after_days": bad}}, "test")
