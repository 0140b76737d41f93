"""TUI benchmark: first full paint, refresh tick and memory with 1,000 nodes and 10,000 jobs.

Uses the in-memory FakeBackend (tests/tui/fake_backend.py), not a daemon: `trainyard demo` simulates at most
256 nodes, and the figure wanted here is the TUI's own cost, without HTTP. Run:
    .venv/bin/python tests/bench/bench_tui.py [NODES] [JOBS] [WIDTHxHEIGHT]
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.tui.fake_backend import FakeBackend  # noqa: E402
from tui.app import TrainyardApp  # noqa: E402

PAINT: list[float] = []  # seconds spent painting (the compositor's update), per frame


def _measure_paint() -> None:
    """Time Screen._compositor_refresh, where a frame is rendered; the rest of a pause is idle."""
    from textual.screen import Screen

    original = Screen._compositor_refresh

    def timed(self):
        t0 = time.perf_counter()
        try:
            return original(self)
        finally:
            PAINT.append(time.perf_counter() - t0)

    Screen._compositor_refresh = timed


SIZE = (200, 50)  # a large terminal: every visible row of the nodes view changes per tick
TICKS = 10


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


async def tick(app, pilot, source: str) -> float:
    """One refresh tick of `source` on the UI thread: apply the answer, diff the table, repaint.
    The fetch itself runs on a worker thread and is not counted."""
    backend = app.backend
    backend.advance()
    data = app.query_for(source)(backend)
    await pilot.pause()
    t0 = time.perf_counter()
    app.state.apply(source, data, app.now())
    app.data_changed(source)
    t1 = time.perf_counter()
    PAINT.clear()
    await pilot.pause()  # the frame that shows it
    return t1 - t0, sum(PAINT)


async def main(nodes: int, jobs: int, size: tuple[int, int] = SIZE) -> None:
    base = rss_mb()
    backend = FakeBackend(nodes=nodes, jobs=jobs, now=time.time())
    data_mb = rss_mb() - base
    app = TrainyardApp(backend, refresh=3600, stream=False)
    t0 = time.perf_counter()
    async with app.run_test(size=size) as pilot:
        while app.query_one("#nodes-table").row_count < nodes or "cluster" not in app.state.fetched_at:
            await pilot.pause(0.005)
        await pilot.pause()
        first_paint = time.perf_counter() - t0
        node_ticks = [await tick(app, pilot, "nodes") for _ in range(TICKS)]
        app.switch_view("jobs")
        await pilot.pause()
        job_rows = app.query_one("#jobs-table").row_count
        job_ticks = [await tick(app, pilot, "jobs") for _ in range(TICKS)]
        await pilot.press("slash", *"ana", "enter")
        t1 = time.perf_counter()
        await pilot.pause()
        filter_s = time.perf_counter() - t1
        total_mb = rss_mb()
    print(f"terminal {size[0]}x{size[1]}; backend: FakeBackend in-process, {nodes} nodes x 8 GPUs, {jobs} jobs "
          f"(jobs table shows {job_rows} rows: active jobs, first page)")
    print(f"first full paint:        {first_paint * 1000:7.0f} ms")
    for name, ticks in (("nodes", node_ticks), ("jobs", job_ticks)):
        update = [u for u, _ in ticks]
        paint = [p for _, p in ticks]
        whole = [u + p for u, p in ticks]
        print(f"refresh tick, {name:5}:  update {statistics.median(update) * 1000:5.1f} ms, "
              f"paint {statistics.median(paint) * 1000:5.1f} ms, together "
              f"{statistics.median(whole) * 1000:5.1f} ms median ({max(whole) * 1000:.1f} max)")
    print(f"filter change (rebuild): {filter_s * 1000:7.1f} ms")
    print(f"memory (RSS):            {total_mb:7.0f} MB total, of which ~{data_mb:.0f} MB is the "
          f"fake backend's own data and {base:.0f} MB the interpreter and imports")


if __name__ == "__main__":
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 1000
    j = int(sys.argv[2]) if len(sys.argv) > 2 else 10000
    w, _, h = (sys.argv[3] if len(sys.argv) > 3 else "x".join(map(str, SIZE))).partition("x")
    _measure_paint()
    asyncio.run(main(n, j, (int(w), int(h))))
