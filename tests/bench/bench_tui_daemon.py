"""TUI benchmark against a real daemon: first full paint, refresh tick and memory with a
`trainyard daemon` process holding 1,000 nodes and 10,000 jobs, through the TUI's real backend
(tui.backend.HttpBackend over scheduler.client.Client).

The daemon's database is filled with the daemon's own code (Daemon.prepare, then Core bulk
inserts) in a child process, so the benchmark process holds only the TUI. The nodes point at a
closed port on loopback: the daemon's links fail and retry with backoff (up to 10 s), which is
load the daemon really carries; `node_grace_s` is raised so the RUNNING jobs on them stay
RUNNING. Those nodes never send telemetry, so a nodes tick redraws rows whose cells do not
change (bench_tui.py's fake changes every visible row per tick). Run:
    .venv/bin/python tests/bench/bench_tui_daemon.py [NODES] [JOBS] [WIDTHxHEIGHT]
"""

from __future__ import annotations

import asyncio
import os
import resource
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from _harness import ROOT, discard, machine, readers_cpu_s

SIZE = (200, 50)  # as bench_tui.py
TICKS = 10
SETTLE_S = 20  # seconds between the daemon answering and the measurement (see main)
GPUS = 8
PAINT: list[float] = []  # seconds in Screen._compositor_refresh (a frame's rendering), per frame
DECODE: list[tuple[float, int]] = []  # (seconds, bytes) per httpx.Response.json() call


def _instrument() -> None:
    """Time the compositor (as bench_tui.py does) and the client's JSON decoding."""
    from textual.screen import Screen

    compositor = Screen._compositor_refresh

    def timed_refresh(self):
        t0 = time.perf_counter()
        try:
            return compositor(self)
        finally:
            PAINT.append(time.perf_counter() - t0)

    Screen._compositor_refresh = timed_refresh
    decode = httpx.Response.json

    def timed_json(self, **kw):
        t0 = time.perf_counter()
        try:
            return decode(self, **kw)
        finally:
            DECODE.append((time.perf_counter() - t0, len(self.content)))

    httpx.Response.json = timed_json


# -------------------------------------------------------------------------- the daemon's state

def fill(home: Path, nodes: int, jobs: int, port: int) -> None:
    """Build the database with the daemon's code; print an admin token. Runs in a child process."""
    from sqlalchemy import insert

    from scheduler.config import DaemonConfig
    from scheduler.daemon import Daemon
    from scheduler.models import Job, Node

    d = Daemon(DaemonConfig(db=str(home / "trainyard.db")), home)
    d.prepare()
    now = time.time()
    names = [f"gpu-{i:04d}" for i in range(nodes)]
    node_rows = [Node(
        name=name, address="127.0.0.1", port=port, pool="aws-a100" if i % 2 == 0 else "onprem-h100",
        provider="aws" if i % 2 == 0 else "onprem", gpu_model="A100-80GB" if i % 2 == 0 else "H100-80GB",
        gpus_total=GPUS, gpu_indices=list(range(GPUS)), cpus=96, mem_mb=1_048_576,
        labels={"zone": f"z{i % 3}"}, state="UP", created_at=now - 86400,
    ).model_dump() for i, name in enumerate(names)]
    # ~20 % RUNNING (packed onto the nodes), 50 % PENDING, 10 % HELD, 20 % COMPLETED
    states = ["RUNNING", "PENDING", "PENDING", "HELD", "PENDING", "COMPLETED", "PENDING", "PENDING",
              "RUNNING", "COMPLETED"]
    users, queues = ["ana", "bo", "chen", "dara", "eli"], ["default", "research", "prod"]
    free = {n: list(range(GPUS)) for n in names}
    cursor = 0
    job_rows = []
    for j in range(1, jobs + 1):
        state = states[j % len(states)]
        gpus = [1, 2, 4, 8][j % 4]
        submit = now - 7200 + j * 0.5
        row = dict(id=j, name=f"train-{j}", user=users[j % 5], queue=queues[j % 3], state=state,
                   reason={"PENDING": "Resources", "HELD": "Held"}.get(state, ""),
                   command=["python", "train.py", f"--seed={j}"], gpus=gpus, nodes=1, cpus=8,
                   mem_mb=65536, time_limit_s=4 * 3600, priority=100 + j % 7,
                   account="infra" if j % 10 == 0 else "", submit_time=submit, eligible_time=submit)
        if state == "RUNNING":
            while cursor < len(names) and len(free[names[cursor]]) < gpus:
                cursor += 1
            if cursor == len(names):  # the cluster is full: it waits
                row.update(state="PENDING", reason="Resources")
            else:
                node = names[cursor]
                taken, free[node] = free[node][:gpus], free[node][gpus:]
                row.update(start_time=submit + 60, allocation=[{"node": node, "gpus": taken}])
        elif state == "COMPLETED":
            row.update(start_time=submit + 60, end_time=submit + 660, exit_code=0)
        job_rows.append(Job(**row).model_dump())
    with d.store.tx() as s:
        s.execute(insert(Node.__table__), node_rows)
        s.execute(insert(Job.__table__), job_rows)
    print(d.create_token("bench", "admin", "bench"), flush=True)
    d.engine.dispose()


