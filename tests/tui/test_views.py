"""Pilot tests of the views and keys against the in-memory backend (frozen clock)."""

from __future__ import annotations

from fake_backend import FakeBackend
from tuihelpers import SIZE, Clock, make_app, refetch, screen_text, settle

from tui.components.table import KeyedTable
from tui.components.views import JobsView


async def test_header_shows_cluster_totals(backend):
    app = make_app(backend)
    async with app.run_test(size=SIZE, notifications=True) as pilot:
        await settle(pilot)
        text = screen_text(app)
        c = backend.cluster()
        assert "demo" in text and "● live" in text
        assert f"{c['nodes_up']}/{c['nodes_total']} up" in text
        assert f"{c['gpus_used']}/{c['gpus_total']} busy" in text
        assert f"{c['jobs_running']} running" in text and f"{c['jobs_pending']} pending" in text


async def test_nodes_view_has_one_row_per_node_with_gpu_bar(backend):
    app = make_app(backend)
    async with app.run_test(size=SIZE, notifications=True) as pilot:
        await settle(pilot)
        text = screen_text(app)
        for node in backend.nodes():
            assert node["name"] in text
        assert "nodes [4/4]" in text
        first = backend.nodes()[0]
        line = next(ln for ln in text.splitlines() if first["name"] in ln)
        assert "█" in line and f" {first['gpus_used']}/{first['gpus_total']} " in line  # GPU bar


async def test_an_answer_while_the_views_table_is_not_there_is_drawn_later_not_a_crash(backend):
    # a source's answer can be handled before the view's table is composed (the app's start)
    # or after its widgets went (its exit): the app once died there with NoMatches
    app = make_app(backend)
    async with app.run_test(size=SIZE, notifications=True) as pilot:
        await settle(pilot)
        view = app.active_view
        await view.table.remove()
        backend.set_node("gpu-01", state="DRAINED")
        await refetch(pilot, "nodes")  # handled with no table to draw on
        assert app.is_running and app.state.node("gpu-01")["state"] == "DRAINED" and not view.drawable()
        await view.mount(KeyedTable(view.COLUMNS, id=f"{view.KIND}-table"))  # as it is composed
        app.data_changed("cluster")  # the next answer draws what waited
        await pilot.pause()
        assert "DRAINED" in next(ln for ln in screen_text(app).splitlines() if "gpu-01" in ln)


async def test_colon_switches_view_with_tab_completion(backend):
    app = make_app(backend)
    async with app.run_test(size=SIZE, notifications=True) as pilot:
        await settle(pilot)
        await pilot.press("colon", "j", "o")
        await pilot.pause()
        await pilot.press("tab", "enter")
        await pilot.pause()
        assert app.active_view.KIND == "jobs"
        text = screen_text(app)
        assert "jobs [" in text and "train-9" in text
        await pilot.press("colon", *"queues", "enter")
        await pilot.pause()
        assert "research" in screen_text(app)
        await pilot.press("colon", *"events", "enter")
        await pilot.pause()
        assert "cluster.start" in screen_text(app)


async def test_unknown_view_says_which_exist(backend):
    app = make_app(backend)
    async with app.run_test(size=SIZE, notifications=True) as pilot:
        await settle(pilot)
        await pilot.press("colon", *"pods", "enter")
        await pilot.pause()
        assert "no view 'pods'" in screen_text(app)


async def test_filter_survives_refresh(backend):
    app = make_app(backend)
    async with app.run_test(size=SIZE, notifications=True) as pilot:
        await settle(pilot)
        await pilot.press("slash", *"gpu-02", "enter")
        await pilot.pause()
        table = app.query_one("#nodes-table")
        assert table.keys == ["gpu-02"]
        backend.advance()
        await refetch(pilot, "nodes")
        assert table.keys == ["gpu-02"]
        assert "/gpu-02" in screen_text(app)
        await pilot.press("escape")  # Esc clears the filter
        await pilot.pause()
        assert len(table.keys) == 4


async def test_key_value_filter_goes_to_the_daemon(backend):
    app = make_app(backend, view="jobs")
    async with app.run_test(size=SIZE, notifications=True) as pilot:
        await settle(pilot)
        await pilot.press("slash", *"user:ana", "enter")
        await app.workers.wait_for_complete()
        await pilot.pause()
        assert backend.calls[-1][1]["user"] == "ana"
        table = app.query_one("#jobs-table")
        users = {str(table.get_cell(k, "USER")) for k in table.keys}
        assert users == {"ana"}


