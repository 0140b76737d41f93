"""Job listings built in reader processes: the page is the one the daemon's own threads build,
for every viewer and encoding; a reader that dies costs no page; the readers end with the
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

from scheduler.daemon import JobFilter, ManualClock
from scheduler.daemon.caller import Caller
from scheduler.daemon.readers import ReaderProcesses
from scheduler.daemon.views import encoded
from scheduler.models import Job
from scheduler.settings import Settings
from tests.conftest import leading_daemon, wait_for
from tests.scheduler.test_busy_reads import NOW, TEAMS, varied_jobs

OPERATOR = Caller("root", "operator")
ANN = Caller("ann", "user")


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def daemon(request, tmp_path_factory):
    d = leading_daemon(request, tmp_path_factory.mktemp("readers"), "readers", ManualClock(NOW),
                       settings=Settings.from_toml(TEAMS), read_processes=2)
    with d.store.tx() as s:
        s.execute(insert(Job.__table__), [Job(**r).model_dump(exclude={"id"})
                                          for r in varied_jobs(random.Random(11), 400)])
    yield d
    d.readers.stop()
    d.engine.dispose()


def decoded(body: bytes, gzipped: bool) -> list[dict]:
    return json.loads(gzip.decompress(body) if gzipped else body)


@pytest.mark.parametrize("viewer", [OPERATOR, ANN], ids=["operator", "ann"])
@pytest.mark.parametrize("accept", ["gzip", None], ids=["gzip", "plain"])
@pytest.mark.parametrize("f", [JobFilter(all=True, limit=100_000), JobFilter(limit=50),
                               JobFilter(all=True, user="bob", limit=100_000)], ids=["all", "page", "bob"])
def test_a_reader_process_builds_the_page_the_daemon_would(daemon, viewer, accept, f):
    assert daemon.readers.on
    body, gzipped = asyncio.run(daemon.job_page(viewer, f, accept))
    want = daemon.jobs.list(viewer, f)  # in this process, as the read threads would
    assert gzipped == (accept == "gzip" and len(encoded(want, None)[0]) >= 16 * 1024)
    assert decoded(body, gzipped) == json.loads(json.dumps(want))
    if viewer is ANN:  # the hidden environments stay hidden when a reader builds the page
        others = [j for j in decoded(body, gzipped) if j["user"] != "ann"]
        assert others and all(set(j["env"].values()) <= {None} for j in others)


def test_a_reader_that_dies_costs_no_page(daemon):
    async def scenario():
        first = await daemon.job_page(OPERATOR, JobFilter(all=True, limit=100_000), None)
        pool = daemon.readers._pool
        for pid in list(pool._processes):
            os.kill(pid, signal.SIGKILL)
        time.sleep(0.2)
        during = await daemon.job_page(OPERATOR, JobFilter(all=True, limit=100_000), None)
        after = await daemon.job_page(OPERATOR, JobFilter(all=True, limit=100_000), None)
        return first, during, after, pool, daemon.readers._pool

    first, during, after, dead, now = asyncio.run(scenario())
    assert decoded(*first) == decoded(*during) == decoded(*after)
    assert len(decoded(*first)) == 400
    assert now is not None and now is not dead  # new readers serve the pages after


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
    d.cli("submit", "--hold", "--array", "0-99", "--", "true", check=True)
    assert len(d.client().jobs(all=True)) >= 100  # built by a reader
    readers = descendants(d.proc.pid)
    assert len(readers) >= 2, readers  # the fork server and at least one reader
    if how == "stop":
        d.stop()
    else:
        d.kill9()
    wait_for(lambda: not alive(readers), 20, what=f"the readers to end after the daemon's {how}")
