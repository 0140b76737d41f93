"""Submissions that arrive together are checked one by one and stored in one transaction, the
single jobs in one INSERT: each gets its own id in the order they came, its own `job.submit`
event, and a refused one changes nothing for the others; on SQLite and PostgreSQL."""

from __future__ import annotations

import asyncio

import pytest
from sqlmodel import select

from scheduler.config import DaemonConfig
from scheduler.daemon import Daemon
from scheduler.daemon.caller import Caller
from scheduler.daemon.errors import DomainError, NotFound
from scheduler.daemon.jobs import JobRequest
from scheduler.models import Event, Job
from tests.conftest import fresh_pg_db

ANN, BO = Caller("ann", "user"), Caller("bo", "user")


@pytest.fixture(params=["sqlite", "postgresql"])
def daemon(request, tmp_path):
    if request.param == "sqlite":
        url = str(tmp_path / "t.db")
    else:
        url = fresh_pg_db(request.getfixturevalue("postgres_url"), "ty_submit_group")
    d = Daemon(DaemonConfig(db=url), tmp_path / "home")
    d.prepare()
    if request.param == "postgresql":  # what campaign() does when the lock is free
        assert d.leadership._try_lock()
        d.leadership._take_office()
        d.leadership.role = "leader"
        d._load_state()  # the configured queues, as on taking office
    yield d
    d.leadership.close()
    d.engine.dispose()


def test_a_group_of_submissions_gets_ids_in_order_and_refusals_stay_their_own(daemon):
    d = daemon
    requests = [
        (ANN, JobRequest(command=["true"], name="a1", gpus=0)),
        (BO, JobRequest(command=["true"], name="b1", gpus=0, queue="nope")),  # refused: no such queue
        (BO, JobRequest(command=["true"], name="b2", gpus=0, env={"X": "1"}, time_limit_s=60)),
        (ANN, JobRequest(command=["true"], name="arr", gpus=0, array="0-2")),  # its tasks need its id
        (ANN, JobRequest(command=["true"], name="a2", gpus=0, hold=True)),
        (BO, JobRequest(command=["true"], name="b3", gpus=0, dependency="afterok:999999")),  # refused
        (BO, JobRequest(command=["true"], name="b4", gpus=0, slurm={"comment": "x"})),
    ]

    async def together():  # one turn of the event loop: one group, one transaction
        return await asyncio.gather(*(d.jobs.submit_grouped(c, r) for c, r in requests),
                                    return_exceptions=True)

    out = asyncio.run(together())
    assert isinstance(out[1], DomainError) and "nope" in str(out[1])
    assert isinstance(out[5], NotFound) and "999999" in str(out[5])
    accepted = [o for o in out if isinstance(o, dict)]
    assert [o["name"] for o in accepted] == ["a1", "b2", "arr", "a2", "b4"]
    ids = [o["id"] for o in accepted]
    assert ids == sorted(ids) and len(set(ids)) == 5
    with d.store.read() as s:
        jobs = {j.id: j for j in s.exec(select(Job)).all()}
        events = s.exec(select(Event).where(Event.action == "job.submit").order_by(Event.id)).all()
    # every row is the one its answer names, the array's tasks after it
    for o in accepted:
        j = jobs[o["id"]]
        assert (j.name, j.user, j.state) == (o["name"], o["user"], "PENDING")
    assert jobs[ids[1]].env == {"X": "1"} and jobs[ids[1]].time_limit_s == 60
    assert jobs[ids[3]].held and not jobs[ids[0]].held
    tasks = sorted(j.id for j in jobs.values() if j.name == "arr")
    assert len(tasks) == 3 and {jobs[t].array_parent for t in tasks} == {ids[2]}
    assert len(jobs) == 4 + 3  # nothing of the refused ones
    # one event per submission, in order, naming its job and its tasks
    assert [(e.target, e.actor, e.detail["tasks"]) for e in events] == [
        (str(ids[0]), "ann", None), (str(ids[1]), "bo", None), (str(ids[2]), "ann", 3),
        (str(ids[3]), "ann", None), (str(ids[4]), "bo", None)]
