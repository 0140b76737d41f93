"""Pilot tests against a real daemon on demo nodes: the TUI as a client of the API only."""

from __future__ import annotations

from tuihelpers import SIZE, settle

from scheduler.client import Client
from tui.app import TrainyardApp
from tui.backend import HttpBackend


def _app(url: str, token: str, **kwargs) -> TrainyardApp:
    return TrainyardApp(HttpBackend(url, token), refresh=1.0, **kwargs)


async def _until(pilot, condition, tries: int = 1500) -> None:
    """Let the app run until `condition()` holds (bounded; the assertion follows)."""
    for _ in range(tries):
        if condition():
            return
        await pilot.pause(0.02)


def _text(app) -> str:
    from tuihelpers import screen_text

    return screen_text(app)


async def test_nodes_of_the_demo_cluster_are_shown_live(demo_cluster):
    url, token = demo_cluster
    app = _app(url, token)
    async with app.run_test(size=SIZE, notifications=True) as pilot:
        await settle(pilot)
        await _until(pilot, lambda: app.query_one("#nodes-table").row_count == 2)
        text = _text(app)
        assert "node-1" in text and "node-2" in text and "● live" in text
        assert "2/2 up" in text and "root@admin" in text
        await pilot.press("enter")
        await _until(pilot, lambda: "NVIDIA H100" in _text(app))
        assert "UTIL HISTORY" in _text(app)


async def test_submit_then_cancel_through_the_confirm_screen(demo_cluster):
    url, token = demo_cluster
    app = _app(url, token, view="jobs")
    async with app.run_test(size=SIZE, notifications=True) as pilot:
        await settle(pilot)
        await pilot.press("n")
        await pilot.pause()
        await pilot.press(*"sleep 300", "tab", *"tui-cancel-me", "ctrl+s")
        client = Client(url, token)
        table = app.query_one("#jobs-table")

        def shown() -> dict | None:
            job = next((j for j in client.jobs(all=True) if j["name"] == "tui-cancel-me"), None)
            return job if job and str(job["id"]) in table.keys else None

        await _until(pilot, shown, tries=500)
        job = shown()
        assert job is not None, "the submitted job never showed in the jobs view"
        table.move_cursor(row=table.get_row_index(str(job["id"])))
        await pilot.press("C")
        await pilot.pause()
        assert f"• {job['id']}" in _text(app)
        await pilot.press("enter")
        await _until(pilot, lambda: Client(url, token).job(job["id"])["state"] == "CANCELLED")
        assert Client(url, token).job(job["id"])["state"] == "CANCELLED"


async def test_drain_and_resume_a_node(demo_cluster):
    url, token = demo_cluster
    app = _app(url, token)
    async with app.run_test(size=SIZE, notifications=True) as pilot:
        await settle(pilot)
        await _until(pilot, lambda: app.query_one("#nodes-table").row_count == 2)
        await pilot.press("down", "D")  # node-2
        await pilot.pause()
        assert "• node-2" in _text(app)
        await pilot.press(*"tui test", "enter")
        await _until(pilot, lambda: Client(url, token).node("node-2")["reason"] == "tui test",
                     tries=500)
        await _until(pilot, lambda: "tui test" in str(app.query_one("#nodes-table").get_cell("node-2", "REASON")))
        node = Client(url, token).node("node-2")
        assert node["state"] in ("DRAINING", "DRAINED") and node["reason"] == "tui test"
        await pilot.press("u")
        await _until(pilot, lambda: Client(url, token).node("node-2")["state"] == "UP")
        assert Client(url, token).node("node-2")["state"] == "UP"


async def test_a_user_role_is_refused_with_the_apis_message(demo_cluster):
    url, token = demo_cluster
    import pytest
    from tuihelpers import toasts

    from scheduler.client import ApiError

    user_token = Client(url, token).create_token("tui-bob", "user")["token"]
    with pytest.raises(ApiError) as refused:
        Client(url, user_token).drain_node("node-1", "probe")
    app = _app(url, user_token)
    async with app.run_test(size=SIZE, notifications=True) as pilot:
        await settle(pilot)
        await _until(pilot, lambda: app.query_one("#nodes-table").row_count == 2)
        await pilot.press("D", *"not allowed", "enter")
        await _until(pilot, lambda: "daemon refused" in _text(app))
        assert any(refused.value.detail in t for t in toasts(app)), toasts(app)
        assert Client(url, token).node("node-1")["state"] == "UP"


