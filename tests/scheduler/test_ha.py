"""High availability on PostgreSQL: one leader, a standby that takes over when it dies, no split brain;
and SQLite's one-daemon rule."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from scheduler.client import Client
from tests.conftest import DaemonProc, add_sshd_node, fresh_pg_db, shared_dir, wait_for, wait_job


def health(d: DaemonProc) -> dict:
    return httpx.get(f"{d.url}/healthz", timeout=5).json()


def tally() -> Path:
    return shared_dir("ha-")


def counted(t: Path, tag: str, body: str) -> list[str]:
    return ["sh", "-c", f'echo run >> "{t}/{tag}"; {body}']


def runs(t: Path, tag: str) -> int:
    f = t / tag
    return len(f.read_text().splitlines()) if f.exists() else 0


@pytest.fixture
def pair(postgres_url, tmp_path):
    """Two daemons on one PostgreSQL database, sharing TRAINYARD_HOME (the SSH key, known_hosts)."""
    url = fresh_pg_db(postgres_url, f"ty_ha_{os.getpid()}")
    first = DaemonProc(tmp_path, db=url).start()
    wait_for(lambda: health(first)["role"] == "leader", 15, what="first daemon leads")
    second = DaemonProc(tmp_path, db=url)
    second.log = tmp_path / "standby.log"
    second.start()
    yield first, second
    for d in (first, second):
        d.stop()


def test_one_leads_the_other_stands_by_and_points_to_it(pair):
    leader, standby = pair
    assert health(leader)["role"] == "leader"
    h = wait_for(lambda: (x := health(standby))["role"] == "standby" and x.get("leader") and x, 10,
                 what="standby names the leader")
    assert h["leader"] == leader.url and "another daemon holds the leader lock" in h["reason"]
    r = httpx.post(f"{standby.url}/v1/jobs", json={"command": ["true"]},
                   headers={"Authorization": f"Bearer {standby.token}"})
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    assert f"the leader is at {leader.url}" in r.json()["detail"]
    assert httpx.get(f"{standby.url}/v1/jobs", headers={"Authorization": f"Bearer {standby.token}"}).status_code == 200
    # each says what it is in its own load report (trainyard diag): the standby's loop is measured too
    diags = {d: httpx.get(f"{d.url}/v1/diag", headers={"Authorization": f"Bearer {d.token}"}).json()
             for d in (leader, standby)}
    assert (diags[leader]["role"], diags[standby]["role"]) == ("leader", "standby")
    assert "another daemon holds the leader lock" in diags[standby]["reason"]
    assert {x["database"] for x in diags.values()} == {"postgresql"}
    assert diags[standby]["loop"]["samples"] > 0 and diags[standby]["agents"]["nodes"] == 0
    # a client given both addresses follows the leader, whichever it is given first
    both = Client(f"{standby.url},{leader.url}", leader.token)
    assert both.submit({"command": ["true"], "hold": True})["state"] == "PENDING"


def test_prometheus_pointed_at_the_standby_scrapes_the_leaders_gpus(pair):
    """The agents report their GPUs to the leader alone: the standby's service discovery names
    the leader's address, so a Prometheus configured with either daemon scrapes the telemetry."""
    from sqlalchemy import create_engine
    from sqlmodel import Session

    from scheduler.models import Node

    leader, standby = pair
    # a node registered before the leader lists anything (no agent: none runs here)
    engine = create_engine(leader.db)
    with Session(engine) as s:
        s.add(Node(name="gpu-a1", address="192.0.2.10", state="UP", gpus_total=8, gpu_indices=list(range(8))))
        s.commit()
    engine.dispose()
    wait_for(lambda: health(standby).get("leader"), 10, what="standby names the leader")
    # both daemons name the same targets (Prometheus given both scrapes each once), at the leader
    for d in (standby, leader):
        sd = httpx.get(f"{d.url}/metrics/http_sd", headers={"Host": "ty.example.internal:80"}, timeout=5).json()
        assert sd == [{"targets": [f"127.0.0.1:{leader.port}"], "labels": {
            "instance": "gpu-a1", "__metrics_path__": "/metrics/nodes/gpu-a1", "__scheme__": "http"}}], d.url
    assert leader.port != standby.port
    # the standby answers a scrape of its own too (no GPU telemetry there: no GPU samples)
    r = httpx.get(f"{standby.url}/metrics/nodes/gpu-a1", timeout=5)
    assert r.status_code == 200 and "DCGM_FI_DEV_GPU_UTIL{" not in r.text
    assert httpx.get(f"{standby.url}/metrics/nodes/nope", timeout=5).status_code == 404


