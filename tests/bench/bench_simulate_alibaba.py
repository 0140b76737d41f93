"""Benchmark: replay Alibaba's GPU pod list (cluster-trace-gpu-v2023) at 80% offered load.

    .venv/bin/python tests/bench/bench_simulate_alibaba.py [bench_simulate.py's options]

The second public trace of docs/simulation.md, every policy, printed as bench_simulate.py
prints the Philly window. Its busy stretch is days 110-149 (seconds 9,504,000-12,902,400):
before it the trace holds only six long-running pods. The data is not committed;
`scripts/fetch_trace.sh alibaba` fetches it (600 kB) into ../shared/data/traces/alibaba-gpu-2023.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_simulate  # noqa: E402

TRACE = (bench_simulate.ROOT.parent / "shared" / "data" / "traces" / "alibaba-gpu-2023"
         / "openb_pod_list_default.csv")


def main() -> int:
    args = sys.argv[1:]
    if "--trace" not in args:
        if not TRACE.exists():
            print(f"no Alibaba trace at {TRACE}: nothing replayed; fetch it with "
                  "scripts/fetch_trace.sh alibaba (needs github.com)")
            return 0
        args = ["--trace", str(TRACE), *args]
    if "--window" not in args and "--full" not in args:
        args = ["--window", "9504000", "12902400", *args]
    return bench_simulate.main(args)


if __name__ == "__main__":
    sys.exit(main())
