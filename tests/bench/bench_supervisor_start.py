"""A job supervisor's start on a node: a fresh interpreter (`wrap`) against a supervisor of the
agent's zygote (forked ahead of the job, or one whose job ended: zygote.py's pool), from the
agent's request to the job's own process existing. Prints its figures."""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from _harness import machine, percentile

from scheduler.nodes import agent_bundle
from scheduler.zygote import Zygote


def job_dirs(base: Path, prefix: str, n: int) -> list[str]:
    dirs = []
    for i in range(n):
        d = base / f"{prefix}{i}.0"
        (d / "work").mkdir(parents=True)
        (d / "spec.json").write_text(json.dumps({"argv": ["true"], "env": {"PATH": os.defpath},
                                                 "cwd": str(d / "work")}))
        dirs.append(str(d))
    return dirs


def starts(zygote: Zygote, dirs: list[str]) -> tuple[list[float], list[float]]:
    """Per start: ms the agent is blocked in launch(), ms until the job's pid is written."""
    blocked, started = [], []
    for d in dirs:
        t0 = time.perf_counter()
        supervisor = zygote.launch(d)
        t1 = time.perf_counter()
        pid = os.path.join(d, "pid")
        while not os.path.exists(pid):
            time.sleep(0.0002)
        blocked.append((t1 - t0) * 1000)
        started.append((time.perf_counter() - t0) * 1000)
        if supervisor is not None:
            supervisor.wait()
    return blocked, started


def main(n: int = 200) -> None:
    print(f"machine: {machine()}, load average {os.getloadavg()[0]:.2f}")
    with tempfile.TemporaryDirectory(prefix="trainyard-bench-") as tmp:
        base = Path(tmp)
        data, digest = agent_bundle()
        bundle = base / f"agent-{digest}.pyz"  # as on a node: the bundle with its bytecode
        bundle.write_bytes(data)
        for name, forking in (("fresh interpreter (wrap)", False),
                              ("through the zygote (a supervisor that waits: the spare, or one whose job ended)", True)):
            zygote = Zygote(str(bundle), forking=forking)
            zygote.start()
            starts(zygote, job_dirs(base, f"warm-{forking}-", 5))
            blocked, started = starts(zygote, job_dirs(base, f"{forking}-", n))
            zygote.close()
            print(f"{name}, {n} starts: launch to job running p50 {statistics.median(started):.1f} "
                  f"ms, p99 {percentile(started, 99):.1f} ms; agent blocked p50 "
                  f"{statistics.median(blocked):.2f} ms")


if __name__ == "__main__":
    main(int(sys.argv[1]) if sys.argv[1:] else 200)
