"""Submit under load: 8 concurrent clients submit 10,000 1-GPU `true` jobs over the API while the
4-node demo (32 simulated GPUs) runs them. Prints the sustained rate, submit latency percentiles,
the daemon's and the clients' CPU, the CPU spent per job by the daemon and by the nodes (agents, supervisors, the
jobs), and whether every job was stored exactly once and ran to COMPLETED. Run:
    .venv/bin/python tests/bench/bench_submit_load.py [JOBS] [CLIENTS] [--held]
With --held the jobs are submitted held: the API alone, nothing is scheduled or run.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time

from _harness import busy_share, cpu_s, demo, machine, machine_jiffies, now, percentile, tree_cpu_s
from _http import Connection, submit_jobs


async def client(url: str, token: str, count: int, lat: list[float], ids: list[int], held: bool) -> None:
    body = {"command": ["true"], "gpus": 1, "name": "load", **({"hold": True} if held else {})}
    await submit_jobs(url, token, body, count, lat, ids)


async def run(url: str, token: str, pid: int, jobs: int, clients: int, held: bool = False) -> None:
    lat: list[float] = []
    ids: list[int] = []
    per = [jobs // clients + (1 if i < jobs % clients else 0) for i in range(clients)]
    c = await Connection(url, token).open()
    await c.request("POST", "/v1/diag/reset")  # the event loop's lag from here (trainyard diag)
    await c.close()
    cpu0, tree0, own0, t0 = cpu_s(pid), tree_cpu_s(pid), time.process_time(), now()
    busy0 = machine_jiffies()
    await asyncio.gather(*(client(url, token, n, lat, ids, held) for n in per))
    wall = now() - t0
    busy1 = machine_jiffies()
    cpu = cpu_s(pid) - cpu0
    own = time.process_time() - own0
    print(f"submitted {len(ids):,} jobs from {clients} clients in {wall:.2f} s: {len(ids) / wall:,.0f} jobs/s; "
          f"latency p50 {percentile(lat, 50) * 1000:.1f} ms, p99 {percentile(lat, 99) * 1000:.1f} ms, "
          f"max {max(lat) * 1000:.1f} ms; daemon CPU {cpu / wall * 100:.0f} % of one core, these clients "
          f"(one process) {own / wall * 100:.0f} %; the machine's {os.cpu_count()} cores busy "
          f"{busy_share(busy0, busy1) * 100:.0f} % of the time" + (" (held: the API alone)" if held else ""))
    c = await Connection(url, token).open()
    _, diag = await c.request("GET", "/v1/diag")
    await c.close()
    lag = diag["loop"]
    print(f"the daemon's event loop lag while they submitted (GET /v1/diag, {lag['samples']} samples every "
          f"{lag['every_ms']:g} ms): mean {lag['mean_ms']:.1f} ms, p99 {lag['p99_ms']:.1f} ms, max {lag['max_ms']:.1f} "
          f"ms; {diag['scheduler']['cycles']:,} scheduling cycles, mean {diag['scheduler']['mean_ms']:.1f} ms, "
          f"max {diag['scheduler']['max_ms']:.1f} ms")
    if held:
        return
    c = await Connection(url, token).open()
    deadline = time.monotonic() + 600
    while True:
        _, cluster = await c.request("GET", "/v1/cluster")
        by = cluster["jobs_by_state"]
        if by.get("COMPLETED", 0) >= len(ids) or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.2)
    drained = now() - t0
    busy2 = machine_jiffies()
    daemon_cpu = cpu_s(pid) - cpu0
    nodes_cpu = tree_cpu_s(pid) - tree0 - daemon_cpu
    _, rows = await c.request("GET", "/v1/jobs?all=true&limit=100000")
    await c.close()
    stored = [r["id"] for r in rows if r["name"] == "load"]
    completed = sum(1 for r in rows if r["name"] == "load" and r["state"] == "COMPLETED")
    lost = set(ids) - set(stored)
    print(f"first submit to last COMPLETED: {drained:.2f} s; rows {len(stored):,}, distinct ids "
          f"{len(set(stored)):,}, answered ids {len(set(ids)):,}, lost {len(lost)}, "
          f"duplicated {len(stored) - len(set(stored))}, COMPLETED {completed:,}; states {by}")
    print(f"CPU per job, first submit to last COMPLETED: daemon {daemon_cpu / len(ids) * 1000:.2f} ms (with "
          f"the SSH client's end of each link only); the nodes (their SSH servers, in a process of their "
          f"own, agents, job supervisors and jobs) {nodes_cpu / len(ids) * 1000:.2f} ms; the machine's cores "
          f"busy {busy_share(busy0, busy2) * 100:.0f} % of the time from the first submit to the last COMPLETED")


def main() -> None:
    held = "--held" in sys.argv
    args = [a for a in sys.argv[1:] if a != "--held"]
    jobs = int(args[0]) if args else 10_000
    clients = int(args[1]) if len(args) > 1 else 8
    print(f"machine: {machine()}; load average {os.getloadavg()[0]:.2f}")
    with demo(4, 8) as (url, token, proc):
        asyncio.run(run(url, token, proc.pid, jobs, clients, held))


if __name__ == "__main__":
    main()
