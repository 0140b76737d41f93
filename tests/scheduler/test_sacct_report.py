"""sacct and report against a daemon holding a synthetic history: every total within 1 %."""

from __future__ import annotations

import datetime
import json

import pytest
from fastapi.testclient import TestClient

from scheduler import accounting as acct
from scheduler.api.app import create_app
from scheduler.api.routers import accounting as accounting_router
from scheduler.daemon import Daemon, ManualClock
from scheduler.daemon.accounting import record_from_json
from scheduler.daemon_config import DaemonConfig
from scheduler.models import Job, Node

NOW = 1_700_000_000.0
H = 3600.0
CONFIG = """
[teams.vision]
users = ["ann"]
[teams.nlp]
users = ["bob"]
[accounting]
idle_threshold_pct = 5
[accounting.instances."p5.48xlarge"]
on_demand = 98.32
spot = 32.0
gpus = 8
[accounting.pools.spot]
kind = "aws"
instance_type = "p5.48xlarge"
spot = true
[accounting.pools.lab]
kind = "onprem"
gpu_hour = 1.5
"""


@pytest.fixture
def history(tmp_path):
    """Two nodes (an AWS spot pool at $4/GPU-h, an on-prem pool at $1.5/GPU-h) and four runs."""
    (tmp_path / "trainyard.toml").write_text(CONFIG)
    home = tmp_path / "home"
    d = Daemon(DaemonConfig.load(tmp_path / "trainyard.toml"), home, ManualClock(NOW))
    d.prepare()
    with d.store.tx() as s:
        s.add(Node(name="aws1", address="10.0.0.1", pool="spot", gpus_total=8))
        s.add(Node(name="lab1", address="10.0.0.2", pool="lab", gpus_total=8))
        runs = [  # id, user, queue, start, end, node, gpus
            (1, "ann", "train", NOW - 10 * H, NOW - 6 * H, "aws1", [0, 1, 2, 3]),  # 16 GPU-h
            (2, "ann", "debug", NOW - 30 * H, NOW - 20 * H, "lab1", [0]),  # 4 of 10 h in window
            (3, "bob", "train", NOW - 5 * H, None, "lab1", [4, 5]),  # running: 10 GPU-h so far
            (4, "bob", "train", NOW - 50 * H, NOW - 40 * H, "aws1", [7]),  # before the window
        ]
        for jid, user, queue, start, end, node, gpus in runs:
            s.add(Job(id=jid, name=f"j{jid}", user=user, queue=queue, state="RUNNING" if end is None
                      else "COMPLETED", submit_time=start - 60, start_time=start, end_time=end,
                      exit_code=None if end is None else 0, gpus=len(gpus),
                      allocation=[{"node": node, "gpus": gpus}]))
    # telemetry: GPU 0 and 1 of aws1 idle for the first two hours of job 1; lab1's GPU 4 idle
    # for the last hour of job 3 (still idle now)
    spans = [("aws1", 0, NOW - 10 * H, NOW - 8 * H), ("aws1", 1, NOW - 10 * H, NOW - 8 * H)]
    lines = [json.dumps({"node": n, "gpu": g, "start": a, "end": b}) for n, g, a, b in spans]
    (home / "usage").mkdir()
    (home / "usage" / "idle.jsonl").write_text("\n".join(lines) + "\n")
    d.accounting.load()
    for t in (NOW - H + k * 300 for k in range(13)):  # the agent's samples, one per 5 minutes
        d.accounting.observe("lab1", {"time": t, "gpus": [{"index": 4, "util_gpu": 0},
                                                          {"index": 5, "util_gpu": 97}]})
    app = create_app(d)
    if not any(getattr(r, "path", "").startswith("/v1/accounting") for r in app.routes):
        app.include_router(accounting_router.router)  # until app.py wires it
    admin = d.create_token("root", "admin", "test")
    ann = d.create_token("ann", "user", "test")
    with TestClient(app) as client:
        yield client, {"Authorization": f"Bearer {admin}"}, {"Authorization": f"Bearer {ann}"}


def window(hours: float) -> dict:
    return {"start": NOW - hours * H, "end": NOW}


def close(a: float, b: float) -> bool:
    return abs(a - b) <= 0.01 * abs(b) + 1e-9


def test_report_by_team_totals_gpu_hours_cost_and_idle_time(history):
    client, admin, _ = history
    r = client.get("/v1/accounting/report", params={"by": "account", **window(24)}, headers=admin)
    assert r.status_code == 200, r.text
    rows = {row["key"]: row for row in r.json()["rows"]}
    # vision (ann): job 1 16 GPU-h at $4 = $64; job 2 4 GPU-h at $1.5 = $6; idle 2 GPUs x 2 h
    assert close(rows["vision"]["gpu_hours"], 20.0) and close(rows["vision"]["cost"], 70.0)
    assert close(rows["vision"]["idle_gpu_hours"], 4.0)
    # nlp (bob): job 3 2 GPUs x 5 h = 10 GPU-h at $1.5; idle GPU 4 for the last hour
    assert close(rows["nlp"]["gpu_hours"], 10.0) and close(rows["nlp"]["cost"], 15.0)
    assert close(rows["nlp"]["idle_gpu_hours"], 1.0)
    total = r.json()["total"]
    assert close(total["gpu_hours"], 30.0) and close(total["cost"], 85.0) and total["jobs"] == 3


