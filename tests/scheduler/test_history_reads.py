"""The job history on a long-lived cluster: job rows are kept, so `sacct` and `sreport` over a
window, and a page of `GET /v1/jobs` filtered by state, must read that window or that page, not
every job ever run. They answer exactly what a scan of every job would (on SQLite and
PostgreSQL, at the window's edges, with user and state filters and a limit); SQLite's plan for
them reads an index range, never the whole job table nor every job of a state; and a database
made before these indexes existed gets them when the daemon starts."""

from __future__ import annotations

import random

import pytest
from sqlalchemy import insert, inspect, text
from sqlalchemy.dialects import sqlite

from scheduler import models as m
from scheduler.config import DaemonConfig
from scheduler.daemon import Daemon, ManualClock
from scheduler.daemon.accounting import history_query, usage_query
from scheduler.daemon.caller import Caller
from scheduler.daemon.jobs import JobFilter, listing_query
from scheduler.daemon.prediction import warm_up_query
from scheduler.models import Job
from tests.conftest import leading_daemon

NOW = 1_700_000_000.0
DAY = 86400.0
USERS = ("ann", "bob", "cy")
OPERATOR = Caller("root", "operator")


def history(rng: random.Random, n: int = 600) -> list[dict]:
    """Jobs over the last 30 days: finished ones, some ending exactly at a day's boundary or
    submitted exactly at one; live ones (pending, never started; running, no end)."""
    rows = []
    for i in range(n):
        submit = NOW - rng.uniform(0, 30 * DAY)
        kind = rng.random()
        if kind < 0.1:
            state, start, end = m.PENDING, None, None
        elif kind < 0.2:
            state, start, end = m.RUNNING, submit + 5, None
        else:
            state = rng.choice((m.COMPLETED, m.COMPLETED, m.FAILED, m.CANCELLED, m.TIMEOUT))
            start = submit + rng.uniform(0, 3600)
            end = min(NOW - 1, start + rng.uniform(1, 3 * DAY))
            if i % 50 == 0:
                end = NOW - DAY  # ends exactly where the last day's window starts: in it
        if i % 70 == 0:
            submit = NOW  # submitted exactly where the window ends: not in it
            state, start, end = m.PENDING, None, None
        rows.append({"name": f"j{i}", "user": USERS[i % len(USERS)], "queue": "default", "state": state,
                     "command": ["true"], "gpus": 1, "submit_time": submit, "eligible_time": submit,
                     "start_time": start, "end_time": end,
                     "allocation": [{"node": "n1", "gpus": [0]}] if start is not None else []})
    return rows


def expected(rows: list[dict], a: float, b: float, user=None, states=frozenset(), limit=100_000) -> list[str]:
    """What a scan of every job answers."""
    hits = [r["name"] for r in rows
            if r["submit_time"] < b and (r["end_time"] is None or r["end_time"] >= a)
            and (user is None or r["user"] == user) and (not states or r["state"] in states)]
    return hits[:limit]  # inserted in id order


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def daemon(request, tmp_path_factory):
    """One history per database for the module: the tests below only read it."""
    d = leading_daemon(request, tmp_path_factory.mktemp("history"), "history", ManualClock(NOW))
    rows = history(random.Random(13))
    with d.store.tx() as s:
        s.execute(insert(Job.__table__), [Job(**r).model_dump(exclude={"id"}) for r in rows])
    yield d, rows
    d.engine.dispose()


@pytest.mark.parametrize("days", [1, 7, 40])
@pytest.mark.parametrize("user,states", [(None, frozenset()), ("bob", frozenset()),
                                         (None, frozenset({m.FAILED, m.RUNNING})),
                                         ("ann", frozenset({m.COMPLETED}))])
def test_sacct_answers_what_a_scan_of_every_job_would(daemon, days, user, states):
    d, rows = daemon
    a, b = NOW - days * DAY, NOW
    got = [j["name"] for j in d.accounting.jobs(OPERATOR, a, b, user, states)["jobs"]]
    want = expected(rows, a, b, user, states)
    assert got == want
    assert want, "the window holds jobs"
    if len(want) > 3:  # the limit keeps the oldest
        limited = [j["name"] for j in d.accounting.jobs(OPERATOR, a, b, user, states, limit=3)["jobs"]]
        assert limited == want[:3]


