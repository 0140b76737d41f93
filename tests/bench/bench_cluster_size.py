"""Cluster size: a `trainyard daemon` process with NODES simulated nodes x 8 GPUs connected over
SSH from a separate process (`python -m scheduler.simnode`, the fleet mode: real SSH servers whose
agent protocol is answered in-process), each sending telemetry every 2 s, with 5 running and 10
pending jobs per node (5,000 and 10,000 at 1,000 nodes; the running ones fill every GPU, so the
pending ones wait for resources and every scheduling cycle plans all of them). Prints the daemon's
CPU and RSS at steady state, the scheduling cycle, and GET /v1/jobs (one page) and GET /v1/nodes
latency (request written to the response's last byte read) while all of that runs, and while
Prometheus (this process, as deploy/prometheus.yml configures it) scrapes every node's GPUs every
15 s; GET /v1/nodes both as a plain client gets it and gzip-compressed, as the CLI and TUI (httpx)
ask for it. Run:
    .venv/bin/python tests/bench/bench_cluster_size.py [--health-history N] [--steady SECONDS] [NODES ...]
(default: 100 1000, 60 s of steady state)
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _harness import ROOT, discard, machine, percentile, readers, readers_cpu_s
from _http import Connection

GPUS = 8
STEADY_S = 60  # seconds of steady state measured (each node listing every other 0.5 s)
SCRAPE_S = 15  # Prometheus scrapes every node's GPUs this often (deploy/prometheus.yml)
PAGE = 100  # jobs in one page of GET /v1/jobs
# --health-history N: [health] history_samples (default 300): the window the GPU health rules
# look back over (kept up to date per sample, so its length costs memory, not CPU per sample)
HEALTH_HISTORY = 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def fill(home: Path, fleet: Path, db: str = "") -> None:
    """Register the fleet's nodes (host keys pinned) with the daemon's code; print an admin token.
    On PostgreSQL (`db`) it writes as a leader would, before any daemon campaigns."""
    import asyncssh

    from scheduler.config import DaemonConfig
    from scheduler.daemon import Daemon
    from scheduler.models import Node
    from scheduler.nodes import pin_host_key

    d = Daemon(DaemonConfig(db=db or str(home / "trainyard.db")), home)
    d.prepare()
    if d.leadership.postgres:
        d.leadership._take_office()
        d.leadership.role = "leader"
    key = asyncssh.import_public_key((fleet / "host_key.pub").read_bytes())
    ports = [line.split() for line in (fleet / "ports").read_text().splitlines()]
    with d.store.tx() as s:
        for name, port in ports:
            pin_host_key(d.known_hosts, "127.0.0.1", int(port), key)
            s.add(Node(name=name, address="127.0.0.1", port=int(port), user="fleet", pool="fleet",
                       provider="onprem", gpus_total=GPUS, simulated=True, state="DOWN", reason="connecting",
                       created_at=time.time()))
    print(d.create_token("bench", "admin", "bench"), flush=True)
    d.engine.dispose()


async def submit(url: str, token: str, bodies: list[dict], clients: int = 8) -> None:
    async def one(part: list[dict]) -> None:
        c = await Connection(url, token).open()
        for body in part:
            status, answer = await c.request("POST", "/v1/jobs", body)
            if status != 201:
                raise SystemExit(f"submit answered {status}: {answer}")
        await c.close()

    await asyncio.gather(*(one(bodies[i::clients]) for i in range(clients)))


async def wait_for(c: Connection, what: str, test, timeout: float) -> float:
    t0 = time.monotonic()
    while True:
        _, cluster = await c.request("GET", "/v1/cluster")
        if test(cluster):
            return time.monotonic() - t0
        if time.monotonic() - t0 > timeout:
            raise SystemExit(f"{what}: not reached in {timeout:.0f} s: {cluster}")
        await asyncio.sleep(1)


def cycle_stats(text: str) -> tuple[float, int]:
    """(sum seconds, count) of trainyard_schedule_cycle_seconds from the Prometheus text."""
    total = count = 0.0
    for line in text.splitlines():
        if line.startswith("trainyard_schedule_cycle_seconds_sum"):
            total = float(line.split()[-1])
        elif line.startswith("trainyard_schedule_cycle_seconds_count"):
            count = float(line.split()[-1])
    return total, int(count)


def gc_stats(text: str) -> dict[str, float]:
    """Per generation of the daemon's garbage collector (trainyard_gc_pause_seconds): the count
    of pauses, their sum in seconds, and how many lasted 50 ms or more."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith("trainyard_gc_pause_seconds"):
            continue
        name, value = line.rsplit(" ", 1)
        gen = name.split('generation="')[1][0]
        if name.startswith("trainyard_gc_pause_seconds_count"):
            out[f"n{gen}"] = float(value)
        elif name.startswith("trainyard_gc_pause_seconds_sum"):
            out[f"s{gen}"] = float(value)
        elif 'le="0.025"' in name:
            out[f"fast{gen}"] = float(value)
    for g in "012":
        out[f"long{g}"] = out.get(f"n{g}", 0) - out.get(f"fast{g}", 0)
    return out


