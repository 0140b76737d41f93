"""Job listings and sacct windows built in reader processes: the page is the one the daemon's
own threads build, for every viewer and encoding; a reader that dies costs no page; the readers end with the
daemon, whether it stops or is killed (SQLite and PostgreSQL)."""

from __future__ import annotations

import asyncio
import gzip
import json
import os
import random
import signal
import subprocess
import time

import pytest
from sqlalchemy import insert
from sqlmodel import func, select

from scheduler.daemon import JobFilter, ManualClock
from scheduler.daemon.caller import Caller
from scheduler.daemon.readers import READER_FROM, ReaderProcesses
from scheduler.daemon.views import encoded
from scheduler.models import Event, Job
from scheduler.settings import Settings
from tests.conftest import leading_daemon, wait_for
from tests.scheduler.test_busy_reads import NOW, TEAMS, varied_jobs

OPERATOR = Caller("root", "operator")
EVENTS = 1200  # audit events in the module's database
ANN = Caller("ann", "user")


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def daemon(request, tmp_path_factory):
    d = leading_daemon(request, tmp_path_factory.mktemp("readers"), "readers", ManualClock(NOW),
                       settings=Settings.from_toml(TEAMS), read_processes=2)
    with d.store.tx() as s:
        s.execute(insert(Job.__table__), [Job(**r).model_dump(exclude={"id"})
                                          for r in varied_jobs(random.Random(11), 400)])
        base = s.exec(select(func.max(Event.id))).one() or 0
        s.execute(insert(Event.__table__), [
            {"time": NOW + i / 7, "actor": ("ann", "bob", "trainyard")[i % 3], "action": "job.state",
             "target": str(i), "address": "" if i % 2 else "10.0.0.7",
             "detail": {"state": "RUNNING", "note": "ünïcode \"quoted\"\n", "n": i, "nested": {"x": [i, None]}}}
            for i in range(EVENTS)])
    d.first_event = base + 1
    ready(d)
    yield d
    d.readers.stop()
    d.engine.dispose()


def ready(d) -> None:
    d.readers.start()
    wait_for(lambda: d.readers.ready, 30, what="the reader processes to start")


def decoded(body: bytes, gzipped: bool) -> list[dict]:
    return json.loads(gzip.decompress(body) if gzipped else body)


@pytest.mark.parametrize("viewer", [OPERATOR, ANN], ids=["operator", "ann"])
@pytest.mark.parametrize("accept", ["gzip", None], ids=["gzip", "plain"])
@pytest.mark.parametrize("f", [JobFilter(all=True, limit=100_000), JobFilter(limit=50),
                               JobFilter(all=True, user="bob", limit=100_000)], ids=["all", "page", "bob"])
def test_a_reader_process_builds_the_page_the_daemon_would(daemon, viewer, accept, f):
    served = daemon.readers.served
    body, gzipped = asyncio.run(daemon.job_page(viewer, f, accept))
    # a reader built a long page; a short one (limit under READER_FROM) a read thread
    assert daemon.readers.served == served + (f.limit >= READER_FROM)
    want = daemon.jobs.list(viewer, f)  # in this process, as the read threads would
    assert gzipped == (accept == "gzip" and len(encoded(want, None)[0]) >= 16 * 1024)
    assert decoded(body, gzipped) == json.loads(json.dumps(want))
    if viewer is ANN:  # the hidden environments stay hidden when a reader builds the page
        others = [j for j in decoded(body, gzipped) if j["user"] != "ann"]
        assert others and all(set(j["env"].values()) <= {None} for j in others)


@pytest.mark.parametrize("viewer", [OPERATOR, ANN], ids=["operator", "ann"])
@pytest.mark.parametrize("accept", ["gzip", None], ids=["gzip", "plain"])
def test_a_reader_process_answers_sacct_as_the_daemon_would(daemon, viewer, accept):
    q = daemon.accounting.sacct(viewer, None, None)  # the last day, as `trainyard sacct` asks
    served = daemon.readers.served
    got = decoded(*asyncio.run(daemon.sacct_page(viewer, q, accept)))
    assert daemon.readers.served == served + 1  # a window is read in a reader
    want = daemon.accounting.jobs(viewer, None, None)  # in this process, as a read thread would
    assert got == json.loads(json.dumps(want))
    jobs = got["jobs"]
    assert len(jobs) == (400 if viewer is OPERATOR else sum(1 for j in jobs if j["user"] == "ann")) > 0
    # a job that names no account is charged to its user's team in the configuration
    assert {j["account"] for j in jobs if j["user"] == "ann"} >= {"vision"}
    if viewer is OPERATOR:
        assert {j["account"] for j in jobs if j["user"] == "bob"} >= {"speech"}
        assert {j["account"] for j in jobs if j["user"] == "cy"} >= {"default"}


@pytest.mark.parametrize("accept", ["gzip", None], ids=["gzip", "plain"])
@pytest.mark.parametrize("since,limit", [(None, 10_000), (0, 10_000), ("mid", 700), (None, 50)],
                         ids=["newest-all", "from-start", "from-an-id", "short"])