def test_report_by_queue_and_user(history):
    client, admin, _ = history
    by_queue = client.get("/v1/accounting/report", params={"by": "queue", **window(24)}, headers=admin)
    rows = {row["key"]: row["gpu_hours"] for row in by_queue.json()["rows"]}
    assert close(rows["train"], 26.0) and close(rows["debug"], 4.0)
    by_user = client.get("/v1/accounting/report", params={"by": "user", **window(100)}, headers=admin)
    rows = {row["key"]: row["gpu_hours"] for row in by_user.json()["rows"]}
    assert close(rows["ann"], 26.0) and close(rows["bob"], 20.0)  # all of job 2 and job 4 now


def test_report_needs_the_operator_role_and_a_window_that_ends_after_it_starts(history):
    client, admin, ann = history
    assert client.get("/v1/accounting/report", headers=ann).status_code == 403
    r = client.get("/v1/accounting/report", params={"start": NOW, "end": NOW - H}, headers=admin)
    assert r.status_code == 422 and "before it starts" in r.text


def test_sacct_lists_the_window_with_slurm_fields(history):
    client, admin, ann = history
    r = client.get("/v1/accounting/jobs", params=window(24), headers=admin)
    jobs = [record_from_json(j) for j in r.json()["jobs"]]
    assert [j.id for j in jobs] == [1, 2, 3]
    out = acct.render_sacct(jobs, "JobID,User,Account,Partition,AllocGPUS,State,Elapsed,GPUHours",
                            "parsable", now=NOW)
    assert out.splitlines()[1:] == ["1|ann|vision|train|4|COMPLETED|04:00:00|16.00",
                                    "2|ann|vision|debug|1|COMPLETED|10:00:00|10.00",
                                    "3|bob|nlp|train|2|RUNNING|05:00:00|10.00"]
    mine = client.get("/v1/accounting/jobs", params=window(24), headers=ann).json()["jobs"]
    assert {j["user"] for j in mine} == {"ann"}  # users see their own jobs
    assert client.get("/v1/accounting/jobs", params={"user": "bob"}, headers=ann).status_code == 403


def test_sacct_by_job_ids_at_any_time_with_what_each_asked_for(history):
    client, admin, ann = history
    r = client.get("/v1/accounting/jobs", params={"ids": "4,2"}, headers=admin)  # job 4 ended 40 h ago
    assert r.status_code == 200
    jobs = r.json()["jobs"]
    assert [j["id"] for j in jobs] == [2, 4]
    assert {k: jobs[1][k] for k in ("gpus", "nodes", "cpus", "time_limit", "array_job_id")} == {
        "gpus": 1, "nodes": 1, "cpus": 1, "time_limit": None, "array_job_id": None}
    assert [record_from_json(j).id for j in jobs] == [2, 4]  # the request's fields are not the record's
    # a start still bounds it; a user sees only their own
    assert client.get("/v1/accounting/jobs", params={"ids": "4,2", "start": NOW - 30 * H},
                      headers=admin).json()["jobs"][0]["id"] == 2
    assert [j["id"] for j in client.get("/v1/accounting/jobs", params={"ids": "2,3"},
                                        headers=ann).json()["jobs"]] == [2]
    for bad, words in (("1,x", "ids"), (",".join(map(str, range(1, 1003))), "at most 1000"),
                       ("99999999999999999999", "ids")):
        r = client.get("/v1/accounting/jobs", params={"ids": bad}, headers=admin)
        assert r.status_code in (400, 422) and words in r.text, r.text


def test_sacct_times_as_slurm_takes_them():
    assert acct.slurm_when("now-2hours", NOW) == NOW - 2 * H
    assert acct.slurm_when("now-7days", NOW) == NOW - 7 * 86400
    day = datetime.datetime.fromtimestamp(NOW).replace(hour=0, minute=0, second=0, microsecond=0)
    assert acct.slurm_when("today", NOW) == acct.slurm_when("midnight", NOW) == day.timestamp()
    assert acct.slurm_when("noon", NOW) == day.replace(hour=12).timestamp()
    assert acct.slurm_when("08:30", NOW) == day.replace(hour=8, minute=30).timestamp()
    assert acct.slurm_when("03/04/25-10:20:30", NOW) == datetime.datetime(2025, 3, 4, 10, 20, 30).timestamp()
    assert acct.slurm_when("2025-03-04", NOW) == datetime.datetime(2025, 3, 4).timestamp()
    for bad in ("yesterday", "25:00", "now-2fortnights", "13/45"):
        with pytest.raises(ValueError, match="now-N"):
            acct.slurm_when(bad, NOW)
