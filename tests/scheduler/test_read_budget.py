"""Each user's share of the daemon's read threads: a user who has spent it gets 429 with
Retry-After before anything is read, other users and submissions are served meanwhile, the CLI
waits the Retry-After out, the TUI's backend reports it, and /metrics counts the refusals."""

from __future__ import annotations

import asyncio
import json
import random
import time

import httpx
import pytest
from sqlalchemy import insert

from scheduler.api.app import create_app
from scheduler.daemon import ManualClock
from scheduler.daemon.errors import Throttled
from scheduler.daemon.readbudget import ReadBudget
from scheduler.models import Job
from tests.conftest import leading_daemon
from tests.scheduler.test_busy_reads import NOW, varied_jobs

# ---------------------------------------------------------------------------- the bucket


def test_a_user_spends_the_burst_then_earns_the_share():
    b = ReadBudget(share=0.25, burst_s=2.0)
    b.admit("ann", 0.0)
    b.charge("ann", 2.5, 0.0)  # one read is never cut short: ann is 0.5 s in debt
    with pytest.raises(Throttled) as refused:
        b.admit("ann", 1.0)  # 0.25 s earned back, 0.25 in debt
    assert refused.value.retry_after_s == 2  # at 1 s from now the level is 0, not above it
    assert "read_share" in str(refused.value) and "retry in 2 s" in str(refused.value)
    b.admit("bob", 1.0)  # another user's budget is his own
    b.admit("ann", 1.0 + refused.value.retry_after_s)  # waited as told: served
    b.charge("ann", 0.01, 3.0)
    b.admit("ann", 1000.0)
    assert b.buckets["ann"].level == 2.0  # a quiet user saves up to the burst, no more


def test_a_refusal_is_counted_and_costs_nothing():
    refused: list[str] = []
    b = ReadBudget(share=1.0, burst_s=0.5, on_refused=refused.append)
    b.charge("ann", 0.6, 0.0)
    for _ in range(3):
        with pytest.raises(Throttled):
            b.admit("ann", 0.0)
    assert refused == ["ann"] * 3
    b.admit("ann", 0.2)  # the refusals added no debt: 0.1 s earned back covers it


def test_share_zero_turns_the_budget_off():
    b = ReadBudget(share=0.0, burst_s=1.0)
    b.charge("ann", 100.0, 0.0)
    b.admit("ann", 0.0)
    assert not b.buckets


def test_many_users_keep_their_debts_when_full_buckets_are_forgotten():
    b = ReadBudget(share=0.001, burst_s=1.0)
    b.charge("hog", 5.0, 0.0)
    for i in range(10_002):
        b.admit(f"u{i}", 1.0)
    assert len(b.buckets) < 10_002  # the full ones went
    with pytest.raises(Throttled):
        b.admit("hog", 2.0)  # the one in debt stayed


# ---------------------------------------------------------------------------- over the API


@pytest.fixture(scope="module", params=["sqlite"])
def daemon(request, tmp_path_factory):
    # a tiny budget: one listing of 300 jobs spends it, and 0.01 s of CPU is earned back in 1 s
    d = leading_daemon(request, tmp_path_factory.mktemp("budget"), "budget", ManualClock(NOW),
                       read_share=0.01, read_burst_s=0.001)
    with d.store.tx() as s:
        s.execute(insert(Job.__table__), [Job(**r).model_dump(exclude={"id"})
                                          for r in varied_jobs(random.Random(7), 300)])
    yield d
    d.engine.dispose()


def test_a_user_past_the_share_is_refused_and_others_are_served(daemon):
    ann = daemon.create_token("ann", "user", "test")
    bob = daemon.create_token("bob", "operator", "test")

    async def scenario():
        transport = httpx.ASGITransport(app=create_app(daemon))
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            as_ann = {"Authorization": f"Bearer {ann}"}
            as_bob = {"Authorization": f"Bearer {bob}"}
            first = await c.get("/v1/jobs", params={"all": True}, headers=as_ann)
            refused = [await c.get(path, headers=as_ann)
                       for path in ("/v1/jobs?all=true", "/v1/events?limit=50", "/v1/accounting/jobs")]
            other = await c.get("/v1/jobs", params={"all": True}, headers=as_bob)
            submitted = await c.post("/v1/jobs", json={"command": ["true"], "hold": True}, headers=as_ann)
            wait = int(refused[0].headers["retry-after"])
            await asyncio.sleep(wait)
            again = await c.get("/v1/jobs", params={"all": True, "user": "ann"}, headers=as_ann)
            metrics = await c.get("/metrics")
            diag = await c.get("/v1/diag", headers=as_bob)
            return first, refused, other, submitted, wait, again, metrics, diag

    first, refused, other, submitted, wait, again, metrics, diag = asyncio.run(scenario())
    assert first.status_code == 200 and len(first.json()) == 300
    for r in refused:
        assert r.status_code == 429, r.text
        assert 1 <= int(r.headers["retry-after"]) <= 10
        body = r.json()
        assert "ann has used their share of the daemon's reads" in body["detail"]
        assert "read_share" in body["detail"] and f"retry in {r.headers['retry-after']} s" in body["detail"]
    assert other.status_code == 200 and len(other.json()) == 300  # bob's share is his own
    assert submitted.status_code == 201, submitted.text  # only reads are budgeted
    assert again.status_code == 200, again.text  # served once the Retry-After passed
    assert submitted.json()["id"] in {j["id"] for j in again.json()}
    line = [x for x in metrics.text.splitlines() if x.startswith('trainyard_api_reads_throttled_total{user="ann"}')]
    assert line and float(line[0].split()[-1]) >= 3, metrics.text[-2000:]
    # an operator's `trainyard diag` names who loads the daemon: ann's reads, their CPU, the refusals
    by_user = {u["user"]: u for u in diag.json()["api"]["by_user"]}
    assert by_user["ann"]["reads_throttled"] == 3 and by_user["ann"]["reads"] == 2, by_user["ann"]
    assert by_user["ann"]["read_cpu_s"] > 0 and by_user["bob"]["reads_throttled"] == 0
    assert diag.json()["api"]["reads_throttled"] == 3


def test_the_cli_waits_the_retry_after_out_and_the_tui_reports_it(daemon_factory):
    # listing 300 tasks costs ~20 ms of CPU: with 0.01 s earned a second, 2 s to earn back
    d = daemon_factory(extra_config="read_share = 0.01\nread_burst_s = 0.000001\n")
    d.cli("submit", "--hold", "--array", "0-299", "--", "true", check=True)
    c = d.client()
    assert len(c.jobs(all=True)) >= 300  # spends the tiny burst
    t0 = time.monotonic()
    r = d.cli("jobs", "--all", "--json", check=True)
    assert time.monotonic() - t0 >= 1.0  # refused, waited the Retry-After, then served
    assert len(json.loads(r.stdout)) >= 300

    from tui.backend import BackendError, HttpBackend

    c.jobs(all=True)
    backend = HttpBackend(d.url, d.token)
    with pytest.raises(BackendError) as refused:
        backend.jobs(all=True)  # the TUI is told at once, and shows it
    assert refused.value.status == 429 and "share of the daemon's reads" in refused.value.detail
    backend.close()
