"""The action registry is the only source of keys, palette entries and help lines."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from fake_backend import FakeBackend
from tuihelpers import SIZE, make_app, screen_text, settle

from tui import actions
from tui.app import TrainyardApp
from tui.components.command_bar import CommandBar
from tui.components.detail import JobScreen, NodeScreen
from tui.components.dialogs import ConfirmScreen, HelpScreen, PromptScreen, SubmitScreen
from tui.components.table import KeyedTable
from tui.components.views import EventsView, JobsView, NodesView, QueuesView

# The classes that realise each scope of the registry.
SCOPE_CLASSES = {
    "main": [TrainyardApp],
    "table": [KeyedTable],
    "jobs": [JobsView, JobScreen],
    "nodes": [NodesView, NodeScreen],
    "node": [NodeScreen],
    "job": [JobScreen],
    "bar": [CommandBar],
    "dialog": [ConfirmScreen, PromptScreen, SubmitScreen],
    "help": [HelpScreen],
}
ALL_CLASSES = {c for classes in SCOPE_CLASSES.values() for c in classes} | {QueuesView, EventsView}
REGISTERED = {(a.keys, a.action) for a in actions.ACTIONS if a.keys and a.bound}


@pytest.mark.parametrize("cls", sorted(ALL_CLASSES, key=lambda c: c.__name__),
                         ids=lambda c: c.__name__)
def test_every_binding_comes_from_the_registry(cls):
    written = {(b.key, b.action) for b in cls.BINDINGS}
    assert written <= REGISTERED, f"{cls.__name__} binds keys the registry does not list"


@pytest.mark.parametrize("scope", sorted(SCOPE_CLASSES))
def test_every_registered_key_has_a_handler_where_it_is_bound(scope):
    for binding in actions.bindings(scope):
        name = binding.action.split("(", 1)[0]
        handlers = [c for c in SCOPE_CLASSES[scope] if callable(getattr(c, f"action_{name}", None))]
        assert handlers, f"{binding.key} runs {binding.action!r}, which nothing in {scope} handles"


def test_help_lists_every_key_once():
    lines = [what for _, rows in actions.help_sections() for _, what in rows]
    for a in actions.ACTIONS:
        if a.keys:
            assert sum(line.startswith(a.help) for line in lines) == 1, a.id
    assert any("(confirm)" in line for line in lines)


def test_readonly_help_and_palette_leave_out_every_verb():
    readonly_help = {what for _, rows in actions.help_sections(readonly=True) for _, what in rows}
    for a in actions.ACTIONS:
        if a.changes:
            assert not any(line.startswith(a.help) for line in readonly_help), a.id
            assert a not in actions.palette(actions.SCOPES, readonly=True)


def test_components_ask_the_app_by_message_not_by_call():
    """Widgets and screens post messages; only the palette provider (as Textual's own system
    commands do) and the table's batch_update (a framework call) touch the app."""
    root = Path(__file__).resolve().parents[2] / "tui" / "components"
    calls = {}
    for path in root.glob("*.py"):
        found = re.findall(r"self\.app\.(\w+)", path.read_text())
        if found:
            calls[path.name] = sorted(set(found))
    assert calls == {"palette.py": ["palette_actions", "run_palette_action"],
                     "table.py": ["batch_update"]}


async def test_the_palette_runs_a_view_action_on_its_view(backend):
    app = make_app(backend, view="jobs")
    async with app.run_test(size=SIZE, notifications=True) as pilot:
        await settle(pilot)
        view = app.query_one(JobsView)
        assert not view.show_all
        await pilot.press("ctrl+p", *"all / active")
        await pilot.pause(0.3)
        await pilot.press("enter")
        await app.workers.wait_for_complete()
        await pilot.pause()
        assert view.show_all
        assert "COMPLETED" in screen_text(app)


async def test_the_palette_drains_the_node_under_the_cursor_after_a_confirm(backend):
    app = make_app(backend)
    async with app.run_test(size=SIZE, notifications=True) as pilot:
        await settle(pilot)
        await pilot.press("down", "ctrl+p", *"drain nodes")
        await pilot.pause(0.3)
        await pilot.press("enter")
        await pilot.pause()
        text = screen_text(app)
        assert "Drain 1 node?" in text and "• gpu-01" in text
        await pilot.press(*"psu", "enter")
        await app.workers.wait_for_complete()
        await pilot.pause()
        assert backend.node("gpu-01")["reason"] == "psu"


async def test_the_palette_on_a_job_screen_acts_on_that_job(backend):
    app = make_app(backend, view="jobs")
    async with app.run_test(size=SIZE, notifications=True) as pilot:
        await settle(pilot)
        app.open_job(2)
        await pilot.pause()
        names = {a.palette_title for a in app.palette_actions(app.screen)}
        assert {"Back", "Follow/pause", "Hold jobs"} <= names and "Jobs: all / active" not in names
        await pilot.press("ctrl+p", *"cancel jobs")
        await pilot.pause(0.3)
        await pilot.press("enter")
        await pilot.pause()
        assert "Cancel 1 job?" in screen_text(app) and "• 2" in screen_text(app)


async def test_a_user_is_told_which_verbs_need_an_operator():
    app = make_app(FakeBackend(role="user"))
    async with app.run_test(size=SIZE, notifications=True) as pilot:
        await settle(pilot)
        drain = next(a for a in app.palette_actions(app.screen) if a.id == "drain")
        assert "needs operator" in drain.palette_help and "after a confirm" in drain.palette_help
        await pilot.press("question_mark")
        await pilot.pause()
        assert "drain with a reason (confirm) (operator)" in screen_text(app)
