"""Takeover at cluster size: two `trainyard daemon` processes on one PostgreSQL database (a
throwaway server started here), NODES simulated nodes x 8 GPUs connected over SSH from a
separate process (`python -m scheduler.simnode`, as in bench_cluster_size.py), 4 running 2-GPU
jobs per node (every GPU busy). The leader is killed with `kill -9`; the benchmark prints how long
the standby took to lead, how long until it had every node's agent connected again (its
`/healthz` `nodes_connected`) and what that cost its CPU, and checks that every job is still
RUNNING, once, afterwards (none lost, ended, requeued or duplicated). Run:
    .venv/bin/python tests/bench/bench_takeover.py [NODES ...]
(default: 100 1000)
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time

from _harness import ROOT, machine
from _http import Connection
from bench_cluster_size import Fleet, cpu_s, stop, submit, wait_for

sys.path.insert(0, str(ROOT))

from tests.conftest import fresh_pg_db, pg_server  # noqa: E402

JOBS_PER_NODE = 4  # 2 GPUs each: the node's 8 GPUs all busy
SETTLE_S = 10  # after the last agent is back: the reconciled state is read after this


async def healthz(url: str) -> dict:
    c = Connection(url, "-")
    try:
        await c.open()
        _, body = await c.request("GET", "/healthz")
        return body
    except OSError:
        return {}
    finally:
        await c.close()


async def until(url: str, test, timeout: float, what: str, every: float = 0.1) -> float:
    t0 = time.monotonic()
    while not test(h := await healthz(url)):
        if time.monotonic() - t0 > timeout:
            raise SystemExit(f"{what}: not reached in {timeout:.0f} s: {h}")
        await asyncio.sleep(every)
    return time.monotonic() - t0


async def takeover(nodes: int, fleet: Fleet, leader, standby, url_a: str, url_b: str, started: float) -> dict:
    await until(url_a, lambda h: h.get("role") == "leader", 60, "the first daemon leads")
    await until(url_b, lambda h: h.get("role") == "standby", 60, "the second daemon stands by")
    await until(url_a, lambda h: h.get("nodes_connected") == nodes, 60 + nodes * 0.3,
                "every node connected to the leader", every=0.5)
    t_first = time.monotonic() - started
    print(f"  the first leader had every node connected {t_first:.1f} s after its start")
    running = JOBS_PER_NODE * nodes
    await submit(url_a, fleet.token, [{"command": ["sleep", "100000"], "gpus": 2, "name": "held-over"}] * running)
    c = await Connection(url_a, fleet.token).open()
    await wait_for(c, f"{running} jobs RUNNING", lambda x: x["jobs_by_state"].get("RUNNING", 0) >= running, 600)
    await c.close()
    await asyncio.sleep(3)  # the leader's last commits and telemetry: a leader at work, not mid-burst
    cpu0 = cpu_s(standby.pid)
    t0 = time.monotonic()
    os.kill(leader.pid, signal.SIGKILL)
    await until(url_b, lambda h: h.get("role") == "leader", 60, "the standby leads")
    t_lead = time.monotonic() - t0
    await until(url_b, lambda h: h.get("nodes_connected") == nodes, 60 + nodes * 0.3,
                "every node connected to the new leader")
    t_back = time.monotonic() - t0
    cpu = cpu_s(standby.pid) - cpu0
    leader.wait()
    await asyncio.sleep(SETTLE_S)
    c = await Connection(url_b, fleet.token).open()
    _, cluster = await c.request("GET", "/v1/cluster")
    status, page = await c.request("GET", f"/v1/jobs?limit={running + 1}")
    await c.close()
    assert status == 200, page
    ids = [j["id"] for j in page]
    return {"nodes": nodes, "first_s": t_first, "lead_s": t_lead, "back_s": t_back, "cpu_s": cpu,
            "by_state": cluster["jobs_by_state"], "running": running,
            "intact": cluster["jobs_by_state"] == {"RUNNING": running} and len(ids) == len(set(ids)) == running
            and all(j["state"] == "RUNNING" and j["attempt"] == 0 for j in page)}


def run_size(nodes: int, pg: str) -> dict:
    db = fresh_pg_db(pg, f"ty_bench_takeover_{nodes}")
    fleet = Fleet(nodes, db=db, prefix="trainyard-bench-takeover-")
    leader = standby = None
    ok = False
    try:
        config = fleet.config()
        started = time.monotonic()
        leader, url_a = fleet.daemon(config, db, "leader.log")
        standby, url_b = fleet.daemon(config, db, "standby.log")
        result = asyncio.run(takeover(nodes, fleet, leader, standby, url_a, url_b, started))
        ok = result["intact"]
        return result
    finally:
        stop(standby)
        stop(leader)
        fleet.stop(remove=ok)


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("Run:")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("nodes", nargs="*", type=int, default=[100, 1000], help="cluster sizes (default: 100 1000)")
    sizes = ap.parse_args().nodes
    print(f"machine: {machine()}; load average {os.getloadavg()[0]:.2f}")
    failed = []
    with pg_server() as pg:
        if pg is None:
            raise SystemExit("PostgreSQL server binaries (initdb) are not installed (apt-get install postgresql)")
        for n in sizes:
            print(f"{n} nodes x 8 GPUs, {JOBS_PER_NODE * n:,} running jobs, two daemons on PostgreSQL, "
                  "kill -9 of the leader:")
            r = run_size(n, pg)
            print(f"  the standby led {r['lead_s']:.1f} s after the kill; every node's agent connected to it "
                  f"{r['back_s']:.1f} s after the kill, for {r['cpu_s']:.1f} s of its CPU; "
                  f"{SETTLE_S} s later the jobs: {r['by_state']} "
                  + ("(every job RUNNING once, as before)" if r["intact"] else
                     f"(NOT the {r['running']:,} RUNNING jobs there were)"))
            if not r["intact"]:
                failed.append(n)
    if failed:
        raise SystemExit(f"jobs lost, ended or duplicated across the takeover at {failed} nodes")


if __name__ == "__main__":
    main()
