"""What a watching client reads on a busy cluster: the job listing and the teams, as the TUI asks
for them on every refresh. The listing reads only the columns it shows and is built off the
event loop (a submission is answered while a page is being read); the teams' counts come from
the database's counts, not every waiting job's row. Each answers what a read of every job's full
row would (SQLite and PostgreSQL)."""

from __future__ import annotations

import asyncio
import contextlib
import random
import threading

import httpx
import pytest
from sqlalchemy import insert
from sqlmodel import select

from scheduler import models as m
from scheduler.api.app import create_app
from scheduler.daemon import ManualClock
from scheduler.daemon.caller import Caller
from scheduler.daemon.jobs import JobFilter
from scheduler.daemon.prediction import prediction_json
from scheduler.daemon.views import job_json
from scheduler.models import Event, Job
from scheduler.settings import Settings
from tests.conftest import leading_daemon

NOW = 1_700_000_000.0
TEAMS = {"teams": {"vision": {"nominal_gpus": 8, "users": ["ann"]},
                   "speech": {"nominal_gpus": 4, "users": ["bob"]}}}
OPERATOR = Caller("root", "operator")


def varied_jobs(rng: random.Random, n: int) -> list[dict]:
    """Jobs with every kind of field a listing shows: scripts (long ones), environments,
    allocations, constraints, arrays, containers, Slurm's options."""
    rows = []
    for i in range(n):
        state = rng.choice([m.PENDING, m.PENDING, m.RUNNING, m.CONFIGURING, m.COMPLETED, m.FAILED])
        active = state in m.ACTIVE_STATES
        nodes = rng.choice([1, 1, 2])
        rows.append({
            "name": f"job-{i}", "user": rng.choice(["ann", "bob", "cy"]), "queue": "default",
            "state": state, "reason": "Priority" if state == m.PENDING else "",
            "held": "user" if state == m.PENDING and rng.random() < 0.2 else "",
            "command": ["python", "train.py", f"--seed={i}"],
            "script": None if rng.random() < 0.5 else "#!/bin/bash\n#SBATCH --gres=gpu:1\n" + "x" * rng.randint(0, 5000),
            "gpus": rng.choice([1, 2, 4]), "nodes": nodes, "priority": rng.randint(0, 100),
            "account": rng.choice(["", "", "speech", "robotics"]),
            "env": {"WANDB_API_KEY": f"secret-{i}", "OMP_NUM_THREADS": "4"},
            "constraint": {"gpu_model": "H100"} if rng.random() < 0.3 else {},
            "submit_time": NOW - 1000 + i, "start_time": NOW - 500 + i if active else None,
            "allocation": [{"node": f"n{k}", "gpus": [0, 1]} for k in range(nodes)] if active else [],
            "array_parent": 7 if rng.random() < 0.2 else None, "array_task_id": i if rng.random() < 0.2 else None,
            "features": "a100&ib" if rng.random() < 0.2 else "", "mail_type": ["END"] if rng.random() < 0.2 else [],
            "mail_user": "ann@example.org" if rng.random() < 0.2 else "",
            "image": "registry.local/pytorch:2.4" if rng.random() < 0.2 else "",
            "container_mounts": ["/data:/data"] if rng.random() < 0.2 else [],
            "recorded": {"ntasks": "2"} if rng.random() < 0.2 else {},
            "predicted_runtime_s": rng.choice([None, 3600.0]), "prediction_basis": rng.choice(["", "user"]),
            "estimated_start": NOW + 60 if state == m.PENDING and rng.random() < 0.5 else None,
            "comment": "tuning run" if rng.random() < 0.2 else "", "wckey": "w", "export": "ALL",
            "submit_dir": "/home/ann/project", "kill_reason": "", "notify_url": "https://hooks.example.org/x",
        })
    return rows


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def daemon(request, tmp_path_factory):
    # pages on the read threads (read_processes = 0), where a test can hold one mid-read;
    # tests/scheduler/test_reader_processes.py reads them in reader processes
    d = leading_daemon(request, tmp_path_factory.mktemp("busy"), "busy", ManualClock(NOW),
                       settings=Settings.from_toml(TEAMS), read_processes=0)
    with d.store.tx() as s:
        s.execute(insert(Job.__table__), [Job(**r).model_dump(exclude={"id"}) for r in varied_jobs(random.Random(5), 300)])
    yield d
    d.engine.dispose()


@pytest.mark.parametrize("viewer", [OPERATOR, Caller("ann", "user")], ids=["operator", "ann"])
def test_the_listing_shows_what_each_job_s_full_row_says(daemon, viewer):
    uses = daemon.policy.backfill_on_prediction
    with daemon.store.read() as s:
        want = {j.id: {**job_json(j, viewer), **prediction_json(j, uses)} for j in s.exec(select(Job)).all()}
    got = daemon.jobs.list(viewer, JobFilter(all=True, limit=100_000))
    assert len(got) == len(want) == 300
    for j in got:
        assert j == want[j["id"]], j["id"]
    scripted = [j for j in got if j["script"]]
    assert scripted and len(scripted) < len(got)
    hidden = [j for j in got if j["user"] != "ann"]
    if viewer.user == "ann":  # another user's environment: the names, not the values
        assert all(j["env"] == {"WANDB_API_KEY": None, "OMP_NUM_THREADS": None} for j in hidden)