async def metrics_text(url: str) -> str:
    reader, writer = await asyncio.open_connection("127.0.0.1", int(url.rsplit(":", 1)[1]))
    writer.write(b"GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n")
    data = await reader.read()
    writer.close()
    return data.decode(errors="replace")


async def scrape_every_node(url: str, token: str, names: list[str], stop: asyncio.Event,
                            lat: list[float]) -> None:
    """Prometheus with the DCGM dashboard's configuration (deploy/prometheus.yml): every node's
    target, /metrics/nodes/<node>, once per SCRAPE_S, spread evenly over the interval; the
    daemon's own /metrics once per interval too."""
    c = await Connection(url, token).open()
    t0, i = time.monotonic(), 0
    while not stop.is_set():
        delay = t0 + i * SCRAPE_S / len(names) - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        if i % len(names) == 0:  # and the daemon's own series, once per interval
            status, _ = await c.request("GET", "/metrics", decode=False)
            assert status == 200, status
        t = time.perf_counter()
        status, _ = await c.request("GET", f"/metrics/nodes/{names[i % len(names)]}", decode=False)
        lat.append(time.perf_counter() - t)
        assert status == 200, status
        i += 1
    await c.close()


async def measure(url: str, token: str, pid: int, nodes: int) -> dict:
    c = await Connection(url, token).open()
    t_up = await wait_for(c, "every node connected",
                          lambda x: x["nodes_up"] >= nodes, 60 + nodes * 0.3)
    print(f"  {nodes} nodes UP (connected over SSH, hello, sync) in {t_up:.1f} s")
    running = 5 * nodes
    # 3/5 of the running jobs take 2 GPUs, 2/5 take 1: 8 GPUs per node, every GPU busy
    bodies = [{"command": ["sleep", "100000"], "gpus": 2 if i % 5 < 3 else 1, "name": "running"}
              for i in range(running)]
    t0 = time.monotonic()
    await submit(url, token, bodies)
    t_run = await wait_for(c, f"{running} jobs RUNNING",
                           lambda x: x["jobs_by_state"].get("RUNNING", 0) >= running, 600)
    print(f"  {running:,} jobs submitted and RUNNING in {time.monotonic() - t0:.1f} s (last wait {t_run:.1f} s)")
    pending = 10 * nodes
    await submit(url, token, [{"command": ["sleep", "100000"], "gpus": 1, "name": "pending"}] * pending)
    await wait_for(c, f"{pending} jobs PENDING", lambda x: x["jobs_by_state"].get("PENDING", 0) >= pending, 120)
    await asyncio.sleep(5)  # let the submissions' cycles settle
    _, listed = await c.request("GET", "/v1/nodes")
    scrapes: list[float] = []
    stop = asyncio.Event()
    scraper = asyncio.create_task(scrape_every_node(url, token, [n["name"] for n in listed], stop, scrapes))
    await asyncio.sleep(SCRAPE_S / 3)  # the scrapes under way before the window opens
    text0 = await metrics_text(url)
    sum0, n0 = cycle_stats(text0)
    gc0 = gc_stats(text0)
    await c.request("POST", "/v1/diag/reset")  # the event loop's lag over the window (trainyard diag)
    cpu0, t0 = cpu_s(pid) + readers_cpu_s(pid), time.monotonic()  # its readers build the job pages
    lat: dict[str, list[float]] = {"jobs": [], "nodes": [], "nodes_gz": []}
    size: dict[str, int] = {}
    gz = {"Accept-Encoding": "gzip"}
    turn = 0
    while time.monotonic() - t0 < STEADY_S:
        # the two node listings take turns, each 0.5 s after the last listing (what changed since)
        turn += 1
        listing = ("nodes", "/v1/nodes", None) if turn % 2 else ("nodes_gz", "/v1/nodes", gz)
        for kind, path, headers in (("jobs", f"/v1/jobs?limit={PAGE}", None), listing):
            t = time.perf_counter()
            status, body = await c.request("GET", path, decode=False, headers=headers)  # to the last byte
            lat[kind].append(time.perf_counter() - t)
            assert status == 200, (path, status)
            size[kind] = len(body)
        await asyncio.sleep(0.5)
    wall = time.monotonic() - t0
    cpu = cpu_s(pid) + readers_cpu_s(pid) - cpu0
    stop.set()
    await scraper
    text1 = await metrics_text(url)
    sum1, n1 = cycle_stats(text1)
    gc1 = gc_stats(text1)
    _, cluster = await c.request("GET", "/v1/cluster")
    _, diag = await c.request("GET", "/v1/diag")
    await c.close()
    # the probes themselves cost the daemon some CPU: counted, as a user's TUI would be
    return {"nodes": nodes, "cpu_pct": cpu / wall * 100, "rss_mb": rss_mb(pid),
            "readers_mb": sum(rss_mb(p) for p in readers(pid)),
            "cycles": n1 - n0, "cycle_ms": (sum1 - sum0) / max(1, n1 - n0) * 1000,
            "gc": {k: gc1.get(k, 0) - gc0.get(k, 0) for k in gc1},
            "jobs_p99_ms": percentile(lat["jobs"], 99) * 1000, "jobs_p50_ms": percentile(lat["jobs"], 50) * 1000,
            "nodes_p99_ms": percentile(lat["nodes"], 99) * 1000,
            "nodes_p50_ms": percentile(lat["nodes"], 50) * 1000,
            "nodes_gz_p99_ms": percentile(lat["nodes_gz"], 99) * 1000,
            "nodes_gz_p50_ms": percentile(lat["nodes_gz"], 50) * 1000,
            "nodes_kb": size["nodes"] / 1024, "nodes_gz_kb": size["nodes_gz"] / 1024,
            "scrape_p50_ms": percentile(scrapes, 50) * 1000, "scrape_p99_ms": percentile(scrapes, 99) * 1000,
            "scrapes_per_s": len(scrapes) / (wall + SCRAPE_S / 3),
            "lag_p99_ms": diag["loop"]["p99_ms"], "lag_max_ms": diag["loop"]["max_ms"],
            "lag_mean_ms": diag["loop"]["mean_ms"],
            "running": cluster["jobs_by_state"].get("RUNNING", 0),
            "pending": cluster["jobs_by_state"].get("PENDING", 0)}


