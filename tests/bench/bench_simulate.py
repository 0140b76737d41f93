"""Benchmark: replay the full Philly trace (82,247 jobs) once per policy; budget 60 s each.

    .venv/bin/python tests/bench/bench_simulate.py [--cluster SPEC] [--policy fifo,las]
        [--plot docs/philly-helios-vcs.png] [--json-out results.json]

Prints, per policy, the replay's wall-clock seconds as `policy: N s` and then the metrics
table that docs/simulation.md publishes. The cluster defaults to the Helios per-VC node
table shipped beside the trace (11 VCs, 352 nodes x 8 GPUs).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from scheduler.planner import PolicyConfig  # noqa: E402
from scheduler.planner.policy import PRESETS  # noqa: E402
from scheduler.simulate import load_trace, parse_cluster, render_table, save_plot, simulate_policy  # noqa: E402

DATA = ROOT.parent / "shared" / "data" / "traces" / "philly"
BUDGET_S = 60.0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", default=str(DATA / "philly.csv"))
    ap.add_argument("--cluster", default=str(DATA / "philly_vc_nodes_helios.csv"))
    ap.add_argument("--policy", default=",".join(PRESETS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--plot")
    ap.add_argument("--json-out")
    args = ap.parse_args()
    if not Path(args.trace).exists():
        print(f"no trace at {args.trace}; pass --trace", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    trace = load_trace(args.trace)
    print(f"loaded {len(trace):,} jobs in {time.perf_counter() - t0:.1f} s")
    cluster = parse_cluster(args.cluster)
    results = []
    over = []
    for name in args.policy.split(","):
        t0 = time.perf_counter()
        r = simulate_policy(trace, cluster, PolicyConfig.preset(name), seed=args.seed)
        took = time.perf_counter() - t0
        results.append(r)
        print(f"{name}: {took:.1f} s ({r['planner_passes']:,} planner passes)", flush=True)
        if took > BUDGET_S:
            over.append(name)
    print(render_table(results))
    if args.plot:
        save_plot(results, args.plot, f"Philly trace on {Path(args.cluster).name}")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(
            [{k: v for k, v in r.items() if not k.startswith("_")} for r in results], indent=2))
    if over:
        print(f"over the {BUDGET_S:.0f} s budget: {', '.join(over)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
