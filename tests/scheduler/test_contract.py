"""The API's contract under hostile input: 4xx naming the field, nothing written, listings intact."""

from __future__ import annotations

import httpx
import pytest

from tests.conftest import DaemonProc

TEAMS = """
[teams.vision]
users = ["ann"]
[teams.speech]
users = ["ben"]
"""


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = DaemonProc(tmp_path_factory.mktemp("contract"), extra_config=TEAMS).start()
    yield d
    d.stop()


@pytest.fixture(scope="module")
def tokens(daemon):
    admin = daemon.client()
    out = {"admin": daemon.token}
    for user, role in (("ann", "user"), ("ben", "user"), ("olga", "operator")):
        out[user] = admin.create_token(user, role)["token"]
    return out


def call(daemon, token, method, path, **kw) -> httpx.Response:
    headers = {"Authorization": f"Bearer {token}", **kw.pop("headers", {})}
    return httpx.request(method, daemon.url + path, headers=headers, timeout=10, **kw)


def assert_listings_work(daemon, tokens):
    for path in ("/v1/jobs", "/v1/jobs?all=true", "/v1/events", "/v1/events?since=0", "/v1/nodes",
                 "/v1/queues", "/v1/teams", "/v1/cluster"):
        for who in ("admin", "ann"):
            r = call(daemon, tokens[who], "GET", path)
            assert r.status_code == 200, (path, who, r.text)


def job_count(daemon, tokens) -> int:
    return len(call(daemon, tokens["admin"], "GET", "/v1/jobs?all=true").json())


BIG = "99999999999999999999"


@pytest.mark.parametrize("method,path,body,headers,field", [
    ("GET", f"/v1/jobs/{BIG}", None, {}, "job_id"),
    ("POST", f"/v1/jobs/{BIG}/cancel", None, {}, "job_id"),
    ("GET", f"/v1/jobs/1/log?offset={BIG}", None, {}, "offset"),
    ("GET", f"/v1/events?since={BIG}", None, {}, "since"),
    ("GET", "/v1/events", None, {"Last-Event-ID": BIG}, "last-event-id"),
    ("DELETE", f"/v1/tokens/{BIG}", None, {}, "token_id"),
    ("POST", "/v1/jobs", {"command": ["true"], "time_limit": int(BIG)}, {}, "time_limit"),
    ("POST", "/v1/jobs", {"command": ["true"], "mem": int(BIG)}, {}, "mem"),
    ("POST", "/v1/jobs", {"command": ["true"], "after": int(BIG)}, {}, "after"),
    ("POST", "/v1/jobs", {"command": ["true"], "priority": int(BIG)}, {}, "priority"),
    ("PATCH", "/v1/jobs/1", {"priority": -int(BIG)}, {}, "priority"),
])
def test_integers_past_64_bits_answer_422_naming_the_field(daemon, tokens, method, path, body, headers, field):
    before = job_count(daemon, tokens)
    r = call(daemon, tokens["admin"], method, path, json=body, headers=headers)
    assert r.status_code == 422, r.text
    assert r.json()["detail"].startswith(field) and r.json()["field"] == field
    assert job_count(daemon, tokens) == before
    assert_listings_work(daemon, tokens)


@pytest.mark.parametrize("body,field", [
    ('{"command": ["true"], "env": {"KEY": "\\ud800"}}', "env"),
    ('{"command": ["true"], "env": {"K\\udfff": "x"}}', "env"),
    ('{"command": ["true"], "constraint": {"rack": "\\ud800"}}', "constraint"),
    ('{"command": ["true"], "constraint": "rack=\\udbff"}', "constraint"),
    ('{"command": ["sh", "-c", "echo \\ud800"]}', "command"),
    ('{"command": ["true"], "name": "a\\u0000b"}', "name"),
    ('{"script": "#!/bin/sh\\necho \\ud800"}', "script"),
])
def test_unstorable_strings_are_refused_before_anything_is_committed(daemon, tokens, body, field):
    before = job_count(daemon, tokens)
    r = call(daemon, tokens["ann"], "POST", "/v1/jobs", content=body.encode(),
             headers={"Content-Type": "application/json"})
    assert r.status_code == 422, r.text
    assert field in r.json()["detail"]
    assert job_count(daemon, tokens) == before
    assert_listings_work(daemon, tokens)