def test_kill_9_of_the_leader_the_standby_takes_over_and_every_job_ends_once(pair, sshd_factory):
    leader, standby = pair
    node = sshd_factory("ha1", leader.public_key)
    add_sshd_node(leader, node)
    t = tally()
    c = Client(f"{leader.url},{standby.url}", leader.token)
    ok = c.submit({"command": counted(t, "ok", "sleep 4"), "gpus": 1})
    bad = c.submit({"command": counted(t, "bad", "sleep 5; exit 3"), "gpus": 1})
    for j in (ok, bad):
        wait_job(c, j["id"], "RUNNING")
    killed = time.monotonic()
    leader.kill9()
    during = c.submit({"command": counted(t, "during", "true"), "gpus": 1})  # kept, never lost
    wait_for(lambda: health(standby)["role"] == "leader", 10, what="standby leads within 10 s")
    took = time.monotonic() - killed
    assert took <= 10
    assert wait_job(c, ok["id"], "COMPLETED", timeout=30)["exit_code"] == 0
    failed = wait_job(c, bad["id"], "FAILED", timeout=30)
    assert failed["exit_code"] == 3
    wait_job(c, during["id"], "COMPLETED", timeout=30)
    assert (runs(t, "ok"), runs(t, "bad"), runs(t, "during")) == (1, 1, 1)
    now = health(standby)  # the new leader says its agent is back
    assert (now["nodes_connected"], now["nodes"]) == (1, 1)
    print(f"standby led {took:.1f} s after kill -9 of the leader")


def test_a_deposed_leader_cannot_commit_and_leaves_office(pair):
    """The epoch fence: once another daemon took office, the old leader's writes abort; it leaves
    office and gives up the lock, and whichever daemon is elected next is fenced the same way."""
    leader, standby = pair
    import psycopg

    def depose() -> int:  # another daemon took office: the epoch moved on
        with psycopg.connect(leader.db, autocommit=True) as conn:
            return int(conn.execute("UPDATE meta SET value = CAST(CAST(value AS INTEGER) + 1 AS TEXT) "
                                    "WHERE key = 'leader_epoch' RETURNING value").fetchone()[0])

    def post(d: DaemonProc) -> httpx.Response:
        return httpx.post(f"{d.url}/v1/jobs", json={"command": ["true"]},
                          headers={"Authorization": f"Bearer {d.token}"})

    epoch = depose()
    r = post(leader)
    assert r.status_code == 503 and "deposed" in r.json()["detail"], r.text
    assert r.headers["retry-after"] == "1"
    wait_for(lambda: "standing by: deposed" in leader.log.read_text(), 10, what="the deposed leader leaves office")

    # it gave up the lock: one of the two is elected anew, in a later epoch
    def elected():
        for d in (leader, standby):
            if (h := health(d))["role"] == "leader" and h["epoch"] > epoch:
                return d
        return None
    second = wait_for(elected, 15, what="a daemon elected after the deposition")
    depose()
    r = post(second)
    assert r.status_code == 503 and "deposed" in r.json()["detail"], r.text
    third = wait_for(elected, 15, what="a daemon elected after the second deposition")
    assert Client(third.url, third.token).jobs(all=True) == []  # neither fenced write left a job behind


