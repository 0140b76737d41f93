"""Follow lag of central logs: how long after a job prints a line `trainyard logs --follow` shows it.

Starts the demo (simulated nodes that run jobs as real local processes, streaming their output
through the same agent code as real nodes), submits a job that prints `time.time()` every 100 ms
for 20 s, and runs `trainyard logs ID --follow` (the CLI's own follow loop) reading its stdout.
Each line's lag is its arrival time minus the time printed in it (one machine, one clock).
Prints p50/p95/max lag, the lines seen and the load average; the target is p95 <= 2 s. Run:
    .venv/bin/python tests/bench/bench_log_follow.py [SECONDS] [INTERVAL_S]
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

from _harness import ROOT, demo, machine, percentile

from scheduler.client import Client

TARGET_S = 2.0


def follow(url: str, token: str, job_id: int, expected: int) -> list[float]:
    """Lag of each line of the job's output as `trainyard logs --follow` prints it."""
    env = {**os.environ, "TRAINYARD_URL": url, "TRAINYARD_TOKEN": token}
    proc = subprocess.Popen([sys.executable, "-m", "scheduler.cli", "logs", str(job_id), "--follow"],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True, bufsize=1)
    lags: list[float] = []
    assert proc.stdout is not None
    for line in proc.stdout:
        arrived = time.time()
        try:
            lags.append(arrived - float(line))
        except ValueError:
            continue  # not one of the job's timestamps
    rc = proc.wait()
    if rc != 0:
        raise SystemExit(f"trainyard logs --follow exited {rc}")
    if len(lags) != expected:
        print(f"warning: {len(lags)} lines arrived, the job printed {expected}")
    return lags


def main() -> None:
    seconds = float(sys.argv[1]) if len(sys.argv) > 1 else 20.0
    interval = float(sys.argv[2]) if len(sys.argv) > 2 else 0.1
    lines = int(seconds / interval)
    script = (f"import time\nfor _ in range({lines}):\n    print(time.time(), flush=True)\n"
              f"    time.sleep({interval})\n")
    with demo(nodes=2, gpus=4) as (url, token, _):
        c = Client(url, token)
        job = c.submit({"command": ["python3", "-c", script], "name": "follow-lag", "gpus": 1})
        lags = follow(url, token, job["id"], lines)
        load = os.getloadavg()
    if not lags:
        raise SystemExit("no line arrived")
    p50, p95, worst = percentile(lags, 50), percentile(lags, 95), max(lags)
    print(f"follow lag over {len(lags)} lines ({interval * 1000:.0f} ms apart, {seconds:.0f} s): "
          f"p50 {p50 * 1000:.0f} ms, p95 {p95 * 1000:.0f} ms, max {worst * 1000:.0f} ms "
          f"(target p95 <= {TARGET_S:.0f} s: {'met' if p95 <= TARGET_S else 'MISSED'})")
    print(f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} on {machine()}")


if __name__ == "__main__":
    main()
