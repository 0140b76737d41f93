"""Events are written with the transaction that records them, in one statement, and published
after the commit with the ids the database gave them, in order, on SQLite and PostgreSQL."""

from __future__ import annotations

import pytest
from sqlmodel import select

from scheduler.daemon.clock import Clock
from scheduler.daemon.state import StateStore
from scheduler.models import Event, Job
from scheduler.store import init_schema, make_engine
from tests.conftest import fresh_pg_db


@pytest.fixture(params=["sqlite", "postgresql"])
def store(request, tmp_path):
    if request.param == "sqlite":
        url = str(tmp_path / "t.db")
    else:
        url = fresh_pg_db(request.getfixturevalue("postgres_url"), "ty_events")
    engine = make_engine(url)
    init_schema(engine)
    yield StateStore(engine, Clock())
    engine.dispose()


def stored(st: StateStore) -> list[tuple]:
    with st.read() as s:
        return [(e.id, e.action, e.target, e.detail) for e in s.exec(select(Event).order_by(Event.id)).all()]


def test_a_transactions_events_get_their_rows_ids_in_order_and_are_published_after_it(store):
    q = store.subscribe()
    with store.tx() as s:
        job = Job(user="ann", state="PENDING")
        s.add(job)
        s.flush()
        for state in ("CONFIGURING", "RUNNING", "COMPLETED"):
            store.set_state(s, job, state, reason=f"to {state}")
        store.record(s, "ann", "job.note", str(job.id), {"text": "café ✓", "n": [1, 2]})
        assert q.empty()  # nothing is published before the commit
    published = [q.get_nowait() for _ in range(q.qsize())]
    rows = stored(store)
    assert [(e["id"], e["action"], e["target"], e["detail"]) for e in published] == rows
    assert [r[3].get("state") for r in rows[:3]] == ["CONFIGURING", "RUNNING", "COMPLETED"]
    assert rows[3][3] == {"text": "café ✓", "n": [1, 2]}
    assert [r[0] for r in rows] == sorted({r[0] for r in rows})  # distinct and increasing
    # a single event in a transaction of its own
    store.audit("bob", "node.drain", "n1", {"why": "maintenance"})
    (last,) = [q.get_nowait() for _ in range(q.qsize())]
    assert (last["id"], last["action"]) == (stored(store)[-1][0], "node.drain") and last["id"] > rows[-1][0]


def test_a_transaction_that_fails_writes_and_publishes_no_event(store):
    q = store.subscribe()
    with pytest.raises(RuntimeError), store.tx() as s:
        store.record(s, "ann", "job.submit", "1", {})
        store.record(s, "ann", "job.submit", "2", {})
        raise RuntimeError("refused half-way")
    assert stored(store) == [] and q.empty()