def test_a_standby_that_loses_the_database_does_not_lead_and_says_why(postgres_url, tmp_path):
    """The standby logs in as a role of its own; that role is locked out of the server and its
    sessions ended. It stays a standby that names the reason, even once the leader is gone; when
    it may log in again, it leads."""
    import psycopg

    url = fresh_pg_db(postgres_url, f"ty_ha_lost_{os.getpid()}")
    role = f"ty_standby_{os.getpid()}"
    admin = url.rsplit("/", 1)[0] + "/postgres"

    def sql(statement: str) -> None:
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(statement)

    sql(f'DROP ROLE IF EXISTS "{role}"')
    sql(f'CREATE ROLE "{role}" LOGIN SUPERUSER')
    leader = DaemonProc(tmp_path, db=url).start()
    standby = None
    try:
        wait_for(lambda: health(leader)["role"] == "leader", 15, what="the first daemon leads")
        netloc = url.split("://", 1)[1].split("@", 1)[-1]
        standby = DaemonProc(tmp_path, db=f"postgresql://{role}@{netloc}")
        standby.log = tmp_path / "standby.log"
        standby.start()
        wait_for(lambda: health(standby)["role"] == "standby", 10, what="the second stands by")
        sql(f'ALTER ROLE "{role}" NOLOGIN')
        sql(f"SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = '{role}'")
        leader.kill9()  # the lock is free: a standby that could reach the database would take it
        h = wait_for(lambda: "cannot reach the database" in ((x := health(standby)).get("reason") or "") and x,
                     15, what="the standby says it cannot reach the database")
        assert h["role"] == "standby" and h["leader"] is None
        time.sleep(3)  # three of its campaign's polls: still not leading
        h = health(standby)
        assert h["role"] == "standby" and "cannot reach the database" in h["reason"]
        sql(f'ALTER ROLE "{role}" LOGIN')
        wait_for(lambda: health(standby)["role"] == "leader", 15, what="it leads once it reaches the database")
        assert "Traceback" not in standby.log.read_text()
    finally:
        for d in (leader, standby):
            if d is not None:
                d.stop()
        sql(f"SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = '{role}'")
        sql(f'DROP ROLE IF EXISTS "{role}"')


def test_a_second_daemon_on_one_sqlite_file_is_refused(tmp_path):
    first = DaemonProc(tmp_path).start()
    try:
        second = DaemonProc(tmp_path)
        second.log = tmp_path / "second.log"
        with pytest.raises(AssertionError, match="daemon exited 1"):
            second.start()
        text = second.log.read_text()
        assert "already serves the SQLite database" in text and "PostgreSQL" in text
        assert "Traceback" not in text
    finally:
        first.stop()


def test_daemon_status_says_who_leads(pair):
    leader, standby = pair
    env = {**leader.env, "TRAINYARD_URL": f"{standby.url},{leader.url}", "TRAINYARD_TOKEN": leader.token}
    r = subprocess.run([".venv/bin/python", "-m", "scheduler.cli", "daemon", "--status"], env=env,
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    assert f"{leader.url}  leader (0 of 0 nodes connected)" in r.stdout
    assert f"{standby.url}  standby" in r.stdout
    # for scripts: each daemon's word, one that does not answer included
    gone = "http://127.0.0.1:1"
    env["TRAINYARD_URL"] = f"{standby.url},{gone},{leader.url}"
    r = subprocess.run([".venv/bin/python", "-m", "scheduler.cli", "daemon", "--status", "--json"], env=env,
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    by_url = {d["url"]: d for d in json.loads(r.stdout)}
    assert [by_url[u]["role"] for u in (standby.url, gone, leader.url)] == ["standby", None, "leader"]
    assert by_url[standby.url]["leader"] == by_url[leader.url]["leader"] == leader.url
    assert (by_url[leader.url]["nodes"], by_url[leader.url]["nodes_connected"], by_url[leader.url]["problems"]) \
        == (0, 0, [])
    assert by_url[gone]["error"].startswith("unreachable")
    # no leader among those given: the JSON still says what each is, and the exit status says so
    env["TRAINYARD_URL"] = f"{standby.url},{gone}"
    r = subprocess.run([".venv/bin/python", "-m", "scheduler.cli", "daemon", "--status", "--json"], env=env,
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 3 and "no configured daemon leads now" in r.stderr
    assert [d["role"] for d in json.loads(r.stdout)] == ["standby", None]