async def test_a_daemon_that_goes_away_is_marked_stale_then_reconnected(demo_cluster):
    from urllib.parse import urlparse

    from tuihelpers import TcpProxy

    url, token = demo_cluster
    target = urlparse(url)
    proxy = TcpProxy(target.hostname, target.port)
    proxy.start()
    app = TrainyardApp(HttpBackend(proxy.url, token, timeout=2.0), refresh=0.5)
    try:
        async with app.run_test(size=SIZE, notifications=True) as pilot:
            await settle(pilot)
            await _until(pilot, lambda: "(stream)" in _text(app))
            assert "● live" in _text(app)
            proxy.stop()
            await _until(pilot, lambda: "◌ stale" in _text(app))
            text = _text(app)
            assert "◌ stale" in text and "cannot reach" in text
            assert "node-1" in text  # the last good rows stay on screen
            proxy.start()
            await _until(pilot, lambda: "● live (stream)" in _text(app))
            assert "● live (stream)" in _text(app)
            Client(url, token).drain_node("node-1", "after reconnect")
            await _until(pilot, lambda: "after reconnect" in _text(app))
            assert "after reconnect" in _text(app)
            Client(url, token).resume_node("node-1")
    finally:
        proxy.stop()


async def test_queues_events_priority_release_and_requeue(demo_cluster):
    url, token = demo_cluster
    client = Client(url, token)
    held = client.submit({"command": ["sleep", "300"], "name": "tui-held", "gpus": 1, "hold": True})
    app = _app(url, token, view="queues")
    async with app.run_test(size=SIZE, notifications=True) as pilot:
        await settle(pilot)
        await _until(pilot, lambda: "default" in _text(app) and "root" in _text(app))
        text = _text(app)
        assert "default" in text and "teams" in text
        await pilot.press("colon", *"events", "enter")
        await _until(pilot, lambda: "job.submit" in _text(app))
        assert "job.submit" in _text(app) and "node.add" in _text(app)

        await pilot.press("colon", *"jobs", "enter")
        table = app.query_one("#jobs-table")
        await _until(pilot, lambda: str(held["id"]) in table.keys)
        table.move_cursor(row=table.get_row_index(str(held["id"])))
        await pilot.press("p")
        await pilot.pause()
        await pilot.press(*"7", "enter")
        await _until(pilot, lambda: client.job(held["id"])["priority"] == 7)
        assert client.job(held["id"])["priority"] == 7
        await pilot.press("r")
        await _until(pilot, lambda: client.job(held["id"])["state"] == "RUNNING")
        assert client.job(held["id"])["state"] == "RUNNING"
        await _until(pilot, lambda: "RUNNING" in str(table.get_cell(str(held["id"]), "STATE")))
        await pilot.press("R")
        await pilot.pause()
        assert "Requeue 1 job?" in _text(app) and f"• {held['id']}" in _text(app)
        await pilot.press("enter")
        await _until(pilot, lambda: client.job(held["id"])["attempt"] >= 1, tries=750)
        assert client.job(held["id"])["attempt"] >= 1  # killed and queued again
        events = [e["action"] for e in client.events(limit=500) if e["target"] == str(held["id"])]
        assert "job.requeue" in events
        client.cancel(held["id"])


async def test_teams_table_counts_a_submitted_job_under_default(demo_cluster):
    """/v1/teams through the TUI: the demo has no [teams], so root's job is charged to default."""
    url, token = demo_cluster
    client = Client(url, token)
    job = client.submit({"command": ["sleep", "300"], "name": "tui-team", "gpus": 1})
    try:
        await _teams_table_shows_the_job(url, token, client, job["id"])
    finally:
        client.cancel(job["id"])


async def _teams_table_shows_the_job(url, token, client, job_id) -> None:
    app = _app(url, token, view="queues")
    async with app.run_test(size=SIZE, notifications=True) as pilot:
        await settle(pilot)
        teams = app.query_one("#teams-table")

        def default_running() -> int | None:
            return next((t["running"] for t in client.teams() if t["name"] == "default"), None)

        def agrees() -> bool:
            expected = default_running()
            return ("default" in teams.keys and expected is not None
                    and str(teams.get_cell("default", "RUNNING")) == str(expected))

        await _until(pilot, lambda: client.job(job_id)["state"] == "RUNNING", tries=500)
        assert client.job(job_id)["state"] == "RUNNING"
        await _until(pilot, lambda: agrees() and default_running() >= 1, tries=500)
        assert "default" in teams.keys
        expected = default_running()
        assert expected >= 1
        assert str(teams.get_cell("default", "RUNNING")) == str(expected)
        assert "default" in _text(app) and "teams [" in _text(app)
        teams.focus()
        teams.move_cursor(row=teams.get_row_index("default"))
        await pilot.press("enter")
        jobs = app.query_one("#jobs-table")
        await _until(pilot, lambda: str(job_id) in jobs.keys, tries=250)
        assert str(job_id) in jobs.keys and "/team:default" in _text(app)
