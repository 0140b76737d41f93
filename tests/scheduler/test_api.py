"""The API's promises: tokens hashed at rest, roles on every call, audited changes, 4xx for bad input."""

import sqlite3

import httpx
import pytest

from scheduler.client import ApiError
from tests.conftest import DaemonProc


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = DaemonProc(tmp_path_factory.mktemp("api")).start()
    yield d
    d.stop()


@pytest.fixture(scope="module")
def api(daemon):
    admin = daemon.client()
    tokens = {role: admin.create_token(f"{role}1", role)["token"] for role in ("operator", "user")}
    tokens["user2"] = admin.create_token("user2", "user")["token"]
    return daemon, admin, {k: daemon.client(v) for k, v in tokens.items()}


def refused(call, *args, status=None) -> ApiError:
    with pytest.raises(ApiError) as e:
        call(*args)
    if status is not None:
        assert e.value.status == status, e.value.detail
    return e.value


def db_rows(daemon, sql):
    with sqlite3.connect(daemon.state / "trainyard.db") as conn:
        return conn.execute(sql).fetchall()


def test_tokens_are_stored_only_as_hashes(api):
    daemon, admin, clients = api
    secret = admin.create_token("carol", "user")["token"]
    raw = (daemon.state / "trainyard.db").read_bytes() + (daemon.state / "trainyard.db-wal").read_bytes()
    assert secret.encode() not in raw
    assert len(db_rows(daemon, "select token_hash from token")[0][0]) == 64


def test_missing_or_wrong_token_is_401(daemon):
    r = httpx.get(f"{daemon.url}/v1/jobs")
    assert r.status_code == 401 and "bearer token" in r.json()["detail"]
    assert refused(daemon.client("ty_wrong").jobs, status=401).detail.startswith("invalid token")


def test_user_sees_all_jobs_but_acts_only_on_their_own(api):
    daemon, admin, c = api
    theirs = c["user2"].submit({"command": ["true"], "hold": True})
    mine = c["user"].submit({"command": ["true"], "hold": True})
    assert {j["id"] for j in c["user"].jobs()} >= {theirs["id"], mine["id"]}
    err = refused(c["user"].cancel, theirs["id"], status=403)
    assert "belongs to user2" in err.detail
    held = c["user2"].job(theirs["id"])
    assert (held["state"], held["reason"]) == ("PENDING", "JobHeldUser")
    assert c["user"].cancel(mine["id"])["state"] == "CANCELLED"
    assert c["operator"].cancel(theirs["id"])["state"] == "CANCELLED"


def test_roles_for_nodes_and_tokens(api):
    daemon, admin, c = api
    assert "needs the operator role" in refused(c["user"].drain_node, "n1", "x", status=403).detail
    assert "needs the admin role" in refused(c["operator"].add_node, {"name": "n1", "address": "127.0.0.1"},
                                             status=403).detail
    assert "needs the admin role" in refused(c["operator"].create_token, "eve", "admin", status=403).detail
    assert "needs the admin role" in refused(c["operator"].remove_node, "n1", status=403).detail
    # operators may act, and a missing node is named
    assert "node 'n1' does not exist" in refused(c["operator"].drain_node, "n1", "maint", status=404).detail


def test_raising_priority_needs_an_operator(api):
    daemon, admin, c = api
    assert "operator" in refused(c["user"].submit, {"command": ["true"], "priority": 5}, status=403).detail
    job = c["user"].submit({"command": ["true"], "priority": -5, "hold": True})
    assert refused(c["user"].set_priority, job["id"], 10, status=403)
    assert c["operator"].set_priority(job["id"], 10)["priority"] == 10


