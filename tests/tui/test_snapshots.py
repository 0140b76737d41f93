"""SVG snapshots of each view with a frozen clock and frozen data (regenerate only on the pinned
Textual: `pytest tests/tui/test_snapshots.py --snapshot-update`)."""

from __future__ import annotations

from fake_backend import FakeBackend
from tuihelpers import SIZE, make_app, settle


def _app(view: str = "nodes", **kwargs):
    return make_app(FakeBackend(nodes=6, jobs=24, **kwargs), view=view)


async def _settled(pilot) -> None:
    await settle(pilot)


def test_nodes_view(snap_compare):
    assert snap_compare(_app("nodes"), terminal_size=SIZE, run_before=_settled)


def test_jobs_view(snap_compare):
    assert snap_compare(_app("jobs"), terminal_size=SIZE, run_before=_settled)


def test_queues_view(snap_compare):
    assert snap_compare(_app("queues"), terminal_size=SIZE, run_before=_settled)


def test_events_view(snap_compare):
    assert snap_compare(_app("events"), terminal_size=SIZE, run_before=_settled)


def test_node_screen_with_sparklines(snap_compare):
    app = _app("nodes")

    async def run_before(pilot):
        await settle(pilot)
        for _ in range(12):
            app.backend.advance()
            app.fetch("nodes")
            await app.workers.wait_for_complete()
            await pilot.pause()
        await pilot.press("down", "enter")
        await pilot.pause()

    assert snap_compare(app, terminal_size=SIZE, run_before=run_before)


def test_job_screen(snap_compare):
    app = _app("jobs")

    async def run_before(pilot):
        await settle(pilot)
        app.open_job(6)
        await pilot.pause()
        await app.workers.wait_for_complete()
        await pilot.pause()

    assert snap_compare(app, terminal_size=SIZE, run_before=run_before)


def test_confirm_screen_lists_targets(snap_compare):
    async def run_before(pilot):
        await settle(pilot)
        await pilot.press("ctrl+a", "C")
        await pilot.pause()

    assert snap_compare(_app("jobs"), terminal_size=SIZE, run_before=run_before)


def test_help_screen(snap_compare):
    async def run_before(pilot):
        await settle(pilot)
        await pilot.press("question_mark")
        await pilot.pause()

    assert snap_compare(_app("nodes"), terminal_size=SIZE, run_before=run_before)


def test_readonly_filtered_jobs(snap_compare):
    async def run_before(pilot):
        await settle(pilot)
        await pilot.press("slash", *"running", "enter")
        await pilot.pause()

    app = make_app(FakeBackend(nodes=6, jobs=24), view="jobs", readonly=True)
    assert snap_compare(app, terminal_size=SIZE, run_before=run_before)