def test_sacct_of_a_window_in_the_past_and_a_user_seeing_only_their_own(daemon):
    d, rows = daemon
    a, b = NOW - 20 * DAY, NOW - 18 * DAY
    got = [j["name"] for j in d.accounting.jobs(Caller("cy", "user"), a, b)["jobs"]]
    assert got == expected(rows, a, b, "cy") and got


def test_sreport_counts_the_runs_a_scan_would(daemon):
    d, rows = daemon
    a, b = NOW - 2 * DAY, NOW
    report = d.accounting.report(OPERATOR, "user", a, b)
    runs = {r["user"]: 0.0 for r in rows}
    for r in rows:
        if r["start_time"] is not None and r["start_time"] < b and (r["end_time"] is None or r["end_time"] >= a):
            runs[r["user"]] += (min(b, r["end_time"] or NOW) - max(a, r["start_time"])) / 3600
    got = {row["key"]: row["gpu_hours"] for row in report["rows"]}
    assert got.keys() == {u for u, h in runs.items() if h > 0}
    for u, hours in got.items():
        assert hours == pytest.approx(runs[u], rel=0.01), u


@pytest.mark.parametrize("f", [
    JobFilter(all=True, states=frozenset({m.COMPLETED}), limit=25),
    JobFilter(all=True, states=frozenset({m.FAILED, m.CANCELLED}), limit=10),
    JobFilter(all=True, states=frozenset({m.TIMEOUT}), user="bob", limit=5),
    JobFilter(states=frozenset({m.COMPLETED}), limit=7),
    JobFilter(all=True, limit=30), JobFilter(), JobFilter(queue="default", limit=3),
], ids=lambda f: f"all={f.all}-{'+'.join(sorted(f.states)) or 'any'}-{f.user}-{f.limit}")
def test_a_page_of_the_job_listing_is_what_a_scan_would_answer(daemon, f):
    d, rows = daemon
    live = m.ACTIVE_STATES | m.WAITING_STATES
    want = [r["name"] for r in rows
            if (r["state"] in f.states if f.states else (f.all or r["state"] in live))
            and (f.user is None or r["user"] == f.user) and (f.queue is None or r["queue"] == f.queue)]
    if f.all:
        want.reverse()  # newest first
    got = [j["name"] for j in d.jobs.list(OPERATOR, f)]
    assert got == want[:f.limit] and got


def test_a_listing_by_ids_finds_those_jobs_in_any_state(daemon):
    d, rows = daemon
    names = {i + 1: r["name"] for i, r in enumerate(rows)}  # ids in insertion order
    chosen = frozenset({1, 77, 300, len(rows)})
    got = [j["name"] for j in d.jobs.list(OPERATOR, JobFilter(ids=chosen, limit=10))]
    assert got == [names[i] for i in sorted(chosen)]
    state = rows[76]["state"]
    got = [j["id"] for j in d.jobs.list(OPERATOR, JobFilter(ids=chosen, states=frozenset({state})))]
    assert got == sorted(i for i in chosen if rows[i - 1]["state"] == state) and 77 in got


def _plan(d, q) -> str:
    sql = str(q.compile(dialect=sqlite.dialect(), compile_kwargs={"literal_binds": True}))
    with d.engine.connect() as c:
        return "\n".join(str(r[-1]) for r in c.execute(text("EXPLAIN QUERY PLAN " + sql)))


@pytest.mark.parametrize("user,states", [(None, frozenset()), ("bob", frozenset()),
                                         (None, frozenset({m.COMPLETED})), ("ann", frozenset({m.FAILED}))])