def closed_port() -> int:
    """A loopback port nothing listens on: connecting to it is refused at once."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_s(pid: int) -> float:
    """User + system CPU seconds a daemon and its reader processes (which build its job
    listings) have used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK") + readers_cpu_s(pid)


def rss_mb(pid: int | str = "self", key: str = "VmRSS") -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


def start_daemon(base: Path, nodes: int, jobs: int) -> tuple[subprocess.Popen, str, str, float]:
    env = {**os.environ, "HOME": str(base), "TRAINYARD_HOME": str(base / "state"),
           "XDG_CONFIG_HOME": str(base / "config"), "PYTHONUNBUFFERED": "1"}
    env.pop("TRAINYARD_URL", None)
    env.pop("TRAINYARD_TOKEN", None)
    t0 = time.perf_counter()
    token = subprocess.run([sys.executable, __file__, "--fill", str(base / "state"), str(nodes), str(jobs),
                            str(closed_port())], env=env, cwd=ROOT, check=True, capture_output=True,
                           text=True).stdout.strip().splitlines()[-1]
    fill_s = time.perf_counter() - t0
    config = base / "trainyard.toml"
    config.write_text("[daemon]\nnode_grace_s = 3600\n")  # keep the RUNNING jobs RUNNING
    port = closed_port()
    log = open(base / "daemon.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "scheduler.cli", "daemon", "--listen", f"127.0.0.1:{port}",
                             "--config", str(config)], env=env, cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=log)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"daemon exited {proc.returncode}: {(base / 'daemon.log').read_text()[-3000:]}")
        try:
            if httpx.get(url + "/healthz", timeout=2).status_code == 200:
                break
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            raise SystemExit("daemon did not answer /healthz within 60 s")
        time.sleep(0.1)
    return proc, url, token, fill_s


# -------------------------------------------------------------------------- the TUI against it

async def tick(app, pilot, source: str) -> tuple[float, float, int, float, float]:
    """One refresh of `source`, as bench_tui.py times it, plus the fetch: the HTTP request and
    its JSON decoding on a worker thread (as the app's fetch worker does), then on the UI thread
    apply the answer and diff the table (update), then the frame that shows it (paint)."""
    call = app.query_for(source)
    await pilot.pause()
    DECODE.clear()
    t0 = time.perf_counter()
    data = await asyncio.to_thread(call, app.backend)
    fetch = time.perf_counter() - t0
    decode, size = sum(d for d, _ in DECODE), sum(n for _, n in DECODE)
    await pilot.pause()
    t0 = time.perf_counter()
    app.state.apply(source, data, app.now())
    app.data_changed(source)
    update = time.perf_counter() - t0
    PAINT.clear()
    await pilot.pause()  # the frame that shows it
    return fetch, decode, size, update, sum(PAINT)


async def real_cycle(app, pilot, source: str) -> float:
    """Wall time of the app's own refresh path: fetch() -> worker thread -> Fetched message ->
    apply + diff -> the frame that shows it."""
    await pilot.pause()
    before = app.state.fetched_at.get(source)
    t0 = time.perf_counter()
    app.fetch(source)
    while app.state.fetched_at.get(source) == before:
        await asyncio.sleep(0.001)
    await pilot.pause()
    return time.perf_counter() - t0


def ms(x: float) -> str:
    return f"{x * 1000:5.1f} ms"


async def measure(url: str, token: str, nodes: int, size: tuple[int, int], daemon_pid: int) -> dict:
    from tui.app import TrainyardApp
    from tui.backend import HttpBackend

    base = rss_mb()
    app = TrainyardApp(HttpBackend(url, token), refresh=3600, stream=False)
    out: dict = {"base_mb": base}
    wall0 = time.time()
    t0 = time.perf_counter()
    async with app.run_test(size=size) as pilot:
        while app.query_one("#nodes-table").row_count < nodes or "cluster" not in app.state.fetched_at:
            if time.perf_counter() - t0 > 60:
                raise SystemExit(f"no full paint in 60 s: {app.state.errors}")
            await pilot.pause(0.005)
        await pilot.pause()
        out["first_paint"] = time.perf_counter() - t0
        # when each source's first answer was decoded, on its worker thread (Fetched's time)
        out["arrived"] = {k: v - wall0 for k, v in sorted(app.state.fetched_at.items(), key=lambda kv: kv[1])}
        c0, w0 = cpu_s(daemon_pid), time.perf_counter()
        out["nodes"] = [await tick(app, pilot, "nodes") for _ in range(TICKS)]
        out["nodes_daemon_cpu"] = (cpu_s(daemon_pid) - c0) / (time.perf_counter() - w0)
        out["nodes_real"] = [await real_cycle(app, pilot, "nodes") for _ in range(TICKS)]
        app.switch_view("jobs")
        await pilot.pause()
        out["job_rows"] = app.query_one("#jobs-table").row_count
        c0, w0 = cpu_s(daemon_pid), time.perf_counter()
        out["jobs"] = [await tick(app, pilot, "jobs") for _ in range(TICKS)]
        out["jobs_daemon_cpu"] = (cpu_s(daemon_pid) - c0) / (time.perf_counter() - w0)
        out["jobs_real"] = [await real_cycle(app, pilot, "jobs") for _ in range(TICKS)]
        out["rss_mb"] = rss_mb()
        out["errors"] = dict(app.state.errors)
    return out