def test_every_change_is_audited_with_who_and_where(api):
    daemon, admin, c = api
    job = c["user"].submit({"command": ["true"], "hold": True})
    c["user"].release(job["id"])
    events = [e for e in admin.events(limit=1000) if e["target"] == str(job["id"]) and e["actor"] == "user1"]
    actions = [e["action"] for e in events]
    assert actions.index("job.submit") < actions.index("job.release")
    assert all(e["address"] == "127.0.0.1" and e["time"] > 0 for e in events if e["action"] != "job.state")


@pytest.mark.parametrize("body,field", [
    ({"command": ["true"], "gpus": "two"}, "gpus"),
    ({"command": ["true"], "time_limit": "abc"}, "time_limit"),
    ({"command": ["true"], "mem": "lots"}, "mem"),
    ({"command": ["true"], "queue": "nope"}, "queue"),  # 404: a queue that does not exist
    ({"command": ["true"], "env": {"1X": "y"}}, "env"),
    ({"command": ["true"], "workdir": "relative/dir"}, "workdir"),
    ({"command": ["true"], "after": "sometime"}, "after"),
    ({"command": ["true"], "after": 99999}, "after"),
    ({"command": ["true"], "nodes": 0}, "nodes"),
    ({"command": ["true"], "colour": "red"}, "colour"),
    ({}, "command"),
    ({"command": [], "gpus": 1}, "command"),
])
def test_bad_submission_is_422_naming_the_field_and_writes_nothing(api, body, field):
    daemon, admin, c = api
    before = db_rows(daemon, "select count(*) from job")[0][0]
    err = refused(c["user"].submit, body)
    # a value the schema refuses is 422; a reference to something that does not exist is 404
    assert err.status == (404 if field in ("queue",) or body.get("after") == 99999 else 422), err.detail
    assert field in err.detail
    assert db_rows(daemon, "select count(*) from job")[0][0] == before


def test_malformed_json_is_4xx_not_500(daemon):
    r = httpx.post(f"{daemon.url}/v1/jobs", content=b"{not json", headers={
        "Authorization": f"Bearer {daemon.token}", "Content-Type": "application/json"})
    assert r.status_code == 422 and isinstance(r.json()["detail"], str)
    r = httpx.get(f"{daemon.url}/v1/jobs/abc", headers={"Authorization": f"Bearer {daemon.token}"})
    assert r.status_code == 422 and "job_id" in r.json()["detail"]


def test_actions_on_jobs_in_the_wrong_state_are_refused_clearly(api):
    daemon, admin, c = api
    job = c["user"].submit({"command": ["true"], "hold": True})
    assert "already held (JobHeldUser)" in refused(c["user"].hold, job["id"], status=409).detail
    c["user"].cancel(job["id"])
    assert "already CANCELLED" in refused(c["user"].cancel, job["id"], status=409).detail
    assert refused(c["user"].job, 424242, status=404).detail == "job 424242 does not exist"


def test_metrics_expose_jobs_gpus_and_latencies(api):
    daemon, admin, c = api
    c["user"].submit({"command": ["true"], "hold": True})
    text = httpx.get(f"{daemon.url}/metrics").text
    assert 'trainyard_jobs{queue="default",state="PENDING"} ' in text
    assert "trainyard_gpus_total" not in text  # a gauge carries no counter's suffix
    for name in ("trainyard_gpus ", "trainyard_gpus_allocated", "trainyard_jobs_submitted_total", "trainyard_schedule_cycle_seconds_bucket",
                 "trainyard_dispatch_latency_seconds_bucket", "trainyard_submit_to_running_seconds_bucket"):
        assert name in text
    # the daemon's collector pauses are timed (one full collection at least: the one at start)
    full = [line for line in text.splitlines() if line.startswith('trainyard_gc_pause_seconds_count{generation="2"}')]
    assert full and float(full[0].split()[-1]) >= 1


def test_event_stream_delivers_changes_as_server_sent_events(api):
    daemon, admin, c = api
    since = admin.events(limit=1)[-1]["id"]
    stream = admin.stream_events(since=since)
    job = c["user"].submit({"command": ["true"], "hold": True})
    ev = next(stream)
    assert ev["action"] == "job.submit" and ev["target"] == str(job["id"])