async def test_table_rows_update_in_place(backend):
    app = make_app(backend)
    async with app.run_test(size=SIZE, notifications=True) as pilot:
        await settle(pilot)
        table = app.query_one("#nodes-table")
        rows_before = {k: id(table.rows[k]) for k in table.rows}
        backend.advance()
        await refetch(pilot, "nodes")
        assert {k: id(table.rows[k]) for k in table.rows} == rows_before


async def test_jobs_view_shows_state_reason_and_shape(backend):
    app = make_app(backend, view="jobs")
    async with app.run_test(size=SIZE, notifications=True) as pilot:
        await settle(pilot)
        text = screen_text(app)
        pending = next(j for j in backend.jobs() if j["state"] == "PENDING")
        line = next(ln for ln in text.splitlines() if f" {pending['id']} " in ln and pending["name"] in ln)
        assert "PENDING" in line and "Resources" in line and f"{pending['gpus']}×1" in line
        # finished jobs are hidden until `a` shows all
        assert "COMPLETED" not in text
        await pilot.press("a")
        await app.workers.wait_for_complete()
        await pilot.pause()
        assert app.query_one(JobsView).show_all
        assert "COMPLETED" in screen_text(app)


async def test_queues_view_shows_queues_and_teams(backend):
    app = make_app(backend, view="queues")
    async with app.run_test(size=SIZE, notifications=True) as pilot:
        await settle(pilot)
        text = screen_text(app)
        for q in backend.queues():
            assert q["name"] in text
        assert "16" in text  # the default queue's GPU quota
        teams = app.query_one("#teams-table")
        assert teams.keys == [t["name"] for t in backend.teams()]
        assert "default" in teams.keys and "nlp" in teams.keys
        for t in backend.teams():
            assert str(teams.get_cell(t["name"], "RUNNING")) == str(t["running"])
            assert str(teams.get_cell(t["name"], "PENDING")) == str(t["pending"])
        nlp = next(t for t in backend.teams() if t["name"] == "nlp")
        gpus = str(teams.get_cell("nlp", "GPUS / QUOTA"))
        assert f"{nlp['gpus_used']}/4" in gpus
        if nlp["gpus_used"] > 4:  # borrowed from the cohort: shown past the quota
            assert f"+{nlp['gpus_used'] - 4}" in gpus
        assert str(teams.get_cell("nlp", "COHORT")) == "lab"
        assert str(teams.get_cell("default", "GPUS / QUOTA")).endswith("/∞")
        assert str(teams.get_cell("vision", "SHARES")) == "2"
        assert str(teams.get_cell("vision", "BORROW")) == "8"
        assert str(teams.get_cell("vision", "LEND")) == "4"


async def test_teams_table_is_diff_updated_in_place(backend):
    app = make_app(backend, view="queues")
    async with app.run_test(size=SIZE, notifications=True) as pilot:
        await settle(pilot)
        teams = app.query_one("#teams-table")
        before = str(teams.get_cell("default", "PENDING"))
        backend.submit({"command": ["true"], "gpus": 1})  # root is in no team: "default"
        await refetch(pilot, "queues")
        assert str(teams.get_cell("default", "PENDING")) == str(int(before) + 1)
        assert teams.keys == [t["name"] for t in backend.teams()]


async def test_enter_on_a_team_shows_the_jobs_charged_to_it(backend):
    app = make_app(backend, view="queues")
    async with app.run_test(size=SIZE, notifications=True) as pilot:
        await settle(pilot)
        teams = app.query_one("#teams-table")
        teams.focus()
        teams.move_cursor(row=teams.get_row_index("infra"))
        await pilot.press("enter")
        await app.workers.wait_for_complete()
        await pilot.pause()
        assert app.active_view.KIND == "jobs"
        table = app.query_one("#jobs-table")
        infra = {str(j["id"]) for j in backend.jobs() if j.get("account") == "infra"}
        assert infra and set(table.keys) == infra  # charged by account, whoever submitted
        assert "/team:infra" in screen_text(app)
        await pilot.press("escape")
        await pilot.pause()
        app.show_jobs("team:vision")
        await app.workers.wait_for_complete()
        await pilot.pause()
        users = {str(table.get_cell(k, "USER")) for k in table.keys}
        assert users and users <= {"ana", "bo"}


