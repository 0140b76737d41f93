"""The daemon's own load (`trainyard diag`, `ty-sdiag`, GET /v1/diag): the event loop's lag, the
scheduling cycles, the job counters, the agents' messages and the requests by user, against a
real daemon process with two real sshd nodes; the lag probe on a loop that is held up."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

import pytest
from prometheus_client import CollectorRegistry, Histogram

from scheduler.client import ApiError, Client
from scheduler.daemon.diag import SLOW_LAG_S, Diag, LagStats
from tests.conftest import ROOT, wait_for, wait_job


def sdiag(d, *args: str, token: str | None = None) -> subprocess.CompletedProcess:
    env = {**d.env, "TRAINYARD_URL": d.url, "TRAINYARD_TOKEN": token or d.token}
    return subprocess.run([sys.executable, "-m", "scheduler.slurm.commands_main", "sdiag", *args], env=env,
                          cwd=ROOT, capture_output=True, text=True, timeout=60)


def test_a_held_up_event_loop_shows_as_lag_in_the_report_and_in_prometheus():
    """A callback that keeps the loop for 0.3 s (what a slow read on the loop would do) is seen
    by the probe as a lag of about that long: in the worst case, the p99 and the count of slow
    samples, and in trainyard_event_loop_lag_seconds."""
    registry = CollectorRegistry()
    diag = Diag(lag_metric=Histogram("trainyard_event_loop_lag_seconds", "lag", registry=registry))

    async def main():
        stop = False
        probe = asyncio.create_task(diag.probe(lambda: not stop, every_s=0.02))
        await asyncio.sleep(0.2)
        calm = diag.lag.worst
        asyncio.get_running_loop().call_soon(time.sleep, 0.3)  # the loop is held 0.3 s
        await asyncio.sleep(0.5)
        stop = True
        await probe
        return calm

    calm = asyncio.run(main())
    s = diag.summary()["loop"]
    assert calm < 0.1, f"an idle loop already lagged {calm * 1000:.1f} ms"
    assert 250 <= s["max_ms"] < 1000, s
    assert s["p99_ms"] == s["max_ms"] and s[f"over_{int(SLOW_LAG_S * 1000)}ms"] == 1, s
    assert s["samples"] >= 15 and s["window_samples"] == s["samples"], s
    count = registry.get_sample_value("trainyard_event_loop_lag_seconds_count")
    total = registry.get_sample_value("trainyard_event_loop_lag_seconds_sum")
    assert count == s["samples"] and total >= 0.25, (count, total)
    # a reset forgets the worst case
    diag.reset()
    assert diag.summary()["loop"]["max_ms"] == 0 and diag.summary()["loop"]["samples"] == 0


def test_the_p99_is_of_the_recent_window():
    lag = LagStats()
    assert lag.p99() == 0.0 and lag.p99(need=100) is None
    for _ in range(98):
        lag.add(0.001)
    lag.add(0.5)
    lag.add(0.002)
    assert lag.p99() == 0.002 == lag.p99(need=100)  # the 99th of 100 ordered samples
    lag.add(0.003)
    assert lag.summary()["max_ms"] == 500.0


@pytest.fixture(scope="module")
def busy(tmp_path_factory):
    """A daemon process with two sshd nodes; ann (user) and bob (operator) beside the admin."""
    from tests.conftest import DaemonProc, SshdNode, add_sshd_node

    base = tmp_path_factory.mktemp("diag")
    d = DaemonProc(base).start()
    nodes = []
    try:
        for name in ("n1", "n2"):
            n = SshdNode(base, name, d.public_key)
            n.start()
            nodes.append(n)
            add_sshd_node(d, n, gpus=2)
        d.ann = d.cli("token", "create", "ann", "--role", "user", check=True).stdout.strip()
        d.bob = d.cli("token", "create", "bob", "--role", "operator", check=True).stdout.strip()
        yield d
    finally:
        for n in nodes:
            n.stop()
        d.stop()


def test_the_report_counts_what_the_daemon_did(busy):
    """Jobs submitted by ann run and end; the report counts them, the cycles that started them,
    the agents' messages, and each caller's requests (shown to an operator, not to a user)."""
    d = busy
    admin, ann, bob = d.client(), d.client(d.ann), d.client(d.bob)
    before = bob.diag()
    ids = [ann.submit({"command": ["true"], "gpus": 1})["id"] for _ in range(3)]
    ids.append(ann.submit({"command": ["sh", "-c", "exit 3"], "gpus": 1})["id"])
    for jid in ids:
        wait_job(admin, jid, {"COMPLETED", "FAILED"})
    for _ in range(5):
        ann.jobs()
    # the counters move after each commit, on the daemon's loop; a read thread may have answered
    # the job's end before that
    after = wait_for(lambda: (x := bob.diag())["jobs"]["started"] - before["jobs"]["started"] >= 4 and x,
                     10, what="the four starts counted")
    jobs, was = after["jobs"], before["jobs"]
    assert jobs["submitted"] - was["submitted"] == 4
    assert jobs["started"] - was["started"] == 4
    assert (jobs["completed"] - was["completed"], jobs["failed"] - was["failed"]) == (3, 1)
    assert jobs["now"]["pending"] == 0 and jobs["now"]["running"] == 0
    cycles = after["scheduler"]
    assert cycles["cycles"] > before["scheduler"]["cycles"]
    assert cycles["jobs_started"] - before["scheduler"]["jobs_started"] == 4
    assert 0 < cycles["mean_ms"] <= cycles["max_ms"]
    assert after["agents"] == {**after["agents"], "nodes": 2, "connected": 2}
    assert after["agents"]["messages"] > before["agents"]["messages"]
    by_user = {u["user"]: u["requests"] for u in after["api"]["by_user"]}
    assert by_user["ann"] >= 4 + 5  # the submissions and the listings
    assert after["api"]["requests"] == sum(by_user.values())
    ann_row = next(u for u in after["api"]["by_user"] if u["user"] == "ann")
    assert ann_row["reads"] >= 5 and ann_row["read_cpu_s"] > 0 and ann_row["reads_throttled"] == 0
    assert after["loop"]["samples"] > 0 and after["role"] == "leader" and after["database"] == "sqlite"
    # a user sees the figures but not who else calls the daemon
    mine = ann.diag()
    assert "by_user" not in mine["api"] and mine["api"]["users"] >= 2
    assert mine["jobs"]["submitted"] == jobs["submitted"]


def test_only_an_operator_resets_and_a_reset_starts_the_counts_again(busy):
    d = busy
    ann, bob = d.client(d.ann), d.client(d.bob)
    ann.submit({"command": ["true"], "gpus": 1, "hold": True})
    with pytest.raises(ApiError) as refused:
        ann.diag(reset=True)
    assert refused.value.status == 403 and "operator" in refused.value.detail
    assert ann.diag()["jobs"]["submitted"] >= 1  # the refused reset reset nothing
    r = sdiag(d, "--reset", token=d.ann)
    assert r.returncode == 1 and "sdiag: error:" in r.stderr and "operator" in r.stderr
    r = sdiag(d, "-r", token=d.bob)
    assert r.returncode == 0 and r.stdout.strip() == "Reset scheduling statistics", r
    after = bob.diag()
    assert after["jobs"]["submitted"] == 0 and after["jobs"]["completed"] == 0
    assert after["api"]["requests"] <= 2 and after["loop"]["max_ms"] < 1000
    assert after["window_s"] < after["uptime_s"]
    events = d.client().events(None, 50)
    assert any(e["action"] == "diag.reset" and e["actor"] == "bob" for e in events)


def test_the_commands_print_the_report(busy):
    d = busy
    d.client(d.ann).submit({"command": ["true"], "gpus": 1, "hold": True})
    r = d.cli("diag", check=True)
    lines = {line.split("  ")[0].strip(): line for line in r.stdout.splitlines()}
    assert {"daemon", "since", "event loop lag", "scheduling", "jobs", "jobs now", "agents", "api"} <= set(lines)
    assert "leader (sqlite)" in lines["daemon"] and "2 of 2 nodes connected" in lines["agents"]
    assert "p99" in lines["event loop lag"]
    assert any(line.split()[:1] == ["ann"] for line in r.stdout.splitlines())  # an admin sees the users
    data = json.loads(d.cli("diag", "--json", check=True).stdout)
    # the cluster summary (the TUI's header) carries the lag's p99 once it has 100 samples
    lag = d.client().cluster()["loop_lag_p99_ms"]
    assert lag is None if data["loop"]["window_samples"] < 100 else 0 <= lag <= data["loop"]["max_ms"]
    assert data["jobs"]["now"]["pending"] >= 1
    r = sdiag(d)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert out.startswith("*" * 55 + "\nsdiag output at ")
    assert f"Jobs pending:   {data['jobs']['now']['pending']}" in out
    for heading in ("Jobs submitted:", "Main schedule statistics (microseconds):", "\tTotal cycles:",
                    "Event loop lag (microseconds):", "Remote Procedure Call statistics by user"):
        assert heading in out, heading
    # a user's sdiag has no per-user lines
    assert "by user" not in sdiag(d, token=d.ann).stdout
    assert json.loads(sdiag(d, "--json").stdout)["role"] == "leader"


def test_a_refused_token_is_not_counted(busy):
    """Requests are counted once their token is known: a stranger's 401s add nothing."""
    d = busy
    bob = d.client(d.bob)
    was = bob.diag()["api"]
    for _ in range(3):
        with pytest.raises(ApiError) as e:
            Client(d.url, "ty_not-a-token").diag()
        assert e.value.status == 401
    now = bob.diag()["api"]
    assert now["requests"] == was["requests"] + 1  # bob's own second call
    assert {u["user"] for u in now["by_user"]} == {u["user"] for u in was["by_user"]}