def test_a_reader_process_builds_the_event_page_the_daemon_would(daemon, accept, since, limit):
    after = daemon.first_event + 500 if since == "mid" else since
    served = daemon.readers.served
    got = decoded(*asyncio.run(daemon.event_page(ANN, after, limit, accept)))
    assert daemon.readers.served == served + (limit >= READER_FROM)  # a short page: a read thread
    assert got == json.loads(json.dumps(daemon.overview.events(after, limit)))  # as a read thread
    ids = [e["id"] for e in got if e["id"] >= daemon.first_event]
    last = daemon.first_event + EVENTS - 1
    if after is None:  # the newest `limit`, oldest first
        assert [e["id"] for e in got][-len(ids):] == list(range(max(daemon.first_event, last - limit + 1), last + 1))
    else:
        assert ids == list(range(max(after + 1, daemon.first_event), min(last, after + limit) + 1))
    for e in got[-3:]:  # every field as stored, through the process and the encoding
        n = e["id"] - daemon.first_event
        assert e["detail"] == {"state": "RUNNING", "note": "ünïcode \"quoted\"\n", "n": n, "nested": {"x": [n, None]}}
        assert (e["actor"], e["target"], e["time"]) == (("ann", "bob", "trainyard")[n % 3], str(n), NOW + n / 7)


def test_sacct_of_named_jobs_is_read_on_a_thread(daemon):
    q = daemon.accounting.sacct(OPERATOR, None, None, ids=frozenset({3, 5}))
    served = daemon.readers.served
    got = decoded(*asyncio.run(daemon.sacct_page(OPERATOR, q, None)))
    assert daemon.readers.served == served  # a few named jobs: not worth a process
    assert {j["id"] for j in got["jobs"]} == {3, 5}


def test_a_reader_that_dies_costs_no_page(daemon):
    every = JobFilter(all=True, limit=100_000)
    first = asyncio.run(daemon.job_page(OPERATOR, every, None))
    dead = daemon.readers._pool
    for pid in list(dead._processes):
        os.kill(pid, signal.SIGKILL)
    time.sleep(0.2)
    during = asyncio.run(daemon.job_page(OPERATOR, every, None))  # on a thread
    ready(daemon)  # new readers
    served = daemon.readers.served
    after = asyncio.run(daemon.job_page(OPERATOR, every, None))
    assert decoded(*first) == decoded(*during) == decoded(*after)
    assert len(decoded(*first)) == 400
    assert daemon.readers._pool is not dead and daemon.readers.served == served + 1


def descendants(pid: int) -> set[int]:
    out = subprocess.run(["ps", "-e", "-o", "pid=,ppid="], capture_output=True, text=True).stdout
    children: dict[int, list[int]] = {}
    for line in out.splitlines():
        p, pp = map(int, line.split())
        children.setdefault(pp, []).append(p)
    found, todo = set(), [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            found.add(c)
            todo.append(c)
    return found


def alive(pids: set[int]) -> set[int]:
    left = set()
    for p in pids:
        try:
            with open(f"/proc/{p}/stat") as f:
                if f.read().rpartition(")")[2].split()[0] != "Z":
                    left.add(p)
        except FileNotFoundError:
            pass
    return left


@pytest.mark.parametrize("how", ["stop", "kill -9"])
def test_the_readers_end_with_the_daemon(daemon_factory, how):
    d = daemon_factory(sub=how.replace(" ", ""))
    d.cli("submit", "--hold", "--array", "0-1999", "--", "true", check=True)
    # a page of 2,000 jobs costs a thread well over READERS_WORTH_S: it starts the readers
    assert len(d.client().jobs(all=True)) >= 2000
    wait_for(lambda: len(descendants(d.proc.pid)) >= 2, 30, what="the fork server and a reader")
    readers = descendants(d.proc.pid)
    if how == "stop":
        d.stop()
    else:
        d.kill9()
    wait_for(lambda: not alive(readers), 20, what=f"the readers to end after the daemon's {how}")


def test_cheap_pages_start_no_readers_and_the_first_costly_one_does(tmp_path):
    from scheduler.config import DaemonConfig
    from scheduler.daemon import Daemon

    d = Daemon(DaemonConfig(read_processes=2), tmp_path / "home", clock=ManualClock(NOW))
    d.prepare()
    try:
        with d.store.tx() as s:
            s.execute(insert(Job.__table__), [Job(**r).model_dump(exclude={"id"})
                                              for r in varied_jobs(random.Random(3), 20)])
        every = JobFilter(all=True, limit=100_000)
        for _ in range(5):
            asyncio.run(d.job_page(OPERATOR, every, None))  # 20 jobs: a few milliseconds each
        assert d.readers._pool is None  # no process started for pages this cheap
        with d.store.tx() as s:
            s.execute(insert(Job.__table__), [Job(**r).model_dump(exclude={"id"})
                                              for r in varied_jobs(random.Random(4), 2000)])
        asyncio.run(d.job_page(OPERATOR, every, None))  # on a thread; it starts the readers
        wait_for(lambda: d.readers.ready, 30, what="the reader processes to start")
        served = d.readers.served
        assert len(decoded(*asyncio.run(d.job_page(OPERATOR, every, None)))) == 2020
        assert d.readers.served == served + 1
    finally:
        d.readers.stop()
        d.engine.dispose()


def test_a_database_only_the_daemon_can_open_is_read_on_its_threads(tmp_path):
    assert not ReaderProcesses("sqlite:///:memory:", 2).on
    assert not ReaderProcesses("sqlite:///file:x?mode=memory&uri=true", 2).on
    assert not ReaderProcesses(str(tmp_path / "trainyard.db"), 0).on  # read_processes = 0
    assert ReaderProcesses(str(tmp_path / "trainyard.db"), 2).on