def test_sqlite_reads_the_window_not_every_job(tmp_path, user, states):
    """A full scan of the job table is what a long-lived cluster cannot afford on each sacct:
    with 500,000 finished jobs it was 95 ms of the daemon's loop for a day's 1,800 jobs."""
    d = Daemon(DaemonConfig(db=str(tmp_path / "t.db")), tmp_path / "home", ManualClock(NOW))
    d.prepare()
    for q in (history_query(NOW - DAY, NOW, user, states), usage_query(NOW - DAY, NOW)):
        plan = _plan(d, q)
        assert "SCAN job" not in plan, plan
        assert "ix_job_end_time" in plan, plan
        assert "ix_job_state_queue" not in plan, plan  # every job of a state ever run
    d.engine.dispose()


def test_sqlite_warms_the_run_time_predictions_up_from_the_newest_ends_only(tmp_path):
    """A new leader learns run times from the last finished jobs: the end_time index, read
    backwards, not every finished job ever run sorted by its end."""
    d = Daemon(DaemonConfig(db=str(tmp_path / "t.db")), tmp_path / "home", ManualClock(NOW))
    d.prepare()
    plan = _plan(d, warm_up_query(50_000))
    assert plan == "SEARCH job USING INDEX ix_job_end_time (end_time>?)", plan
    d.engine.dispose()


def test_the_warm_up_learns_the_newest_finished_runs(daemon):
    d, rows = daemon
    learned = d.prediction.warm_up()
    ran = [r for r in rows if r["state"] in (m.COMPLETED, m.FAILED, m.CANCELLED, m.TIMEOUT) and r["start_time"]]
    assert learned == len(ran)
    d.prediction.warm_up_jobs = 10
    try:
        assert d.prediction.warm_up() == 10
    finally:
        d.prediction.warm_up_jobs = len(rows)
        d.prediction.warm_up()


@pytest.mark.parametrize("states", [{m.COMPLETED}, {m.FAILED, m.CANCELLED, m.TIMEOUT}])
def test_sqlite_reads_a_page_of_a_final_state_not_every_job_of_it(tmp_path, states):
    d = Daemon(DaemonConfig(db=str(tmp_path / "t.db")), tmp_path / "home", ManualClock(NOW))
    d.prepare()
    plan = _plan(d, listing_query(JobFilter(ids=frozenset({3, 5}), states=frozenset(states))))
    assert "SCAN job" not in plan and "ix_job_array_parent" in plan, plan  # the ids lead
    for f in (JobFilter(all=True, states=frozenset(states), limit=100),
              JobFilter(states=frozenset(states), limit=100)):
        plan = _plan(d, listing_query(f))
        assert "SCAN job" not in plan, plan
        assert "ix_job_state_id" in plan, plan
        assert "ix_job_state_queue" not in plan, plan  # every job of those states, then sorted
    d.engine.dispose()


def test_a_database_made_before_the_index_gets_it_at_start(tmp_path):
    db = tmp_path / "t.db"
    d = Daemon(DaemonConfig(db=str(db)), tmp_path / "home", ManualClock(NOW))
    d.prepare()
    rows = history(random.Random(5), 200)
    with d.store.tx() as s:
        s.execute(insert(Job.__table__), [Job(**r).model_dump(exclude={"id"}) for r in rows])
        s.execute(text("DROP INDEX ix_job_end_time"))  # as an older trainyard made it
        s.execute(text("DROP INDEX ix_job_state_id"))
        s.execute(text("DROP INDEX ix_job_array_parent"))
    d.engine.dispose()
    d.leadership.close()  # the SQLite file's one-daemon lock

    again = Daemon(DaemonConfig(db=str(db)), tmp_path / "home2", ManualClock(NOW))
    again.prepare()
    with again.engine.connect() as c:
        have = {ix["name"] for ix in inspect(c).get_indexes("job")}
        assert {"ix_job_end_time", "ix_job_state_id", "ix_job_array_parent"} <= have
    a = NOW - 3 * DAY
    got = [j["name"] for j in again.accounting.jobs(OPERATOR, a, NOW)["jobs"]]
    assert got == expected(rows, a, NOW) and got
    again.engine.dispose()
