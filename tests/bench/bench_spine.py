"""Spine benchmarks on the 4-node demo (8 simulated GPUs each): submit throughput, 1,000 jobs end
to end, submit->RUNNING latency, and CLI cold start. Prints its figures."""

from __future__ import annotations

import asyncio
import os
import statistics
import subprocess
import sys
import threading
import time

import httpx
from _harness import (
    ROOT,
    busy_share,
    cpu_by_part,
    cpu_s,
    demo,
    machine,
    machine_jiffies,
    now,
    percentile,
    tree_cpu_s,
)
from _http import submit_jobs


def submit_throughput(url: str, token: str, n: int = 2000, hold: bool = True) -> float:
    """Jobs on one keep-alive connection; held ones measure the API alone, the others include
    the scheduling cycles that each submission triggers (with 32 GPUs busy, the rest wait)."""
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}) as c:
        body = {"command": ["sleep", "600"], "gpus": 1, "hold": hold}
        c.post("/v1/jobs", json=body).raise_for_status()
        t0 = now()
        for _ in range(n):
            c.post("/v1/jobs", json=body).raise_for_status()
        rate = n / (now() - t0)
        for j in c.get("/v1/jobs", params={"limit": 100000}).json():
            c.post(f"/v1/jobs/{j['id']}/cancel")
        while c.get("/v1/cluster").json()["jobs_running"]:
            time.sleep(0.1)
    return rate


