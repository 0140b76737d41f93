"""Pilot tests of the actions: marks, the confirm screen, prompts, the form, roles, --readonly."""

from __future__ import annotations

import pytest
from fake_backend import FakeBackend
from tuihelpers import SIZE, make_app, refetch, screen_text, settle, toasts

from tui.format import is_held


async def _done(pilot) -> None:
    await pilot.app.workers.wait_for_complete()
    await pilot.pause()


async def test_drain_goes_through_confirm_listing_targets_and_needs_a_reason(backend):
    app = make_app(backend)
    async with app.run_test(size=SIZE, notifications=True) as pilot:
        await settle(pilot)
        await pilot.press("down", "down", "space", "down", "space", "D")  # gpu-02, gpu-03
        await pilot.pause()
        text = screen_text(app)
        assert "Drain 2 nodes?" in text and "• gpu-02" in text and "• gpu-03" in text
        await pilot.press("enter")  # no reason yet: refused by the form
        await pilot.pause()
        assert "a reason is required" in screen_text(app)
        assert backend.node("gpu-02")["state"] == "UP"
        await pilot.press(*"bad fan", "enter")
        await _done(pilot)
        assert backend.node("gpu-02")["state"] in ("DRAINING", "DRAINED")
        assert backend.node("gpu-03")["reason"] == "bad fan"
        assert backend.node("gpu-01")["state"] == "UP"
        assert "drained gpu-02, gpu-03" in screen_text(app)


async def test_escape_on_the_confirm_screen_does_nothing(backend):
    app = make_app(backend, view="jobs")
    async with app.run_test(size=SIZE, notifications=True) as pilot:
        await settle(pilot)
        target = app.query_one("#jobs-table").cursor_key
        await pilot.press("C")
        await pilot.pause()
        assert "Cancel 1 job?" in screen_text(app)
        await pilot.press("escape")
        await _done(pilot)
        assert backend.job(int(target))["state"] != "CANCELLED"


async def test_mark_all_visible_then_cancel_cancels_exactly_the_filtered_jobs(backend):
    app = make_app(backend, view="jobs")
    async with app.run_test(size=SIZE, notifications=True) as pilot:
        await settle(pilot)
        await pilot.press("slash", *"chen", "enter")
        await pilot.pause()
        chen = {int(k) for k in app.query_one("#jobs-table").keys}
        assert chen and all(backend.job(j)["user"] == "chen" for j in chen)
        await pilot.press("ctrl+a", "C")
        await pilot.pause()
        assert f"Cancel {len(chen)} job" in screen_text(app)
        await pilot.press("enter")
        await _done(pilot)
        cancelled = {j["id"] for j in backend.jobs(all=True) if j["state"] == "CANCELLED"}
        assert cancelled == chen


@pytest.mark.parametrize("slurm", [False, True], ids=["trainyard words", "slurm words"])
async def test_hold_and_release_a_pending_job(slurm):
    backend = FakeBackend(slurm_states=slurm)
    app = make_app(backend, view="jobs")
    async with app.run_test(size=SIZE, notifications=True) as pilot:
        await settle(pilot)
        table = app.query_one("#jobs-table")
        pending = next(int(k) for k in table.keys if backend.job(int(k))["reason"] == "Resources")
        table.move_cursor(row=table.get_row_index(str(pending)))
        await pilot.press("h")
        await _done(pilot)
        assert is_held(backend.job(pending))
        assert backend.job(pending)["state"] == ("PENDING" if slurm else "HELD")
        await refetch(pilot, "jobs")
        line = next(ln for ln in screen_text(app).splitlines() if f" {pending} " in ln)
        assert ("JobHeldUser" if slurm else "HELD") in line
        await pilot.press("r")
        await _done(pilot)
        assert backend.job(pending)["state"] == "PENDING" and not is_held(backend.job(pending))


async def test_change_priority_from_a_prompt(backend):
    app = make_app(backend, view="jobs")
    async with app.run_test(size=SIZE, notifications=True) as pilot:
        await settle(pilot)
        target = int(app.query_one("#jobs-table").cursor_key)
        await pilot.press("p")
        await pilot.pause()
        assert "New priority for 1 job(s)" in screen_text(app)
        await pilot.press(*"500", "enter")
        await _done(pilot)
        assert backend.job(target)["priority"] == 500


async def test_submit_form_creates_a_job(backend):
    app = make_app(backend, view="jobs")
    async with app.run_test(size=SIZE, notifications=True) as pilot:
        await settle(pilot)
        before = len(backend.jobs(all=True))
        await pilot.press("n")
        await pilot.pause()
        assert "Submit a job" in screen_text(app)
        await pilot.press(*"python finetune.py --lr 3e-4", "tab", *"finetune", "ctrl+s")
        await _done(pilot)
        jobs = backend.jobs(all=True)
        assert len(jobs) == before + 1
        assert jobs[-1]["command"] == ["python", "finetune.py", "--lr", "3e-4"]
        assert jobs[-1]["name"] == "finetune"
        assert f"submitted job {jobs[-1]['id']}" in screen_text(app)


async def test_a_refused_action_shows_the_daemons_message():
    backend = FakeBackend(role="user")
    app = make_app(backend)
    async with app.run_test(size=SIZE, notifications=True) as pilot:
        await settle(pilot)
        await pilot.press("D", *"maintenance", "enter")
        await _done(pilot)
        assert any("role 'user' may not drain nodes; ask an operator or admin" in t
                   for t in toasts(app)), toasts(app)
        assert backend.node("gpu-00")["state"] == "UP"


async def test_readonly_hides_and_refuses_actions(backend):
    app = make_app(backend, readonly=True, view="jobs")
    async with app.run_test(size=SIZE, notifications=True) as pilot:
        await settle(pilot)
        text = screen_text(app)
        assert "READONLY" in text and "Cancel" not in text and "Submit" not in text
        target = int(app.query_one("#jobs-table").cursor_key)
        state = backend.job(target)["state"]
        await pilot.press("C")
        await pilot.pause()
        assert "Cancel 1 job?" not in screen_text(app)
        assert backend.job(target)["state"] == state
        names = [a.palette_title for a in app.palette_actions(app.screen)]
        assert "Cancel jobs" not in names and "View: jobs" in names


async def test_palette_offers_every_action(backend):
    app = make_app(backend)
    async with app.run_test(size=SIZE, notifications=True) as pilot:
        await settle(pilot)
        names = {a.palette_title for a in app.palette_actions(app.screen)}
        assert {"Cancel jobs", "Requeue jobs", "Hold jobs", "Release jobs", "Priority jobs",
                "Drain nodes", "Resume nodes", "Submit job", "View: nodes", "View: events",
                "Filter", "Help"} <= names
        await pilot.press("ctrl+p")
        await pilot.pause()
        await pilot.press(*"drain")
        await pilot.pause(0.3)
        assert "Drain nodes" in screen_text(app)


async def test_drain_from_the_node_screen(backend):
    app = make_app(backend)
    async with app.run_test(size=SIZE, notifications=True) as pilot:
        await settle(pilot)
        await pilot.press("down", "down", "down", "enter")
        await pilot.pause()
        await pilot.press("D")
        await pilot.pause()
        assert "• gpu-03" in screen_text(app)
        await pilot.press(*"xid 79", "enter")
        await _done(pilot)
        assert backend.node("gpu-03")["reason"] == "xid 79"