def test_unstorable_bootstrap_detail_leaves_the_event_trail_readable(daemon, tokens):
    r = call(daemon, tokens["admin"], "POST", "/v1/nodes/n1/bootstrap",
             content=b'{"phase": "failed", "detail": "\\ud800"}', headers={"Content-Type": "application/json"})
    assert r.status_code == 422 and "detail" in r.json()["detail"]
    assert_listings_work(daemon, tokens)


@pytest.mark.parametrize("address", ["a..b", "0" * 253, "-bad.example", "x" * 64 + ".example", "a b",
                                     "exa\u2028mple", "\u00e9" * 300, ""])
def test_node_addresses_must_be_host_names_or_ip_addresses(daemon, tokens, address):
    r = call(daemon, tokens["admin"], "POST", "/v1/nodes", json={"name": "n9", "address": address})
    assert r.status_code == 422, r.text
    assert r.json()["field"] == "address"
    assert call(daemon, tokens["admin"], "GET", "/v1/nodes").json() == []


def test_unknown_methods_answer_405_naming_the_methods_the_path_serves(daemon, tokens):
    for method, path, allowed in (("PUT", "/v1/jobs", "GET, HEAD, POST"),
                                  ("DELETE", "/v1/jobs/1/cancel", "POST"),
                                  ("PUT", "/v1/jobs/1", "GET, HEAD, PATCH"),
                                  # a path of its own, not the node called "import"
                                  ("PUT", "/v1/nodes/import", "POST")):
        r = call(daemon, tokens["admin"], method, path)
        assert r.status_code == 405, (method, path, r.text)
        assert r.headers["Allow"] == allowed
        assert r.json()["detail"] == f"{method} is not allowed on {path}; allowed: {allowed}"


def test_openapi_declares_the_bearer_scheme_and_every_error_code(daemon):
    doc = httpx.get(daemon.url + "/openapi.json").json()
    assert doc["components"]["securitySchemes"]["HTTPBearer"]["scheme"] == "bearer"
    error = doc["components"]["schemas"]["ErrorBody"]
    assert set(error["properties"]) == {"detail", "field"}
    assert "HTTPValidationError" not in doc["components"]["schemas"]
    submit = doc["paths"]["/v1/jobs"]["post"]
    assert {"201", "401", "403", "422"} <= set(submit["responses"])
    assert submit["responses"]["422"]["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorBody")
    assert {"401", "403", "404", "409"} <= set(doc["paths"]["/v1/jobs/{job_id}/release"]["post"]["responses"])
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            assert any(code.startswith("2") for code in op["responses"]), (method, path)
            if path.startswith("/v1/"):
                assert op.get("security") == [{"HTTPBearer": []}], (method, path)


def test_users_see_names_of_others_env_but_not_values(daemon, tokens):
    job = call(daemon, tokens["ann"], "POST", "/v1/jobs",
               json={"command": ["true"], "hold": True, "env": {"WANDB_API_KEY": "s3cret"}}).json()
    assert job["env"] == {"WANDB_API_KEY": "s3cret"}
    for who in ("ann", "olga", "admin"):
        assert call(daemon, tokens[who], "GET", f"/v1/jobs/{job['id']}").json()["env"]["WANDB_API_KEY"] == "s3cret"
    theirs = call(daemon, tokens["ben"], "GET", f"/v1/jobs/{job['id']}").json()
    assert theirs["env"] == {"WANDB_API_KEY": None}
    listing = call(daemon, tokens["ben"], "GET", "/v1/jobs").text
    assert "s3cret" not in listing and "WANDB_API_KEY" in listing