def thousand_jobs(url: str, token: str, pid: int, n: int = 1000,
                  how: str = "lean") -> tuple[float, float, dict[str, float]]:
    """(first submit to last COMPLETED, to the last submit's answer, CPU seconds per job of the
    daemon, of the nodes and of this client, and under "busy" the share of the machine's cores that
    was busy meanwhile). `how` submits them: one after another over one keep-alive connection,
    by the lean client of _http.py ("lean") or by httpx ("httpx", the CLI's client: about 0.4 ms
    more of this process's CPU per request, which with one client waiting for each answer is on
    the way of every submission); by 8 lean clients at once ("8 clients", as a pipeline's
    submitters or a workflow engine); or as the tasks of one job array, in one request ("array",
    Slurm's `sbatch --array=0-999`)."""
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=30) as c:
        done0 = c.get("/v1/cluster").json()["jobs_by_state"].get("COMPLETED", 0)
        cpu0, tree0, own0 = cpu_s(pid), tree_cpu_s(pid), time.process_time()
        parts0 = cpu_by_part(pid)
        busy0 = machine_jiffies()
        t0 = now()
        body = {"command": ["true"], "gpus": 1}
        if how == "array":  # one request: what the nodes and the daemon take to run them, without the API
            c.post("/v1/jobs", json={**body, "array": f"0-{n - 1}"}).raise_for_status()
        elif how == "httpx":
            for _ in range(n):
                c.post("/v1/jobs", json=body).raise_for_status()
        elif how == "8 clients":
            async def clients() -> None:
                await asyncio.gather(*(submit_jobs(url, token, body, n // 8 + (i < n % 8)) for i in range(8)))
            asyncio.run(clients())
        else:
            asyncio.run(submit_jobs(url, token, body, n))
        submitted = now() - t0
        while True:
            by = c.get("/v1/cluster").json()["jobs_by_state"]
            if by.get("COMPLETED", 0) - done0 >= n:
                took = now() - t0
                daemon = cpu_s(pid) - cpu0
                cpu = {"daemon": daemon, "nodes": tree_cpu_s(pid) - tree0 - daemon,
                       "client": time.process_time() - own0}
                cpu.update({k: v - parts0[k] for k, v in cpu_by_part(pid).items() if k != "daemon"})
                per_job = {k: v / n for k, v in cpu.items()}
                return took, submitted, {**per_job, "busy": busy_share(busy0, machine_jiffies())}
            if now() - t0 > 300:
                raise SystemExit(f"1,000 jobs did not finish in 300 s: {by}")
            time.sleep(0.05)


FLOOR = """
import os, resource, sys
def cpu():
    return sum(getattr(resource.getrusage(w), f) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
               for f in ("ru_utime", "ru_stime"))
n = int(sys.argv[1])
t = cpu()
for _ in range(n):
    pid = os.posix_spawnp("true", ["true"], os.environ)
    os.waitpid(pid, 0)
spawn = (cpu() - t) / n
t = cpu()
for _ in range(n):
    pid = os.fork()
    if pid == 0:
        os.waitpid(os.posix_spawnp("true", ["true"], os.environ), 0)
        os._exit(0)
    os.waitpid(pid, 0)
print(spawn, (cpu() - t) / n)
"""


def job_start_floor(n: int = 500) -> tuple[float, float]:
    """CPU seconds per job, on this machine, of the least that starting a job can cost: a bare
    interpreter that posix_spawns `true` and waits for it; and the same with a process forked
    per job in between, as a job's supervisor was until 2026-12-01 (forked from the small
    zygote, it starts the job and outlives it to record its end). Neither counts the SSH link,
    the agent, the cgroups or the output. A supervisor forked per job pays at least the second
    figure; one that runs the node's next job after its own (zygote.py's pool) the first."""
    out = subprocess.run([sys.executable, "-c", FLOOR, str(n)], capture_output=True, text=True, check=True)
    spawn, supervised = (float(x) for x in out.stdout.split())
    return spawn, supervised


def submit_to_running(url: str, token: str, n: int = 200) -> tuple[list[float], list[int]]:
    """Sequential 1-GPU `sleep` jobs on warm nodes; RUNNING seen on the event stream. The
    latencies, and the jobs' ids."""
    headers = {"Authorization": f"Bearer {token}"}
    seen: dict[str, float] = {}
    ready = threading.Event()

    def listen():
        with httpx.Client(base_url=url, headers=headers, timeout=None) as s:
            since = s.get("/v1/events", params={"limit": 1}).json()[-1]["id"]
            with s.stream("GET", "/v1/events", params={"since": since, "stream": True}) as r:
                ready.set()
                import json

                for line in r.iter_lines():
                    if line.startswith("data: "):
                        ev = json.loads(line[6:])
                        if ev["action"] == "job.state" and ev["detail"].get("state") == "RUNNING":
                            seen[ev["target"]] = now()

    threading.Thread(target=listen, daemon=True).start()
    ready.wait(10)
    lat, ids = [], []
    with httpx.Client(base_url=url, headers=headers) as c:
        for _ in range(n):
            t0 = now()
            jid = str(c.post("/v1/jobs", json={"command": ["sleep", "0.05"], "gpus": 1}).json()["id"])
            while jid not in seen:
                time.sleep(0.0005)
            lat.append(seen[jid] - t0)
            ids.append(int(jid))
            time.sleep(0.06)
    return lat, ids


def start_stages(url: str, token: str, ids: list[int]) -> dict[str, float]:
    """p50 of each stage of those jobs' starts, from the daemon's own events: submission to the
    cycle's dispatch (CONFIGURING), and dispatch to the node's report that the job runs."""
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}) as c:
        events = c.get("/v1/events", params={"limit": 10 * len(ids) + 1000}).json()
    at: dict[tuple[str, str], float] = {}
    for ev in events:
        what = ev["action"] if ev["action"] == "job.submit" else ev["detail"].get("state", "")
        at.setdefault((ev["target"], what), ev["time"])
    stages = {"submit -> dispatched": ("job.submit", "CONFIGURING"), "dispatched -> RUNNING": ("CONFIGURING", "RUNNING")}
    return {name: statistics.median(at[str(j), b] - at[str(j), a] for j in ids
                                    if (str(j), a) in at and (str(j), b) in at)
            for name, (a, b) in stages.items()}


def cli_cold_start(url: str, token: str, n: int = 15) -> list[float]:
    env = {**os.environ, "TRAINYARD_URL": url, "TRAINYARD_TOKEN": token}
    exe = os.path.join(os.path.dirname(sys.executable), "trainyard")
    times = []
    for _ in range(n):
        t0 = now()
        subprocess.run([exe, "jobs"], env=env, cwd=ROOT, check=True, capture_output=True)
        times.append(now() - t0)
    return times


def floor_s(cpu: dict[str, float], n: int = 1000) -> float:
    """The least wall time `n` jobs' measured CPU (daemon, nodes, client) takes on this machine's cores."""
    return sum(cpu[k] for k in ("daemon", "nodes", "client")) * n / (os.cpu_count() or 1)


def main() -> None:
    print(f"machine: {machine()}")
    with demo(4, 8) as (url, token, proc):
        rate = submit_throughput(url, token)
        print(f"API submit throughput (one keep-alive connection, 2,000 held jobs): {rate:.0f} jobs/s")
        rate = submit_throughput(url, token, hold=False)
        print(f"API submit throughput with scheduling (2,000 jobs, 32 start, the rest queue): {rate:.0f} jobs/s")
        for how, by in (("lean", "one after another by the benchmarks' lean HTTP client (tests/bench/_http.py)"),
                        ("httpx", "one after another by httpx, the CLI's HTTP client"),
                        ("8 clients", "by 8 of those lean clients at once")):
            secs, submitted, cpu = thousand_jobs(url, token, proc.pid, how=how)
            print(f"1,000 trivial 1-GPU jobs on the 4-node demo, submitted {by}, first "
                  f"submit to last COMPLETED: {secs:.2f} s (the last submit answered after {submitted:.2f} s); CPU "
                  f"per job: daemon {cpu['daemon'] * 1000:.2f} ms, the nodes (their SSH servers, in a process of "
                  f"their own, agents, job supervisors and jobs) {cpu['nodes'] * 1000:.2f} ms, this client "
                  f"{cpu['client'] * 1000:.2f} ms; the machine's cores busy {cpu['busy'] * 100:.0f} % of the time; "
                  f"that CPU on {os.cpu_count()} cores takes at least {floor_s(cpu):.2f} s")
        secs, submitted, cpu = thousand_jobs(url, token, proc.pid, how="array")
        print(f"the same 1,000 jobs as the tasks of one job array (one request), to the last COMPLETED: "
              f"{secs:.2f} s; CPU per job: daemon {cpu['daemon'] * 1000:.2f} ms, the nodes {cpu['nodes'] * 1000:.2f} ms: "
              + ", ".join(f"{k} {cpu[k] * 1000:.2f}" for k in ("SSH servers", "agents", "zygotes", "supervisors and jobs"))
              + f" ms; the cores busy {cpu['busy'] * 100:.0f} %; that CPU on {os.cpu_count()} cores takes at least "
              f"{floor_s(cpu):.2f} s")
        spawn, supervised = job_start_floor()
        print(f"the floor of a job's start on this machine: posix_spawn of `true` and its wait {spawn * 1000:.2f} ms of "
              f"CPU; with a process forked per job to supervise it {supervised * 1000:.2f} ms (the fork and exit a "
              f"supervisor reused for the next job saves: {(supervised - spawn) * 1000:.2f} ms); 1,000 jobs on "
              f"{os.cpu_count()} cores take at least {spawn * 1000 / (os.cpu_count() or 1):.2f} s before any "
              f"supervisor, SSH, agent, scheduling or API")
        lat, ids = submit_to_running(url, token)
        stages = start_stages(url, token, ids)
        print(f"submit -> RUNNING on a warm node ({len(lat)} jobs): p50 {percentile(lat, 50) * 1000:.1f} ms, "
              f"p99 {percentile(lat, 99) * 1000:.1f} ms; by the daemon's events, p50: "
              + ", ".join(f"{k} {v * 1000:.1f} ms" for k, v in stages.items()))
        cold = cli_cold_start(url, token)
        print(f"CLI cold start (`trainyard jobs`, {len(cold)} runs): median {statistics.median(cold) * 1000:.0f} ms, "
              f"min {min(cold) * 1000:.0f} ms")


if __name__ == "__main__":
    main()