def test_teams_count_what_every_job_s_row_says(daemon):
    policy = daemon.policy
    with daemon.store.read() as s:
        jobs = s.exec(select(Job).where(Job.state.in_(m.ACTIVE_STATES | m.WAITING_STATES))).all()
    want: dict[str, dict] = {}
    for j in jobs:
        team = j.account or policy.user_team.get(j.user, "default")
        t = want.setdefault(team, {"running": 0, "pending": 0, "gpus_used": 0})
        if j.state in m.ACTIVE_STATES:
            t["running"] += 1
            t["gpus_used"] += j.gpus * len(j.allocation)
        else:
            t["pending"] += 1
    got = {t["name"]: t for t in daemon.overview.teams()}
    assert set(got) == set(want) | {"vision", "speech", "default"}
    for name, t in got.items():
        w = want.get(name, {"running": 0, "pending": 0, "gpus_used": 0})
        assert (t["running"], t["pending"], t["gpus_used"]) == (w["running"], w["pending"], w["gpus_used"]), name
    assert got["robotics"]["pending"] and got["vision"]["nominal_gpus"] == 8 and got["vision"]["users"] == ["ann"]


def test_a_submission_is_answered_while_a_page_of_jobs_is_being_read(daemon, monkeypatch):
    """The listing runs on the daemon's read threads: with one held mid-read, a submission over
    the API still gets its answer, and the page then answers (with the new job on it)."""
    reading, release = threading.Event(), threading.Event()
    listed = daemon.jobs.list

    def held_list(caller, f):
        reading.set()
        assert release.wait(10), "the test never let the read go on"
        return listed(caller, f)

    monkeypatch.setattr(daemon.jobs, "list", held_list)
    token = daemon.create_token("root", "admin", "test")

    async def scenario():
        transport = httpx.ASGITransport(app=create_app(daemon))
        headers = {"Authorization": f"Bearer {token}"}
        async with httpx.AsyncClient(transport=transport, base_url="http://t", headers=headers) as c:
            page = asyncio.create_task(c.get("/v1/jobs", params={"limit": 100_000}))
            for _ in range(1000):
                if reading.is_set():
                    break
                await asyncio.sleep(0.01)
            assert reading.is_set(), "the page was never read on a read thread"
            r = await asyncio.wait_for(c.post("/v1/jobs", json={"command": ["true"], "hold": True}), 10)
            assert not page.done(), "the page answered before its read went on"
            release.set()
            return r, await page

    sub, page = asyncio.run(scenario())
    assert sub.status_code == 201, sub.text
    assert page.status_code == 200 and sub.json()["id"] in {j["id"] for j in page.json()}


def test_an_event_committed_while_a_stream_s_backlog_is_read_is_sent_once(daemon, monkeypatch):
    """A stream's backlog is read off the event loop, so commits go on meanwhile: the stream is
    subscribed before the read, and an event committed during it is sent, once."""
    reading, release = threading.Event(), threading.Event()
    read = daemon.overview.events

    def held_events(since, limit):
        got = read(since, limit)  # the backlog as of now; the commit below comes after it
        reading.set()
        assert release.wait(10), "the test never let the read go on"
        return got

    monkeypatch.setattr(daemon.overview, "events", held_events)
    token = daemon.create_token("root", "admin", "test")
    with daemon.store.read() as s:
        since = max([e.id for e in s.exec(select(Event)).all()] or [0])
    app = create_app(daemon)
    body: list[bytes] = []

    async def receive():
        await asyncio.sleep(3600)  # the client sends nothing more and stays
        return {"type": "http.disconnect"}

    async def send(message):
        if message["type"] == "http.response.body":
            body.append(message.get("body", b""))

    async def scenario():
        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "GET",
                 "scheme": "http", "path": "/v1/events", "raw_path": b"/v1/events", "root_path": "",
                 "query_string": f"since={since}&stream=true".encode(), "client": ("127.0.0.1", 1),
                 "server": ("127.0.0.1", 80), "headers": [(b"authorization", f"Bearer {token}".encode())]}
        call = asyncio.create_task(app(scope, receive, send))
        while not reading.is_set():
            await asyncio.sleep(0.01)
        with daemon.store.tx() as s:
            daemon.store.record(s, "root", "test.during", "the-read", {})
        release.set()
        for _ in range(500):
            if b"test.during" in b"".join(body):
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)  # a second copy would have followed by now
        call.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await call

    asyncio.run(scenario())
    assert b"".join(body).count(b"event: test.during\n") == 1