def test_event_stream_delivers_every_event_of_each_commit_once_and_in_order(api):
    """A commit's events go out together (a cancel writes the job's state and the cancel itself);
    none is dropped, repeated or reordered, whether the stream resumes from the backlog or
    follows live."""
    daemon, admin, c = api
    since = admin.events(limit=1)[-1]["id"]
    live = admin.stream_events(since=since)
    jobs = [c["user"].submit({"command": ["true"], "hold": True})["id"] for _ in range(12)]
    for j in jobs:
        c["user"].cancel(j)
    want = [("job.submit", str(j)) for j in jobs] + \
        [(a, str(j)) for j in jobs for a in ("job.state", "job.cancel")]
    got = [next(live) for _ in want]
    assert [(e["action"], e["target"]) for e in got] == want
    ids = [e["id"] for e in got]
    assert ids == sorted(set(ids))
    assert [e["detail"].get("state") for e in got if e["action"] == "job.state"] == ["CANCELLED"] * len(jobs)
    # the same events from the backlog, in one piece, for a stream that starts behind them
    replay = admin.stream_events(since=since)
    assert [next(replay)["id"] for _ in want] == ids


def test_a_bulk_action_acts_on_each_job_it_may_and_says_why_for_the_others(api):
    """POST /v1/jobs/actions/cancel: one call for many jobs (an array's tasks); each job is acted
    on or refused as its own call would be, and a refused one is left as it was."""
    daemon, admin, c = api
    mine = [c["user"].submit({"command": ["true"], "hold": True})["id"] for _ in range(3)]
    theirs = c["user2"].submit({"command": ["true"], "hold": True})["id"]
    c["user"].cancel(mine[2])
    missing = max(mine + [theirs]) + 10_000
    r = c["user"].act_many("cancel", [mine[0], theirs, missing, mine[1], mine[0], mine[2]])
    assert r["done"] == [mine[0], mine[1]]
    assert [(x["id"], x["status"]) for x in r["refused"]] == [(theirs, 403), (missing, 404), (mine[2], 409)]
    assert "belongs to user2" in r["refused"][0]["detail"] and "already CANCELLED" in r["refused"][2]["detail"]
    assert [admin.job(j)["state"] for j in (*mine[:2], theirs)] == ["CANCELLED", "CANCELLED", "PENDING"]
    refusals = [e for e in admin.events(limit=50) if e["action"] == "api.refused"
                and e["target"] == "/v1/jobs/actions/cancel"]
    assert refusals and refusals[-1]["actor"] == "user1" and refusals[-1]["detail"]["jobs"] == [theirs]
    held = admin.submit({"command": ["true"], "hold": True, "array": "0-2999"})
    tasks = [j["id"] for j in admin.jobs(all=True, limit=10_000, ids=str(held["id"]))]
    assert len(tasks) == 3000
    r = admin.act_many("release", tasks)
    assert len(r["done"]) == 3000 and not r["refused"]
    assert admin.act_many("cancel", tasks)["done"] == tasks  # in the order asked
    assert {j["state"] for j in admin.jobs(all=True, limit=10_000, ids=str(held["id"]))} == {"CANCELLED"}
    for body in ({"ids": []}, {"ids": [0]}, {"ids": list(range(1, 10_002))}, {"ids": "1,2"}, {"id": [1]}):
        resp = httpx.post(f"{daemon.url}/v1/jobs/actions/cancel", json=body,
                          headers={"Authorization": f"Bearer {daemon.token}"})
        assert resp.status_code == 422, (body, resp.text)


def test_openapi_is_served(daemon):
    spec = httpx.get(f"{daemon.url}/openapi.json").json()
    assert "/v1/jobs" in spec["paths"] and "/v1/nodes/{name}/drain" in spec["paths"]
