"""Cost per event: an agent's `started`, a job's end (`exited` -> COMPLETED), a node's resync after
hello, a housekeeping tick (time limits, unreachable nodes), a scrape of one node's GPUs by
Prometheus (/metrics/nodes/<node>, asked of every node each interval) and of the cluster's own
series (/metrics: grows with the nodes, not the jobs) with 10 and with 10,000 active
jobs, and a scheduling cycle after one submission with as many jobs pending as active; the tick's full read of every active job's deadlines (at the first tick, then every 5
minutes) is shown apart. The daemon's own code runs in this process on a real SQLite database; the nodes' links are
not connected (what would be sent to them is dropped), so only the daemon's work is timed, in CPU
seconds of this process (the figures hold on a busy machine). Run:
    .venv/bin/python tests/bench/bench_event_cost.py [ACTIVE ...]
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from _harness import machine

GPUS = 8
NODES = 1250  # 10,000 one-GPU jobs fill them
PROBES = 200  # events timed per kind


def build(active: int):
    """A daemon whose database holds `active` RUNNING jobs packed onto NODES nodes, plus PROBES
    CONFIGURING jobs on a node of their own (the ones the events are about)."""
    from sqlalchemy import insert

    from scheduler.config import DaemonConfig
    from scheduler.daemon import Daemon
    from scheduler.models import Job, Node

    home = Path(tempfile.mkdtemp(prefix="trainyard-bench-events-"))
    d = Daemon(DaemonConfig(db=str(home / "trainyard.db")), home)
    d.prepare()
    now = time.time()
    names = [f"gpu-{i:04d}" for i in range(NODES)] + ["probe"]
    nodes = [Node(name=n, address="127.0.0.1", port=1, gpus_total=GPUS * (PROBES if n == "probe" else 1),
                  gpu_indices=list(range(GPUS * (PROBES if n == "probe" else 1))), cpus=96,
                  mem_mb=1_048_576, state="UP", created_at=now).model_dump() for n in names]
    rows = []
    for j in range(1, active + 1):
        node = names[(j - 1) // GPUS % NODES]
        rows.append(Job(id=j, name=f"train-{j}", user="ana", queue="default", state="RUNNING",
                        command=["sleep", "1000"], gpus=1, time_limit_s=3600, submit_time=now - 60,
                        eligible_time=now - 60, start_time=now - 30,
                        allocation=[{"node": node, "gpus": [(j - 1) % GPUS]}]).model_dump())
    probes = list(range(active + 1, active + PROBES + 1))
    for i, j in enumerate(probes):
        rows.append(Job(id=j, name=f"probe-{j}", user="ana", queue="default", state="CONFIGURING",
                        command=["true"], gpus=1, time_limit_s=3600, submit_time=now, eligible_time=now,
                        start_time=now, allocation=[{"node": "probe", "gpus": [i]}]).model_dump())
    with d.store.tx() as s:
        s.execute(insert(Node.__table__), nodes)
        s.execute(insert(Job.__table__), rows)
    d.store.load_index()
    return d, probes


def timed(fn, *args) -> float:
    t0 = time.process_time()
    fn(*args)
    return time.process_time() - t0


def measure(active: int) -> dict[str, float]:
    from sqlmodel import col, select

    from scheduler.daemon.lifecycle import RankExit
    from scheduler.models import Job
    from scheduler.server import tune_gc

    d, probes = build(active)
    tune_gc()  # the garbage collector tuned as in the daemon's process
    r = d.reconciler
    started = [timed(r.on_started, "probe", f"{j}.0") for j in probes]
    busy = f"gpu-{0:04d}"  # a node with GPUS jobs on it
    resync = [timed(r.reconcile, busy, [{"key": f"{j}.0", "state": "running"} for j in range(1, 1 + GPUS)])
              for _ in range(20)] if active >= GPUS else [float("nan")]
    now = time.time()
    ticks = [timed(d.housekeeping, now) for _ in range(20)]
    full = []
    for _ in range(5):  # as on taking office, and every 5 minutes
        d.lifecycle.deadlines.forget()
        full.append(timed(d.housekeeping, now))
    ended = [timed(r.on_exited, "probe", f"{j}.0", RankExit(0), None) for j in probes]
    telemetry = {"ev": "telemetry", "time": now, "source": "simulated",
                 "gpus": [{"index": g, "util": 50, "mem_used_mb": 1000, "mem_total_mb": 81920, "temp_c": 50,
                           "power_w": 300} for g in range(GPUS)]}
    tele = [timed(d.on_agent_message, busy, telemetry) for _ in range(200)]
    d.leadership.role = "leader"  # as the daemon that serves the scrapes (its index of jobs by node)
    scrape = [timed(d.metrics.render_node, busy) for _ in range(50)]
    whole = [timed(d.metrics.render) for _ in range(10)]  # Prometheus' scrape of /metrics
    with d.store.read() as s:
        states = set(s.exec(select(Job.state).where(col(Job.id).in_(probes))).all())
    if states != {"COMPLETED"}:
        raise SystemExit(f"the probe jobs ended {states}, not COMPLETED")
    d.engine.dispose()
    med = statistics.median
    return {"started": med(started), "exited -> COMPLETED": med(ended), "resync of a node (8 jobs)": med(resync),
            "housekeeping tick": med(ticks), "housekeeping full read": med(full), "telemetry": med(tele),
            "a node's scrape (/metrics/nodes/<node>)": med(scrape), "a scrape of /metrics (every node's)": med(whole)}


def cycle_after_a_submission(backlog: int, cycles: int = 30) -> float:
    """A scheduling cycle as the daemon's loop runs it, after one more job was submitted, with
    `backlog` jobs RUNNING on full nodes and as many PENDING (8-GPU jobs: none fits)."""
    import math

    from sqlalchemy import insert

    from scheduler.config import DaemonConfig
    from scheduler.daemon import Daemon
    from scheduler.daemon.caller import Caller
    from scheduler.daemon.jobs import JobRequest
    from scheduler.models import Job, Node
    from scheduler.server import tune_gc

    home = Path(tempfile.mkdtemp(prefix="trainyard-bench-events-"))
    d = Daemon(DaemonConfig(db=str(home / "trainyard.db")), home)
    d.prepare()
    d.links.connected = lambda name: True  # no agents: the rows are what the cycle reads
    now = time.time()
    names = [f"gpu-{i:04d}" for i in range(math.ceil(backlog / GPUS))]
    nodes = [Node(name=n, address="127.0.0.1", port=1, gpus_total=GPUS, gpu_indices=list(range(GPUS)), cpus=96,
                  mem_mb=1_048_576, state="UP", created_at=now).model_dump() for n in names]
    rows = [Job(id=j, name=f"train-{j}", user="ana", queue="default", state="RUNNING", command=["sleep", "1000"],
                gpus=1, time_limit_s=3600, submit_time=now - 60, eligible_time=now - 60, start_time=now - 30,
                allocation=[{"node": names[(j - 1) // GPUS], "gpus": [(j - 1) % GPUS]}]).model_dump()
            for j in range(1, backlog + 1)]
    rows += [Job(id=j, name=f"wait-{j}", user="bo", queue="default", state="PENDING", command=["true"], gpus=GPUS,
                 time_limit_s=3600, submit_time=now - 10, eligible_time=now - 10).model_dump()
             for j in range(backlog + 1, 2 * backlog + 1)]
    with d.store.tx() as s:
        s.execute(insert(Node.__table__), nodes)
        s.execute(insert(Job.__table__), rows)
    d.store.load_index()
    tune_gc()
    d.cycle.run_once(waits_later=True)  # the first cycle reads everything whole
    caller = Caller("bo", "user")
    times = []
    for _ in range(cycles):
        d.jobs.submit(caller, JobRequest(command=["true"], gpus=GPUS, time_limit_s=3600))
        times.append(timed(d.cycle.run_once, True))
        d.cycle.waits_pending = None  # the loop builds a long backlog's waits off the loop, now and then
    d.engine.dispose()
    return statistics.median(times)


def main() -> None:
    sizes = [int(a) for a in sys.argv[1:]] or [10, 10_000]
    print(f"machine: {machine()}; load average {os.getloadavg()[0]:.2f}")
    results = {n: measure(n) for n in sizes}
    kinds = list(next(iter(results.values())))
    print(f"CPU per event, median, by active jobs ({NODES} nodes x {GPUS} GPUs):")
    print(f"  {'event':<40}" + "".join(f"{n:>12,}" for n in sizes))
    for k in kinds:
        print(f"  {k:<40}" + "".join(f"{results[n][k] * 1000:>10.2f}ms" for n in sizes))
    cycles = {n: cycle_after_a_submission(n) for n in sizes}
    print(f"  {'cycle after a submission':<40}" + "".join(f"{cycles[n] * 1000:>10.2f}ms" for n in sizes)
          + "   (as many jobs PENDING as active, none fits)")


if __name__ == "__main__":
    main()