async def test_teams_fall_back_to_per_user_without_the_endpoint(backend):
    from tui.backend import BackendError

    def no_teams():
        raise BackendError("Not Found", 404)

    backend.teams = no_teams
    app = make_app(backend, view="queues")
    async with app.run_test(size=SIZE, notifications=True) as pilot:
        await settle(pilot)
        assert app.state.teams is None and "queues" not in app.state.errors
        teams = app.query_one("#teams-table")
        assert "ana" in teams.keys and "per user" in str(teams.border_title)


async def test_enter_on_node_opens_its_gpus(backend):
    app = make_app(backend)
    async with app.run_test(size=SIZE, notifications=True) as pilot:
        await settle(pilot)
        await pilot.press("down", "enter")  # gpu-01 carries an ECC error on GPU 3
        await pilot.pause()
        text = screen_text(app)
        assert "node gpu-01" in text and "UTIL HISTORY" in text
        assert "ECC 1" in text
        await pilot.press("escape")
        await pilot.pause()
        assert "nodes [4/4]" in screen_text(app)


async def test_sparklines_grow_with_each_telemetry_sample(backend):
    app = make_app(backend)
    async with app.run_test(size=SIZE, notifications=True) as pilot:
        await settle(pilot)
        await pilot.press("enter")
        for _ in range(5):
            backend.advance()
            await refetch(pilot, "nodes")
        table = app.screen.query_one("#gpus-table")
        spark = table.get_cell("0", "UTIL HISTORY").plain
        assert len(spark.strip()) == 6  # one block per sample


async def test_job_drilldown_shows_spec_allocation_and_log(backend):
    app = make_app(backend, view="jobs")
    async with app.run_test(size=SIZE, notifications=True) as pilot:
        await settle(pilot)
        await pilot.press("colon", *"job 6", "enter")
        await app.workers.wait_for_complete()
        await pilot.pause()
        text = screen_text(app)
        assert "job 6" in text and "python train.py --seed=6" in text
        assert "gpu-00: GPUs 0,1,2,3" in text
        assert "step    39 loss" in text and "following" in text


async def test_a_node_screen_shows_its_health_gate_and_fencing(backend):
    backend.set_node("gpu-01", health_checks={"status": "failed", "checks": [
        {"check": "nvml", "result": "pass"}, {"check": "dcgm_diag", "result": "fail"}]},
        fencing={"cgroup": "v2", "devices": False, "reason": "no device fencing on cgroup v2"})
    app = make_app(backend)
    async with app.run_test(size=SIZE, notifications=True) as pilot:
        await settle(pilot)
        await pilot.press("down", "enter")  # gpu-01
        await pilot.pause()
        text = screen_text(app)
        assert "health gate failed" in text and "dcgm_diag: fail" in text
        assert "GPUs NOT fenced" in text and "no device fencing on cgroup v2" in text


async def test_a_container_job_shows_its_image_and_the_digest_it_ran(backend):
    backend.set_job(6, image="registry.local/pytorch:24.01", image_digest="sha256:" + "ab" * 32)
    app = make_app(backend, view="jobs")
    async with app.run_test(size=SIZE, notifications=True) as pilot:
        await settle(pilot)
        await pilot.press("colon", *"job 6", "enter")
        await app.workers.wait_for_complete()
        await pilot.pause()
        text = screen_text(app)
        assert "registry.local/pytorch:24.01" in text and "sha256:abab" in text


async def test_log_pause_holds_new_lines_and_search_narrows(backend):
    app = make_app(backend, view="jobs")
    async with app.run_test(size=SIZE, notifications=True) as pilot:
        await settle(pilot)
        await pilot.press("colon", *"job 6", "enter")
        await app.workers.wait_for_complete()
        await pilot.pause()
        screen = app.screen
        await pilot.press("f")
        backend.append_log(6, "checkpoint saved at step 40")
        screen.fetch_log()
        await app.workers.wait_for_complete()
        await pilot.pause()
        text = screen_text(app)
        assert "paused (1 new lines)" in text and "checkpoint saved" not in text
        await pilot.press("f")
        await pilot.pause()
        assert "checkpoint saved" in screen_text(app)
        await pilot.press("slash", *"checkpoint", "enter")
        await pilot.pause()
        text = screen_text(app)
        assert "(1 matching)" in text and "step    39 loss" not in text
        await pilot.press("escape")
        await pilot.pause()
        assert "step    39 loss" in screen_text(app)


async def test_help_lists_the_keys(backend):
    app = make_app(backend)
    async with app.run_test(size=SIZE, notifications=True) as pilot:
        await settle(pilot)
        await pilot.press("question_mark")
        await pilot.pause()
        text = screen_text(app)
        assert "drain with a reason (confirm)" in text and "command palette" in text
        await pilot.press("escape")
        await pilot.pause()
        assert "drain with a reason" not in screen_text(app)