class Fleet:
    """A temporary state directory with the daemon's SSH key, a fleet process of NODES simulated
    nodes that trust it, and those nodes registered (fill): what a benchmark's daemons start on."""

    def __init__(self, nodes: int, db: str = "", prefix: str = "trainyard-bench-size-"):
        import asyncssh

        self.base = base = Path(tempfile.mkdtemp(prefix=prefix))
        self.home = home = base / "state"
        self.env = env = {**os.environ, "HOME": str(base), "TRAINYARD_HOME": str(home),
                          "XDG_CONFIG_HOME": str(base / "config"), "PYTHONUNBUFFERED": "1"}
        env.pop("TRAINYARD_URL", None)
        env.pop("TRAINYARD_TOKEN", None)
        key = asyncssh.generate_private_key("ssh-ed25519", comment="trainyard-daemon")
        (home / "ssh").mkdir(parents=True, mode=0o700)
        (home / "ssh" / "id_ed25519").write_bytes(key.export_private_key())
        (home / "ssh" / "id_ed25519").chmod(0o600)
        (home / "ssh" / "id_ed25519.pub").write_bytes(key.export_public_key())
        fleet_dir = base / "fleet"
        self.proc = subprocess.Popen([sys.executable, "-m", "scheduler.simnode", str(nodes), str(GPUS),
                                      str(fleet_dir), str(home / "ssh" / "id_ed25519.pub")], cwd=ROOT, env=env,
                                     stdout=subprocess.PIPE, text=True)
        try:
            lines = []
            while (line := self.proc.stdout.readline().strip()) != "ready":
                if not line:
                    raise SystemExit("the fleet process ended before it was ready")
                lines.append(line)
            (fleet_dir / "ports").write_text("\n".join(lines) + "\n")
            self.token = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--fill", str(home),
                                         str(fleet_dir), db], env=env, cwd=ROOT, check=True, capture_output=True,
                                        text=True).stdout.strip().splitlines()[-1]
        except BaseException:
            self.stop()
            raise

    def config(self, extra: str = "") -> Path:
        config = self.base / "trainyard.toml"
        # a thousand nodes' handshakes, 32 at a time, can take longer than the default 10 s (and
        # an agent's hello longer than 60 s) on two cores that also run the fleet
        config.write_text("[daemon]\ntelemetry_interval_s = 2\nconnect_timeout_s = 120\n"
                          "hello_timeout_s = 120\n" + extra)
        return config

    def daemon(self, config: Path, db: str = "", log: str = "daemon.log") -> tuple[subprocess.Popen, str]:
        """`trainyard daemon` on this state directory, listening once this returns; its URL."""
        port = free_port()
        daemon = subprocess.Popen([sys.executable, "-m", "scheduler.cli", "daemon", "--listen",
                                   f"127.0.0.1:{port}", "--config", str(config), *(["--db", db] if db else [])],
                                  env=self.env, cwd=ROOT, stdout=subprocess.DEVNULL,
                                  stderr=open(self.base / log, "wb"))
        for _ in range(300):
            try:
                socket.create_connection(("127.0.0.1", port), 0.2).close()
                break
            except OSError:
                if daemon.poll() is not None:
                    raise SystemExit(f"the daemon exited {daemon.returncode}: see {self.base / log}") from None
                time.sleep(0.2)
        return daemon, f"http://127.0.0.1:{port}"

    def stop(self, remove: bool = True) -> None:
        """End the fleet; remove the state directory unless `remove` is false (a failed run's
        daemon logs are kept there, and the path printed)."""
        stop(self.proc)
        if remove:
            discard(self.base)
        else:
            print(f"  kept for a look: {self.base}", file=sys.stderr)


