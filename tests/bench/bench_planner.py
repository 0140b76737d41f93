"""Benchmark: one planner pass with 10,000 pending jobs on 1,000 nodes x 8 GPUs.

    .venv/bin/python tests/bench/bench_planner.py [--policy fairshare] [--passes 7]

The cluster is 85% busy with running jobs that have time limits (so EASY backfill computes
reservations), 200 users in 20 teams carry decayed usage (so fair share has work to do), and
the pending jobs mix 1-8 GPU jobs with 2-4 node gangs over three queues. Prints the median
pass as `N ms` (plus min and max) and what the pass decided.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from scheduler.planner import (  # noqa: E402
    JobView,
    NodeView,
    PolicyConfig,
    QueueView,
    Snapshot,
    plan,
)


def build(seed: int = 1, nodes: int = 1000, gpus: int = 8, pending: int = 10_000,
          busy: float = 0.85) -> Snapshot:
    rng = random.Random(seed)
    now = 1_000_000.0
    free = {f"node{i:04d}": list(range(gpus)) for i in range(nodes)}
    running: list[JobView] = []
    jid = 1
    names = list(free)
    target = int(nodes * gpus * busy)
    used = 0
    while used < target:
        name = rng.choice(names)
        if not free[name]:
            continue
        g = min(rng.choice([1, 1, 2, 4, 8]), len(free[name]))
        take, free[name] = free[name][:g], free[name][g:]
        user = f"u{rng.randrange(200)}"
        start = now - rng.uniform(0, 20_000)
        running.append(JobView(
            jid, user, rng.choice(["high", "normal", "low"]), gpus=g, start_time=start,
            allocation=((name, tuple(take)),), time_limit_s=rng.choice([3600, 14400, 86400]),
            account=f"team{int(user[1:]) % 20}", submit_time=start - 100))
        jid += 1
        used += g
    node_views = tuple(
        NodeView(name, gpus, tuple(free[name]), cpus_total=64, cpus_free=64,
                 labels={"rack": f"r{i // 50:02d}", "switch": f"s{i // 200}"})
        for i, name in enumerate(names)
    )
    pend: list[JobView] = []
    for _ in range(pending):
        r = rng.random()
        if r < 0.05:
            g, k = 8, rng.choice([2, 3, 4])
        else:
            g, k = rng.choice([1, 1, 1, 2, 4, 8]), 1
        user = f"u{rng.randrange(200)}"
        pend.append(JobView(
            jid, user, rng.choice(["high", "normal", "normal", "low"]), gpus=g, nodes=k,
            submit_time=now - rng.uniform(0, 50_000),
            time_limit_s=rng.choice([None, 600, 3600, 14400]),
            account=f"team{int(user[1:]) % 20}", nice=rng.choice([0, 0, 0, 100])))
        jid += 1
    usage = {}
    for u in range(200):
        usage[f"user:u{u}"] = rng.uniform(0, 1e6)
    for t in range(20):
        usage[f"team:team{t}"] = sum(v for k, v in usage.items()
                                     if k.startswith("user:") and int(k[6:]) % 20 == t)
    queues = {"high": QueueView("high", 10, default_time_limit_s=3600),
              "normal": QueueView("normal", 5, default_time_limit_s=7200),
              "low": QueueView("low", 1, default_time_limit_s=14400)}
    return Snapshot(node_views, tuple(pend), tuple(running), queues=queues, usage=usage)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--policy", default="fairshare", help="fifo, backfill, fairshare or las")
    ap.add_argument("--passes", type=int, default=7)
    args = ap.parse_args()
    snap = build()
    policy = PolicyConfig.preset(args.policy)
    times = []
    for _ in range(args.passes):
        t0 = time.perf_counter()
        d = plan(snap, 1_000_000.0, policy)
        times.append((time.perf_counter() - t0) * 1000)
    reasons: dict[str, int] = {}
    for w in d.waits:
        reasons[w.reason] = reasons.get(w.reason, 0) + 1
    print(f"planner pass, policy {args.policy}: {len(snap.pending)} pending, {len(snap.running)} "
          f"running, {len(snap.nodes)} nodes x 8 GPUs")
    print(f"decided: {len(d.starts)} starts ({sum(s.reason == 'backfill' for s in d.starts)} "
          f"backfilled), {len(d.preempts)} preemptions, waits {reasons}")
    print(f"min {min(times):.1f} ms, max {max(times):.1f} ms over {args.passes} passes")
    print(f"{statistics.median(times):.0f} ms")


if __name__ == "__main__":
    main()