async def test_stale_data_is_marked_and_kept_then_live_again():
    backend = FakeBackend()
    clock = Clock()
    app = make_app(backend, clock=clock)
    async with app.run_test(size=SIZE, notifications=True) as pilot:
        await settle(pilot)
        backend.up = False
        clock.now += 100  # past 3 refresh intervals
        await refetch(pilot, "cluster", "nodes")
        text = screen_text(app)
        assert "stale 1m40s" in text and "connection refused" in text
        assert "gpu-03" in text  # the last good rows stay
        backend.up = True
        await refetch(pilot, "cluster", "nodes")
        text = screen_text(app)
        assert "● live" in text and "connection refused" not in text


async def test_event_stream_brings_changes_without_polling(backend):
    app = make_app(backend, stream=True, view="events")
    async with app.run_test(size=SIZE, notifications=True) as pilot:
        await settle(pilot)
        backend.drain_node("gpu-03", "fan failure")  # another operator, elsewhere
        for _ in range(300):
            if any(e.get("action") == "node.drain" for e in app.state.events):
                break
            await pilot.pause(0.01)
        await pilot.pause()
        assert "node.drain" in screen_text(app)
        assert "(stream)" in screen_text(app)


async def test_enter_on_a_queue_shows_its_jobs(backend):
    app = make_app(backend, view="queues")
    async with app.run_test(size=SIZE, notifications=True) as pilot:
        await settle(pilot)
        await pilot.press("down", "enter")  # research
        await app.workers.wait_for_complete()
        await pilot.pause()
        assert app.active_view.KIND == "jobs"
        table = app.query_one("#jobs-table")
        assert table.keys and {str(table.get_cell(k, "QUEUE")) for k in table.keys} == {"research"}
        assert "/queue:research" in screen_text(app)


async def test_enter_on_an_event_opens_its_target(backend):
    backend.hold(2)
    app = make_app(backend, view="events")
    async with app.run_test(size=SIZE, notifications=True) as pilot:
        await settle(pilot)
        await pilot.press("enter")  # the newest event: job/2 held
        await app.workers.wait_for_complete()
        await pilot.pause()
        assert getattr(app.screen, "job_id", None) == 2
        assert "job.hold" in screen_text(app)  # the job's own events


async def test_names_with_brackets_are_shown_as_typed_not_as_markup():
    backend = FakeBackend()
    backend.submit({"command": ["python", "x.py"], "name": "sweep[lr=3e-4]"})
    app = make_app(backend, view="jobs")
    async with app.run_test(size=SIZE, notifications=True) as pilot:
        await settle(pilot)
        assert "sweep[lr=3e-4]" in screen_text(app)


async def test_a_changed_cell_is_repainted_on_the_next_tick(backend):
    app = make_app(backend)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        assert str(app.query_one("#nodes-table").get_cell("gpu-02", "STATE")) == "UP"
        backend.drain_node("gpu-02", "psu swap")
        await refetch(pilot, "nodes")
        line = next(ln for ln in screen_text(app).splitlines() if "gpu-02" in ln)
        assert "DRAINED" in line and "psu swap" in line


async def test_rows_off_screen_show_their_change_when_scrolled_to():
    backend = FakeBackend(nodes=150, jobs=20)
    app = make_app(backend)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        backend.drain_node("gpu-0149", "off-screen fault")
        await refetch(pilot, "nodes")
        assert "gpu-0149" not in screen_text(app)
        await pilot.press("ctrl+end")  # the last row
        await pilot.pause()
        line = next(ln for ln in screen_text(app).splitlines() if "gpu-0149" in ln)
        assert "DRAINED" in line and "off-screen fault" in line


async def test_header_shows_the_daemons_own_problems(backend):
    backend.problems = ["cannot store jobs' output under /var/lib/trainyard/logs: No space left on device"]
    app = make_app(backend)
    async with app.run_test(size=SIZE, notifications=True) as pilot:
        await settle(pilot)
        assert "⚠ cannot store jobs' output under /var/lib/trainyard/logs" in screen_text(app)


