"""What an open TUI costs a busy daemon: the 4-node demo runs a stream of short jobs with a few
thousand more waiting (a job event every few tens of milliseconds, as on a busy cluster), and a
client submits held jobs one after another (the submitter's latency). Measured for a stretch with
no TUI, then for a stretch with the TUI open on the jobs view (the real app, headless, on the
daemon's real API through tui.backend.HttpBackend, with its event stream: every job event marks
its sources stale), between them a stretch with a script that polls the 2,000-job listing back
to back (as a user of its own, honouring the 429s of its share of the daemon's reads), one
with an operator's script polling a day's `sacct` of every user the same way, and one with a
script polling the newest 10,000 events of the audit trail. Prints the daemon's CPU, the
submissions' latency (taken in a process of their own) and how often the TUI fetched each source. The TUI runs on this machine's two cores as well:
its own drawing competes with the daemon here, as it would not from an operator's laptop. Run:
    .venv/bin/python tests/bench/bench_tui_busy.py [SECONDS] [WAITING]
(default: 20 s per stretch, 8,000 jobs waiting)
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time

import httpx
from _harness import ROOT, cpu_s, demo, machine, percentile, readers_cpu_s

sys.path.insert(0, str(ROOT))

SIZE = (200, 50)


def submitter(url: str, token: str, seconds: float, rate: float = 20.0) -> None:
    """In a process of its own (the TUI's work must not hold this one's interpreter lock): held
    1-GPU jobs, one after another on one connection, at most `rate` a second, for `seconds`;
    prints each submission's latency (JSON)."""
    body = {"command": ["true"], "gpus": 1, "hold": True, "name": "probe"}
    latencies = []
    end = time.monotonic() + seconds
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=30) as c:
        while time.monotonic() < end:
            t0 = time.perf_counter()
            c.post("/v1/jobs", json=body).raise_for_status()
            dt = time.perf_counter() - t0
            latencies.append(dt)
            time.sleep(max(0.0, 1.0 / rate - dt))
    print(json.dumps(latencies))


def reader(url: str, token: str, stop: threading.Event, pages: list, refused: list, path: str, params: dict) -> None:
    """A script that polls a listing back to back, without decoding it: the daemon's side of
    the listing at its most frequent. Refused for its user's share of the daemon's reads (429),
    it waits the Retry-After out, as trainyard's client does."""
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=30) as c:
        while not stop.is_set():
            r = c.get(path, params=params)
            if r.status_code == 429:
                refused.append(1)
                stop.wait(float(r.headers["retry-after"]))
                continue
            r.raise_for_status()
            pages.append(1)


# what the pollers ask for: the 2,000-job page (as a user), a day's sacct of every user (as an
# operator's dashboard script would), the newest 10,000 events of the audit trail (as a user)
POLLS = {"jobs": ("user", "/v1/jobs", {"limit": 2000}), "sacct": ("operator", "/v1/accounting/jobs", {}),
         "events": ("user", "/v1/events", {"limit": 10000})}


def with_reader(url: str, token: str, pid: int, seconds: float, poll: str) -> tuple[dict, int, int]:
    """The reader runs as a user of its own ("poller-<poll>"): the share of the reads is per user."""
    role, path, params = POLLS[poll]
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=30) as c:
        r = c.post("/v1/tokens", json={"user": f"poller-{poll}", "role": role})
        r.raise_for_status()
        own = r.json()["token"]
    stop, pages, refused = threading.Event(), [], []
    t = threading.Thread(target=reader, args=(url, own, stop, pages, refused, path, params), daemon=True)
    t.start()
    try:
        return stretch(url, token, pid, seconds), len(pages), len(refused)
    finally:
        stop.set()
        t.join()


def stretch(url: str, token: str, pid: int, seconds: float) -> dict:
    # the daemon's CPU with its reader processes' (the job listings it hands them)
    cpu0, own0, t0 = cpu_s(pid) + readers_cpu_s(pid), time.process_time(), time.monotonic()
    out = subprocess.run([sys.executable, __file__, "--submitter", url, token, str(seconds)],
                         capture_output=True, text=True, check=True).stdout
    wall = time.monotonic() - t0
    lat = sorted(json.loads(out))
    return {"cpu": (cpu_s(pid) + readers_cpu_s(pid) - cpu0) / wall, "own": (time.process_time() - own0) / wall, "n": len(lat),
            "p50": percentile(lat, 50) * 1000, "p99": percentile(lat, 99) * 1000, "max": lat[-1] * 1000}


