"""Benchmark: replay the Philly window of Helios' simulation at 80% offered load, every policy.

    .venv/bin/python tests/bench/bench_simulate.py [--load 0.8] [--window 2017-10-01 2017-11-30]
        [--policy fifo,las] [--cluster pooled|per-vc|SPEC] [--first N] [--plot out.png]
        [--json-out r.json]

Prints, per policy, the replay's wall-clock seconds as `policy: N s`, its CPU seconds and the
1-minute load average (the machine may be shared: CPU seconds are what the replay costs), then
the metrics table that docs/simulation.md publishes (each policy's mean JCT over the oracle's).
Budget: 60 s per policy on the development machine (2 cores). `--load 0 --cluster SPEC`
replays on a fixed cluster (e.g. `--full --load 0 --cluster .../philly_vc_nodes_helios.csv`).
`--first N` replays only the window's first N jobs on the cluster sized for the whole window:
a quick check that a change to the planner leaves every decision as it was (compare the
`--json-out` files of two runs: avg_jct_s, p99_jct_s and preemptions must be identical).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from scheduler.planner import PolicyConfig  # noqa: E402
from scheduler.planner.policy import SIMULATION_PRESETS  # noqa: E402
from scheduler.simulate import (  # noqa: E402
    offered_load,
    parse_cluster,
    render_table,
    save_plot,
    simulate_policy,
    size_for_load,
)
from scheduler.traces import parse_window, read_trace  # noqa: E402

DATA = ROOT.parent / "shared" / "data" / "traces" / "philly"
BUDGET_S = 60.0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", default=str(DATA / "philly.csv"))
    ap.add_argument("--cluster", default="pooled")
    ap.add_argument("--load", type=float, default=0.8)
    ap.add_argument("--window", nargs=2, default=["2017-10-01", "2017-11-30"])
    ap.add_argument("--full", action="store_true", help="the whole trace, no window")
    ap.add_argument("--policy", default=",".join(SIMULATION_PRESETS))
    ap.add_argument("--first", type=int, metavar="N",
                    help="replay only the first N jobs (the cluster is sized for the whole window)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--plot")
    ap.add_argument("--json-out")
    args = ap.parse_args(argv)
    if not Path(args.trace).exists():
        print(f"no trace at {args.trace}; pass --trace", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    trace = read_trace(args.trace, None if args.full else parse_window(*args.window))
    print(f"loaded {len(trace.jobs):,} jobs in {time.perf_counter() - t0:.1f} s")
    if args.load > 0:
        cluster = size_for_load(trace.jobs, trace.span_s, args.load, args.cluster, 8)
    else:
        cluster = parse_cluster(args.cluster)
    gpus = len(cluster.nodes) * cluster.gpus_per_node
    print(f"cluster: {len(cluster.nodes)} nodes x {cluster.gpus_per_node} GPUs, offered load "
          f"{offered_load(trace.jobs, trace.span_s, gpus):.1%}")
    jobs = trace.jobs
    if args.first is not None:
        if args.first < 1:
            print(f"--first {args.first}: give a number of jobs >= 1", file=sys.stderr)
            return 2
        jobs = jobs[: args.first]
        print(f"replaying the first {len(jobs):,} jobs")
    results = []
    over = []
    for name in args.policy.split(","):
        t0, c0 = time.perf_counter(), time.process_time()
        r = simulate_policy(jobs, cluster, PolicyConfig.preset(name), seed=args.seed)
        took, cpu = time.perf_counter() - t0, time.process_time() - c0
        results.append(r)
        load1 = os.getloadavg()[0]
        print(f"{name}: {took:.1f} s ({cpu:.1f} s of CPU; load average {load1:.1f} on "
              f"{os.cpu_count()} CPUs; {r['planner_passes']:,} planner passes): mean JCT "
              f"{r['avg_jct_s']:,.0f} s, p99 {r['p99_jct_s']:,.0f} s, "
              f"{r['preemptions'] / max(1, r['jobs']):.3f} preemptions per job", flush=True)
        r["wall_s"], r["cpu_s"] = round(took, 1), round(cpu, 1)
        r["load_average"] = round(load1, 1)
        if took > BUDGET_S:
            over.append(name)
        if args.json_out:  # after each policy, so a long run that is cut short keeps its part
            Path(args.json_out).write_text(json.dumps(
                [{k: v for k, v in x.items() if not k.startswith("_")} for x in results],
                indent=2))
    oracle = next((r for r in results if r["policy"] == "oracle"), None)
    if oracle:
        for r in results:
            r["avg_jct_vs_oracle"] = r["avg_jct_s"] / oracle["avg_jct_s"]
    print(render_table(results))
    if args.plot:
        save_plot(results, args.plot, f"{Path(args.trace).name}, {len(cluster.nodes)} x 8 GPUs")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(
            [{k: v for k, v in x.items() if not k.startswith("_")} for x in results], indent=2))
    if over:
        print(f"over the {BUDGET_S:.0f} s budget: {', '.join(over)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
