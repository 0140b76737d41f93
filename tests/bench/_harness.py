"""Shared by the benchmarks: start `trainyard demo --no-tui` or a bare daemon as real processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


@contextmanager
def demo(nodes: int = 4, gpus: int = 8):
    base = Path(tempfile.mkdtemp(prefix="trainyard-bench-"))
    env = {**os.environ, "HOME": str(base), "XDG_CONFIG_HOME": str(base / "cfg")}
    proc = subprocess.Popen([sys.executable, "-m", "scheduler.cli", "demo", "--no-tui", "--idle", "--nodes", str(nodes),
                             "--gpus-per-node", str(gpus), "--dir", str(base / "demo")], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        url = proc.stdout.readline().strip().split("=", 1)[1]
        token = proc.stdout.readline().strip().split("=", 1)[1]
        yield url, token, proc
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(30)


def cpu_s(pid: int) -> float:
    """CPU seconds (user + system) of the process `pid` itself."""
    fields = open(f"/proc/{pid}/stat").read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def tree_cpu_s(pid: int) -> float:
    """CPU seconds of `pid` and of all its descendants: the live ones, and what the ones that
    ended left in their parents' counts of waited-for children (a demo's agents, their job
    supervisors and the jobs)."""
    children: dict[int, list[tuple[int, list[str]]]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = open(f"/proc/{entry}/stat").read().rpartition(")")[2].split()
            except OSError:  # it ended meanwhile
                continue
            children.setdefault(int(fields[1]), []).append((int(entry), fields))
    hz = os.sysconf("SC_CLK_TCK")

    def total(p: int, fields: list[str]) -> float:
        own = sum(int(x) for x in fields[11:15]) / hz  # utime, stime, cutime, cstime
        return own + sum(total(c, f) for c, f in children.get(p, []))

    return total(pid, open(f"/proc/{pid}/stat").read().rpartition(")")[2].split())


def machine() -> str:
    cpu = "unknown CPU"
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{os.cpu_count()} cores, {cpu}"


def percentile(values: list[float], p: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(round(p / 100 * (len(s) - 1))))]


def now() -> float:
    return time.perf_counter()