def stop(p: subprocess.Popen | None) -> None:
    """End a daemon (SIGINT, as Ctrl-C) or the fleet (SIGTERM); kill what does not end in 60 s."""
    if p is not None and p.poll() is None:
        p.send_signal(signal.SIGINT if "daemon" in p.args else signal.SIGTERM)
        try:
            p.wait(60)
        except subprocess.TimeoutExpired:
            p.kill()


def run_size(nodes: int) -> dict:
    fleet = Fleet(nodes)
    token = fleet.token
    daemon = None
    ok = False
    try:
        config = fleet.config(f"[health]\nhistory_samples = {HEALTH_HISTORY}\n" if HEALTH_HISTORY else "")
        daemon, url = fleet.daemon(config)
        result = asyncio.run(measure(url, token, daemon.pid, nodes))
        ok = True
        return result
    finally:
        stop(daemon)
        fleet.stop(remove=ok)


def main() -> None:
    if sys.argv[1:2] == ["--fill"]:
        sys.path.insert(0, str(ROOT))
        fill(Path(sys.argv[2]), Path(sys.argv[3]), *sys.argv[4:5])
        return
    global HEALTH_HISTORY, STEADY_S
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("Run:")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("nodes", nargs="*", type=int, default=[100, 1000], help="cluster sizes (default: 100 1000)")
    ap.add_argument("--steady", type=int, default=STEADY_S, metavar="SECONDS",
                    help=f"seconds of steady state measured (default {STEADY_S}); longer shows how often "
                         "a full garbage collection comes")
    ap.add_argument("--health-history", type=int, default=HEALTH_HISTORY, metavar="N",
                    help="[health] history_samples of the daemon (default 300)")
    a = ap.parse_args()
    HEALTH_HISTORY, STEADY_S, sizes = a.health_history, a.steady, a.nodes
    print(f"machine: {machine()}; load average {os.getloadavg()[0]:.2f}; [health] history_samples "
          f"{HEALTH_HISTORY or '300 (default)'}")
    rows = []
    for n in sizes:
        print(f"{n} nodes x {GPUS} GPUs, {5 * n:,} running + {10 * n:,} pending, telemetry every 2 s:")
        r = run_size(n)
        rows.append(r)
        print(f"  steady state ({STEADY_S} s): daemon CPU {r['cpu_pct']:.0f} % of one core (its reader processes' "
              f"included), RSS {r['rss_mb']:.0f} MB (its readers {r['readers_mb']:.0f} MB more); "
              f"{r['cycles']} scheduling cycles, mean {r['cycle_ms']:.0f} ms; GET /v1/jobs?limit={PAGE} "
              f"p50 {r['jobs_p50_ms']:.1f} p99 {r['jobs_p99_ms']:.1f} ms; GET /v1/nodes p50 {r['nodes_p50_ms']:.1f} "
              f"p99 {r['nodes_p99_ms']:.1f} ms ({r['nodes_kb']:,.0f} KB), gzip-compressed as the CLI and TUI ask "
              f"p50 {r['nodes_gz_p50_ms']:.1f} p99 {r['nodes_gz_p99_ms']:.1f} ms ({r['nodes_gz_kb']:,.0f} KB) "
              f"({r['running']:,} running, {r['pending']:,} pending); Prometheus scraping every node's GPUs "
              f"every {SCRAPE_S} s ({r['scrapes_per_s']:.0f}/s): p50 {r['scrape_p50_ms']:.1f} p99 "
              f"{r['scrape_p99_ms']:.1f} ms; the daemon's event loop lag (GET /v1/diag) mean {r['lag_mean_ms']:.1f} "
              f"p99 {r['lag_p99_ms']:.1f} max {r['lag_max_ms']:.1f} ms; "
              + "garbage collector pauses: " + ", ".join(
                  f"generation {g} {r['gc'][f'n{g}']:.0f} (mean {r['gc'][f's{g}'] / max(1, r['gc'][f'n{g}']) * 1000:.1f} ms, "
                  f"{r['gc'][f'long{g}']:.0f} over 25 ms)" for g in "012"))
    if len(rows) >= 2:
        a, b = rows[0], rows[-1]
        k = (5000 - b["nodes"]) / (b["nodes"] - a["nodes"])
        print("linear projection to 5,000 nodes (from the two largest runs' slope): "
              + ", ".join(f"{name} {b[f] + (b[f] - a[f]) * k:.0f}{unit}" for name, f, unit in (
                  ("CPU", "cpu_pct", " %"), ("RSS", "rss_mb", " MB"), ("cycle", "cycle_ms", " ms"),
                  ("GET /v1/nodes p99", "nodes_p99_ms", " ms"), ("compressed", "nodes_gz_p99_ms", " ms"))))


if __name__ == "__main__":
    main()