def report(r: dict, nodes: int, jobs: int, size: tuple[int, int], fill_s: float, daemon: dict) -> None:
    print(f"machine: {machine()}")
    print(f"terminal {size[0]}x{size[1]}; backend: HttpBackend -> real `trainyard daemon` (SQLite) holding "
          f"{nodes} nodes x {GPUS} GPUs (never connecting: no telemetry) and {jobs} jobs "
          f"(jobs table shows {r['job_rows']} rows: active jobs, first page); db filled in {fill_s:.1f} s")
    arrived = ", ".join(f"{k} {v * 1000:.0f}" for k, v in r["arrived"].items())
    print(f"first full paint:        {r['first_paint'] * 1000:7.0f} ms  (app start -> {nodes} node rows painted; "
          f"the six sources are fetched in parallel, answers decoded at ms: {arrived})")
    print("a tick = fetch (HTTP request + client JSON decode, on a worker thread as in the app) + update (apply "
          "+ table diff, UI thread) + paint (compositor, UI thread); bench_tui.py's tick is update + paint")
    for name in ("nodes", "jobs"):
        ticks = r[name]
        fetch, decode, size_b = [t[0] for t in ticks], [t[1] for t in ticks], ticks[0][2]
        update, paint = [t[3] for t in ticks], [t[4] for t in ticks]
        ui = [t[3] + t[4] for t in ticks]
        whole = [t[0] + t[3] + t[4] for t in ticks]
        print(f"refresh tick, {name:5}:  fetch {ms(statistics.median(fetch))} (of which JSON decode "
              f"{ms(statistics.median(decode))}, {size_b / 1e6:.1f} MB), update {ms(statistics.median(update))}, "
              f"paint {ms(statistics.median(paint))}; UI thread (update + paint, as bench_tui.py) "
              f"{ms(statistics.median(ui))}; whole tick {ms(statistics.median(whole))} median "
              f"({max(whole) * 1000:.1f} max); app's own path (fetch() -> worker -> message -> paint), wall "
              f"{ms(statistics.median(r[name + '_real']))}; daemon CPU (with its readers) {r[name + '_daemon_cpu'] * 100:.0f} % of a core")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"memory, TUI process:     {peak:7.0f} MB peak RSS (ru_maxrss), {r['rss_mb']:.0f} MB at the end, "
          f"{r['base_mb']:.0f} MB of it interpreter and imports before the app")
    print(f"memory, daemon process:  {daemon['rss']:7.0f} MB RSS (VmRSS), {daemon['hwm']:.0f} MB peak (VmHWM); "
          f"daemon CPU with no client, {SETTLE_S} s after start: {daemon['idle_cpu'] * 100:.0f} % of a core "
          f"(scheduling and housekeeping cycles, SSH reconnects)")
    if r["errors"]:
        print(f"fetch errors seen: {r['errors']}")


def main(nodes: int, jobs: int, size: tuple[int, int]) -> None:
    base = Path(tempfile.mkdtemp(prefix="trainyard-bench-tui-"))
    proc = None
    try:
        proc, url, token, fill_s = start_daemon(base, nodes, jobs)
        # Steady state: each link's reconnect backoff doubles from 0.2 s to its 10 s maximum in
        # ~13 s (with jitter); before that the daemon spends most of a core on reconnects.
        time.sleep(SETTLE_S)
        c0 = cpu_s(proc.pid)
        time.sleep(2)
        idle_cpu = (cpu_s(proc.pid) - c0) / 2
        _instrument()
        r = asyncio.run(measure(url, token, nodes, size, proc.pid))
        daemon = {"rss": rss_mb(proc.pid), "hwm": rss_mb(proc.pid, "VmHWM"), "idle_cpu": idle_cpu}
        report(r, nodes, jobs, size, fill_s, daemon)
    finally:
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        discard(base)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--fill"]:
        fill(Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))
        sys.exit(0)
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 1000
    j = int(sys.argv[2]) if len(sys.argv) > 2 else 10000
    w, _, h = (sys.argv[3] if len(sys.argv) > 3 else "x".join(map(str, SIZE))).partition("x")
    main(n, j, (int(w), int(h)))