async def with_tui(url: str, token: str, pid: int, seconds: float) -> tuple[dict, dict, float]:
    from tui.app import TrainyardApp
    from tui.backend import HttpBackend

    app = TrainyardApp(HttpBackend(url, token))
    counts: dict[str, int] = {}
    fetch = app.fetch

    def counted(source: str) -> None:
        counts[source] = counts.get(source, 0) + 1
        fetch(source)

    app.fetch = counted
    async with app.run_test(size=SIZE) as pilot:
        while not {"nodes", "jobs", "cluster"} <= set(app.state.fetched_at):
            await pilot.pause(0.1)
        await app.run_action("view('jobs')")
        await pilot.pause(2.0)
        counts.clear()
        r = await asyncio.to_thread(stretch, url, token, pid, seconds)
        fetched = dict(counts)
        rows = len(app.state.jobs)
    return r, fetched, rows


def keep_busy(url: str, token: str, waiting: int) -> None:
    """Short jobs (0.5 s) beyond what the 32 GPUs run at once: a job starts and one ends every
    ~16 ms until the queue drains (it outlasts the benchmark)."""
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=60) as c:
        c.post("/v1/jobs", json={"command": ["sleep", "0.5"], "gpus": 1, "array": f"0-{waiting - 1}",
                                 "name": "busy"}).raise_for_status()


def line(what: str, r: dict) -> str:
    return (f"{what}: daemon and its readers {100 * r['cpu']:.0f} % of a core; {r['n']} held submissions, latency p50 "
            f"{r['p50']:.1f} ms, p99 {r['p99']:.1f} ms, max {r['max']:.1f} ms")


def main() -> None:
    if sys.argv[1:2] == ["--submitter"]:
        return submitter(sys.argv[2], sys.argv[3], float(sys.argv[4]))
    seconds = float(sys.argv[1]) if len(sys.argv) > 1 else 20.0
    waiting = int(sys.argv[2]) if len(sys.argv) > 2 else 8000
    print(f"machine: {machine()}")
    with demo() as (url, token, proc):
        keep_busy(url, token, waiting)
        time.sleep(3)
        base = stretch(url, token, proc.pid, seconds)
        polled, pages, refused = with_reader(url, token, proc.pid, seconds, "jobs")
        sacct, windows, sacct_refused = with_reader(url, token, proc.pid, seconds, "sacct")
        events, event_pages, events_refused = with_reader(url, token, proc.pid, seconds, "events")
        r, fetched, rows = asyncio.run(with_tui(url, token, proc.pid, seconds))
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=30) as c:
            left = c.get("/v1/cluster").json()["jobs_by_state"]
    print(f"4-node demo, {waiting:,} 0.5 s jobs queued for 32 GPUs (left at the end: {left}); "
          f"{seconds:.0f} s per stretch, terminal {SIZE[0]}x{SIZE[1]}")
    print(line("no TUI      ", base))
    print(line("a reader    ", polled) + f"; the reader got {pages} pages of 2,000 jobs, one after another "
          f"(refused {refused} times for its share of the reads, waiting out each Retry-After)")
    print(line("sacct poller", sacct) + f"; an operator's script got {windows} days of sacct (every user's "
          f"jobs), one after another (refused {sacct_refused} times)")
    print(line("event poller", events) + f"; a script got {event_pages} pages of the newest 10,000 events, one "
          f"after another (refused {events_refused} times)")
    print(line("TUI on jobs ", r))
    print(f"the TUI's fetches in {seconds:.0f} s: "
          + ", ".join(f"{k} {v}" for k, v in sorted(fetched.items()))
          + f"; its jobs table held {rows:,} jobs; the TUI cost the daemon "
          f"{100 * (r['cpu'] - base['cpu']):.0f} % of a core (the TUI itself, on this machine's cores as "
          f"well: {100 * r['own']:.0f} % of a core)")


if __name__ == "__main__":
    main()
