"""Job states in both vocabularies: trainyard's first words (HELD, STARTING) and Slurm's
(PENDING with reason JobHeldUser/JobHeldAdmin, CONFIGURING, OUT_OF_MEMORY) look and filter alike."""

from __future__ import annotations

import pytest
from fake_backend import FakeBackend
from tuihelpers import SIZE, make_app, screen_text, settle

from tui import format as fmt


@pytest.mark.parametrize("job", [
    {"state": "HELD", "reason": "Held"},
    {"state": "PENDING", "reason": "JobHeldUser"},
    {"state": "PENDING", "reason": "JobHeldAdmin"},
])
def test_a_held_job_is_coloured_as_held_in_either_vocabulary(job):
    cell = fmt.job_cells({"id": 1, **job}, now=0)[4]
    assert cell.plain == job["state"] and cell.style == fmt.JOB_STATE_STYLE["HELD"]


def test_a_pending_job_waiting_for_resources_is_not_held():
    cell = fmt.job_cells({"id": 1, "state": "PENDING", "reason": "Resources"}, now=0)[4]
    assert cell.style == fmt.JOB_STATE_STYLE["PENDING"]


def test_configuring_looks_like_starting_and_out_of_memory_like_a_failure():
    assert fmt.JOB_STATE_STYLE["CONFIGURING"] == fmt.JOB_STATE_STYLE["STARTING"]
    assert fmt.JOB_STATE_STYLE["OUT_OF_MEMORY"] == fmt.JOB_STATE_STYLE["FAILED"]


def test_per_user_counts_take_configuring_as_running_and_held_as_pending():
    jobs = [{"user": "ana", "state": "CONFIGURING", "gpus": 2, "nodes": 1},
            {"user": "ana", "state": "STARTING", "gpus": 1, "nodes": 1},
            {"user": "ana", "state": "PENDING", "reason": "JobHeldUser"},
            {"user": "ana", "state": "HELD"}]
    assert fmt.team_usage(jobs) == {"ana": {"pending": 2, "running": 2, "gpus": 3}}


@pytest.mark.parametrize("slurm", [False, True], ids=["trainyard words", "slurm words"])
async def test_state_held_filter_shows_the_held_jobs_without_asking_the_daemon(slurm):
    backend = FakeBackend(nodes=6, jobs=24, slurm_states=slurm)
    held = {str(j["id"]) for j in backend.jobs() if fmt.is_held(j)}
    app = make_app(backend, view="jobs")
    async with app.run_test(size=SIZE, notifications=True) as pilot:
        await settle(pilot)
        await pilot.press("slash", *"state:held", "enter")
        await app.workers.wait_for_complete()
        await pilot.pause()
        assert held and set(app.query_one("#jobs-table").keys) == held
        assert backend.calls[-1][1]["state"] is None  # a word the daemon may not know
        if slurm:
            text = screen_text(app)
            assert "JobHeldUser" in text and "JobHeldAdmin" in text and "HELD" not in text


async def test_state_configuring_finds_jobs_that_are_starting_in_the_old_words():
    backend = FakeBackend(nodes=6, jobs=24)
    backend._jobs[6]["state"] = "STARTING"
    app = make_app(backend, view="jobs")
    async with app.run_test(size=SIZE, notifications=True) as pilot:
        await settle(pilot)
        app.show_jobs("state:configuring")
        await app.workers.wait_for_complete()
        await pilot.pause()
        assert app.query_one("#jobs-table").keys == ["6"]


async def test_configuring_and_out_of_memory_jobs_are_shown_with_their_words():
    backend = FakeBackend(nodes=6, jobs=24, slurm_states=True)
    app = make_app(backend, view="jobs")
    async with app.run_test(size=SIZE, notifications=True) as pilot:
        await settle(pilot)
        await pilot.press("a")
        await app.workers.wait_for_complete()
        await pilot.pause()
        table = app.query_one("#jobs-table")
        states = {str(table.get_cell(k, "STATE")) for k in table.keys}
        assert {"CONFIGURING", "OUT_OF_MEMORY", "RUNNING", "PENDING"} <= states
        assert "HELD" not in states and "FAILED" not in states
