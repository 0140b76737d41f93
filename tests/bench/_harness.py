"""Shared by the benchmarks: start `trainyard demo --no-tui` or a bare daemon as real processes."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
# where the benchmarks set their directories aside; `make bench` empties it once all have run
TRASH = Path(tempfile.gettempdir()) / "trainyard-bench-trash"


def discard(path: Path) -> None:
    """Set a finished benchmark's directory aside (a rename) for `make bench` to remove at its end,
    instead of removing it now. On ext4 without a journal (this machine's root file system) each
    file created is placed past every inode freed in the last 1-5 minutes, and the kernel reads
    each of them to find out: a demo's tens of thousands of files removed right before the next
    benchmark made that one's file creations (the nodes' job files, the daemon's logs) a fifth
    of the machine's CPU. Removed at once where it cannot be moved (another file system)."""
    try:
        TRASH.mkdir(exist_ok=True)
        path.rename(TRASH / path.name)
    except OSError:
        shutil.rmtree(path, ignore_errors=True)


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
        discard(base)  # a demo's state: 10,000 jobs' logs after some runs


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


def readers(pid: int) -> list[int]:
    """The daemon `pid`'s reader processes (scheduler/daemon/readers.py): its fork server and
    the readers forked from it, which carry the fork server's command line."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmd = open(f"/proc/{entry}/cmdline", "rb").read()
                ppid = int(open(f"/proc/{entry}/stat").read().rpartition(")")[2].split()[1])
            except OSError:
                continue
            if b"multiprocessing.forkserver" in cmd:
                found.append((int(entry), ppid))
    ours = {p for p, ppid in found if ppid == pid}
    return sorted(ours | {p for p, ppid in found if ppid in ours})


def readers_cpu_s(pid: int) -> float:
    """CPU seconds of the daemon `pid`'s reader processes (the job listings it hands them)."""
    total = 0.0
    for p in readers(pid):
        try:
            total += cpu_s(p)
        except OSError:
            pass
    return total


def cpu_by_part(pid: int) -> dict[str, float]:
    """CPU seconds of a demo (`pid`) by part: the daemon itself; the simulated nodes' SSH
    servers (their process); the agents; their zygotes; the job supervisors with their jobs
    (the zygotes' waited-for children and the live ones). An agent's own waited-for children
    (supervisors it started itself, had a zygote failed) count with the supervisors."""
    hz = os.sysconf("SC_CLK_TCK")
    procs: dict[int, tuple[int, list[str], str]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = open(f"/proc/{entry}/stat").read().rpartition(")")[2].split()
                cmd = open(f"/proc/{entry}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace")
            except OSError:  # it ended meanwhile
                continue
            procs[int(entry)] = (int(fields[1]), fields, cmd)
    children: dict[int, list[int]] = {}
    for p, (ppid, _, _) in procs.items():
        children.setdefault(ppid, []).append(p)
    parts = dict.fromkeys(("daemon", "SSH servers", "agents", "zygotes", "supervisors and jobs"), 0.0)

    def own(p: int) -> float:
        return (int(procs[p][1][11]) + int(procs[p][1][12])) / hz

    def waited(p: int) -> float:
        return (int(procs[p][1][13]) + int(procs[p][1][14])) / hz

    def tree(p: int) -> float:
        return own(p) + waited(p) + sum(tree(c) for c in children.get(p, []))

    def walk(p: int) -> None:
        cmd = procs[p][2]
        if p == pid:
            parts["daemon"] += own(p)
        elif "scheduler.simnode" in cmd:
            parts["SSH servers"] += own(p)
        elif cmd.endswith(" zygote ") or cmd.endswith(" zygote"):
            parts["zygotes"] += own(p)
            parts["supervisors and jobs"] += waited(p) + sum(tree(c) for c in children.get(p, []))
            return
        elif ".pyz" in cmd:
            parts["agents"] += own(p)
            parts["supervisors and jobs"] += waited(p)
        else:  # a supervisor the agent started itself, or anything else below the demo
            parts["supervisors and jobs"] += tree(p)
            return
        for c in children.get(p, []):
            walk(c)

    if pid in procs:
        walk(pid)
    return parts


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


def machine_jiffies() -> tuple[int, int]:
    """(busy, all) clock ticks of every core since boot, from /proc/stat: what every process on
    the machine used, the benchmark's own included. Two readings give how busy the cores were
    between them (`busy_share`)."""
    fields = [int(x) for x in open("/proc/stat").readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle and iowait
    return sum(fields[:8]) - idle, sum(fields[:8])


def busy_share(before: tuple[int, int], after: tuple[int, int]) -> float:
    """The share of all the machine's cores' time that was busy between two `machine_jiffies()`."""
    return (after[0] - before[0]) / max(1, after[1] - before[1])


def percentile(values: list[float], p: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(round(p / 100 * (len(s) - 1))))]


def now() -> float:
    return time.perf_counter()