async def test_header_says_when_the_daemon_is_busy(backend):
    """The daemon's loop lag is in every cluster summary: under the busy threshold the header
    says nothing of it; past it, a warning with the figure, gone again once the lag falls."""
    from tui.components.views import BUSY_LAG_MS

    backend.loop_lag_p99_ms = BUSY_LAG_MS - 1
    app = make_app(backend)
    async with app.run_test(size=SIZE, notifications=True) as pilot:
        await settle(pilot)
        assert "daemon busy" not in screen_text(app)
        backend.loop_lag_p99_ms = 123.4
        await pilot.press("ctrl+r")
        await settle(pilot)
        assert "⚠ daemon busy: its loop lags 123 ms (p99)" in screen_text(app)
        backend.loop_lag_p99_ms = 2.0
        await pilot.press("ctrl+r")
        await settle(pilot)
        assert "daemon busy" not in screen_text(app)


async def test_queues_view_says_why_each_queue_waits(backend):
    pending = [j for j in backend.jobs(all=True) if j["state"] == "PENDING"]
    assert pending  # the fake cluster has waiting jobs
    for j in pending:
        backend._jobs[j["id"]]["reason"] = "AssocGrpGRES"
    app = make_app(backend)
    async with app.run_test(size=SIZE, notifications=True) as pilot:
        await settle(pilot)
        await pilot.press("colon")
        await pilot.press(*"queues")
        await pilot.press("enter")
        await settle(pilot)
        text = screen_text(app)
        assert "WHY PENDING" in text
        queue = pending[0]["queue"]
        mine = sum(1 for j in pending if j["queue"] == queue)
        row = next(line for line in text.splitlines() if f" {queue} " in line)
        assert f"AssocGrpGRES {mine}" in row


async def fetch_gaps(app, pilot, source: str, every: float, fetches: int) -> list[float]:
    """Marks `source` stale every `every` seconds, as a busy cluster's job events do, until it
    has been fetched `fetches` times (bounded at 60 s: on a loaded machine a paced fetch takes
    longer), and returns the gaps between the fetches' starts."""
    import time

    starts: list[float] = []
    fetch = app.fetch

    def timed(name: str) -> None:
        if name == source:
            starts.append(time.monotonic())
        fetch(name)

    app.fetch = timed
    t0 = time.monotonic()
    while len(starts) < fetches and time.monotonic() - t0 < 60.0:
        app.soon(source)
        await pilot.pause(every)
    assert len(starts) >= fetches - 1, f"the events brought no fetch of the {source} at all"
    return [b - a for a, b in zip(starts, starts[1:], strict=False)]


async def test_a_slow_source_is_fetched_again_no_sooner_than_pace_times_its_fetch():
    """On a busy cluster every job event marks the jobs stale: a source whose fetch takes long
    (a page of thousands of jobs) is fetched again only PACE times that long after its answer,
    not 0.2 s after each, so one open TUI cannot keep the daemon busy with it."""
    import time

    from tui.refresh import PACE

    backend = FakeBackend()
    took = 0.25
    jobs = backend.jobs

    def slow_jobs(*args, **kwargs):
        time.sleep(took)
        return jobs(*args, **kwargs)

    backend.jobs = slow_jobs
    app = make_app(backend)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        gaps = await fetch_gaps(app, pilot, "jobs", every=0.05, fetches=3)
        # each fetch took at least `took` (its sleep): the next began no sooner than PACE times
        # that after it answered
        assert min(gaps) >= took * (1 + PACE) * 0.95, gaps


async def test_a_cheap_source_is_fetched_at_most_every_min_gap_under_a_flood_of_events():
    """The cluster summary answers in a few milliseconds; a job event every 20 ms still brings
    a fetch of it no more often than every MIN_GAP, not 0.2 s after each answer."""
    from tui.refresh import MIN_GAP

    app = make_app(FakeBackend())
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        gaps = await fetch_gaps(app, pilot, "cluster", every=0.02, fetches=4)
        assert min(gaps) >= MIN_GAP * 0.95, gaps


async def test_the_header_is_redrawn_only_when_what_it_shows_changes(backend):
    """Sources answer several times a second on a busy cluster, and the stream brings dozens of
    events: the header's text is built each time, drawn only when it differs."""
    from tui.components.views import ClusterHeader

    app = make_app(backend)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        header = app.screen.query_one(ClusterHeader)
        drawn = []
        update = header.update
        header.update = lambda text: (drawn.append(text.plain), update(text))[1]
        app.data_changed("events")
        app.data_changed("nodes")
        app.data_changed("cluster")
        assert drawn == []  # nothing it shows changed
        backend.drain_node("gpu-03", "fan failure")
        await refetch(pilot, "cluster")
        assert len(drawn) == 1 and "3/4 up" in drawn[0], drawn