def test_users_read_only_their_own_jobs_logs(daemon, tokens):
    job = call(daemon, tokens["ann"], "POST", "/v1/jobs", json={"command": ["true"], "hold": True}).json()
    r = call(daemon, tokens["ben"], "GET", f"/v1/jobs/{job['id']}/log")
    assert r.status_code == 403 and "only their own" in r.json()["detail"]
    assert call(daemon, tokens["ann"], "GET", f"/v1/jobs/{job['id']}/log").status_code == 200
    assert call(daemon, tokens["olga"], "GET", f"/v1/jobs/{job['id']}/log").status_code == 200


def test_a_rank_that_does_not_exist_is_refused(daemon, tokens):
    job = call(daemon, tokens["ann"], "POST", "/v1/jobs", json={"command": ["true"], "hold": True}).json()
    r = call(daemon, tokens["ann"], "GET", f"/v1/jobs/{job['id']}/log?rank=99")
    assert r.status_code == 404 and "has not run" in r.json()["detail"] and r.json()["field"] == "rank"


def test_account_must_be_a_team_of_the_user(daemon, tokens):
    r = call(daemon, tokens["ann"], "POST", "/v1/jobs", json={"command": ["true"], "account": "speech"})
    assert r.status_code == 403 and "not a member of team 'speech'" in r.json()["detail"]
    ok = call(daemon, tokens["ann"], "POST", "/v1/jobs",
              json={"command": ["true"], "account": "vision", "hold": True})
    assert ok.status_code == 201, ok.text
    ops = call(daemon, tokens["olga"], "POST", "/v1/jobs",
               json={"command": ["true"], "account": "speech", "hold": True})
    assert ops.status_code == 201, ops.text


def test_a_hold_by_an_operator_is_an_admin_hold_the_user_cannot_release(daemon, tokens):
    job = call(daemon, tokens["ann"], "POST", "/v1/jobs", json={"command": ["true"], "hold": True}).json()
    assert (job["state"], job["reason"]) == ("PENDING", "JobHeldUser")
    call(daemon, tokens["ann"], "POST", f"/v1/jobs/{job['id']}/release")
    held = call(daemon, tokens["olga"], "POST", f"/v1/jobs/{job['id']}/hold").json()
    assert (held["state"], held["reason"], held["held"]) == ("PENDING", "JobHeldAdmin", "admin")
    r = call(daemon, tokens["ann"], "POST", f"/v1/jobs/{job['id']}/release")
    assert r.status_code == 403 and "JobHeldAdmin" in r.json()["detail"]
    released = call(daemon, tokens["olga"], "POST", f"/v1/jobs/{job['id']}/release").json()
    assert released["held"] is None
    call(daemon, tokens["ann"], "POST", f"/v1/jobs/{job['id']}/cancel")


def test_refused_calls_are_audited_with_who_what_and_where(daemon, tokens):
    call(daemon, "ty_not_a_token", "GET", "/v1/jobs")
    call(daemon, tokens["ben"], "POST", "/v1/nodes/x/drain", json={"reason": "mine now"})
    events = call(daemon, tokens["admin"], "GET", "/v1/events?limit=50").json()
    refused = [e for e in events if e["action"] == "api.refused"]
    assert any(e["actor"] == "" and e["detail"]["status"] == 401 and e["target"] == "/v1/jobs"
               and e["address"] == "127.0.0.1" for e in refused)
    assert any(e["actor"] == "ben" and e["detail"]["status"] == 403 and e["target"] == "/v1/nodes/x/drain"
               for e in refused)


def test_the_audit_trail_pages_forward_from_any_id(daemon, tokens):
    first = call(daemon, tokens["admin"], "GET", "/v1/events?since=0&limit=3").json()
    assert [e["id"] for e in first] == sorted(e["id"] for e in first) and first[0]["id"] == 1
    after = call(daemon, tokens["admin"], "GET", f"/v1/events?since={first[-1]['id']}&limit=3").json()
    assert after[0]["id"] == first[-1]["id"] + 1
    newest = call(daemon, tokens["admin"], "GET", "/v1/events?limit=1").json()
    assert newest[0]["id"] >= after[-1]["id"]
