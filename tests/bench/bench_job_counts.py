"""Job counts on a long-lived cluster: `GET /v1/cluster` (which the TUI asks for on every
refresh), `GET /v1/queues` and the `/metrics` job gauges count jobs by state and queue. Job rows
are kept forever, so counting every job in the database costs O(jobs ever run); the daemon
counts the live ones in the database and keeps the finished ones' counts from its commits.
This prints the CPU of each call with the kept counts, and with the finished jobs counted in the
database each time (what every call cost before), over a database of FINISHED finished jobs (50
users, spread over the last year) and 1,000 live ones; then what the reads of the job history
cost on it: `sacct` and `sreport` over the last day, and the newest page of `GET /v1/jobs?all=true`,
of every state and of finished states (what the TUI asks for on each refresh when its job view is
filtered so). The daemon's own code runs in this process on a real SQLite database. Run:
    .venv/bin/python tests/bench/bench_job_counts.py [FINISHED]
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

from _harness import machine

CALLS = 15
YEAR_S = 365 * 86400.0
USERS = [f"user{i}" for i in range(50)]


def build(finished: int):
    from sqlalchemy import insert

    from scheduler import models as m
    from scheduler.config import DaemonConfig
    from scheduler.daemon import Daemon
    from scheduler.models import Job

    home = Path(tempfile.mkdtemp(prefix="trainyard-bench-counts-"))
    d = Daemon(DaemonConfig(db=str(home / "trainyard.db")), home)
    d.prepare()
    now = time.time()
    states = (m.COMPLETED,) * 8 + (m.FAILED, m.CANCELLED)
    base = Job(name="done", user="ana", queue="default", state=m.COMPLETED, command=["true"], gpus=1,
               submit_time=now, eligible_time=now, start_time=now, end_time=now).model_dump()
    base.pop("id", None)
    chunk = 50_000
    step = YEAR_S / max(1, finished)  # spread over the last year, in id order: one an hour-long run

    def row(i: int) -> dict:
        end = now - YEAR_S + i * step
        return {**base, "state": states[i % len(states)], "user": USERS[i % len(USERS)],
                "submit_time": end - 3660, "eligible_time": end - 3660, "start_time": end - 3600, "end_time": end}
    for first in range(0, finished, chunk):
        rows = [row(i) for i in range(first, min(finished, first + chunk))]
        with d.store.tx() as s:
            s.execute(insert(Job.__table__), rows)
    live = [{**base, "state": m.PENDING, "end_time": None, "start_time": None} for _ in range(1000)]
    with d.store.tx() as s:
        s.execute(insert(Job.__table__), live)
    return d


def cpu_ms(fn, forget) -> float:
    times = []
    for _ in range(CALLS):
        forget()
        t = time.process_time()
        fn()
        times.append((time.process_time() - t) * 1000)
    return statistics.median(times)


def main() -> None:
    finished = int(sys.argv[1]) if len(sys.argv) > 1 else 500_000
    print(f"machine: {machine()}")
    t0 = time.perf_counter()
    d = build(finished)
    print(f"{finished:,} finished jobs and 1,000 pending in SQLite (built in {time.perf_counter() - t0:.1f} s)")
    from sqlalchemy import func, select

    from scheduler.models import Job

    cluster = lambda: d.overview.cluster("bench")  # noqa: E731
    cluster()  # the first call counts the finished jobs once
    t = Job.__table__.c
    every = select(t.state, t.queue, func.count()).group_by(t.state, t.queue)

    def count_every_job():
        with d.engine.connect() as c:
            c.execute(every).all()

    print(f"median CPU of {CALLS} calls:")
    print(f"  GET /v1/cluster, the finished jobs' counts kept:            {cpu_ms(cluster, lambda: None):8.2f} ms")
    print(f"  GET /v1/cluster, the finished jobs counted in the database: {cpu_ms(cluster, d.store.forget_counts):8.2f} ms")
    print(f"  GET /v1/queues (pending and running jobs only):             {cpu_ms(d.overview.queues, lambda: None):8.2f} ms")
    print(f"  every job counted by state and queue (what each of these calls and each /metrics scrape "
          f"ran before): {cpu_ms(count_every_job, lambda: None):.2f} ms")

    from scheduler import models as m
    from scheduler.daemon import Caller
    from scheduler.daemon.jobs import JobFilter

    op, user = Caller("root", "admin"), Caller(USERS[7], "user")
    day = d.accounting.jobs(op, None, None)["jobs"]
    print(f"  sacct, every user's jobs of the last 24 hours ({len(day):,} jobs):      "
          f"{cpu_ms(lambda: d.accounting.jobs(op, None, None), lambda: None):8.2f} ms")
    mine = d.accounting.jobs(user, None, None)["jobs"]
    print(f"  sacct, one user's jobs of the last 24 hours ({len(mine):,} jobs):         "
          f"{cpu_ms(lambda: d.accounting.jobs(user, None, None), lambda: None):8.2f} ms")
    print(f"  sreport, usage by account over the last 24 hours:             "
          f"{cpu_ms(lambda: d.accounting.report(op, 'account', None, None), lambda: None):8.2f} ms")
    for what, f in (("all=true&limit=100 (the newest jobs)", JobFilter(all=True, limit=100)),
                    ("all=true&state=COMPLETED&limit=100", JobFilter(all=True, states=frozenset({m.COMPLETED}), limit=100)),
                    ("all=true&state=FAILED,CANCELLED&limit=100",
                     JobFilter(all=True, states=frozenset({m.FAILED, m.CANCELLED}), limit=100))):
        print(f"  GET /v1/jobs?{what}: {cpu_ms(lambda f=f: d.jobs.list(op, f), lambda: None):8.2f} ms")
    d.engine.dispose()


if __name__ == "__main__":
    main()
