"""The trainyard TUI: nodes, GPUs, queues and jobs, live, with k9s-style keys."""

from __future__ import annotations

import time
from collections.abc import Callable

from textual import on, work
from textual.app import App, ComposeResult
from textual.screen import Screen
from textual.widgets import ContentSwitcher, Footer, Input

from tui import actions, verbs
from tui.actions import Action
from tui.backend import Backend
from tui.components.command_bar import CommandBar, resolve_command
from tui.components.detail import DetailScreen, JobScreen, NodeScreen
from tui.components.dialogs import ConfirmScreen, HelpScreen, PromptScreen, SubmitScreen
from tui.components.palette import ActionCommands
from tui.components.table import KeyedTable
from tui.components.views import (
    ClusterHeader,
    EventsView,
    JobsView,
    NodesView,
    QueuesView,
    ResourceView,
)
from tui.messages import ActionDone, ActionRequested, FilterChanged, OpenJob, OpenNode, ShowJobs
from tui.refresh import AFFECTS, RefreshMixin
from tui.state import ClusterState

VIEW_SOURCES = {"nodes": ("nodes",), "jobs": ("jobs",), "queues": ("queues", "jobs"),
                "events": ("events",)}


class TrainyardApp(RefreshMixin, App):
    """Lays out the views, shows them what the sources fetched, and acts on what widgets and
    keys ask for (keys, palette and help all from `tui.actions`)."""

    CSS_PATH = "app.tcss"
    TITLE = "trainyard"
    BINDINGS = actions.bindings("main")
    COMMANDS = App.COMMANDS | {ActionCommands}

    def __init__(self, backend: Backend, readonly: bool = False, refresh: float = 2.0,
                 clock: Callable[[], float] = time.time, stream: bool = True,
                 view: str = "nodes") -> None:
        super().__init__()
        self.backend = backend
        self.clock = clock
        self.stream = stream
        self.initial_view = view
        self.state = ClusterState(readonly=readonly, refresh_interval=refresh)
        self._dirty: set[str] = set()
        self._jobs_query_sent: dict | None = None
        # Kept by reference: App.query_one looks at the top screen, which may be a dialog.
        self._views: dict[str, ResourceView] = {
            v.KIND: v for v in (NodesView(readonly), JobsView(readonly), QueuesView(readonly),
                                EventsView(readonly))}
        self._command_bar = CommandBar()
        self._init_refresh()

    # -- layout -----------------------------------------------------------------------------

    def compose(self) -> ComposeResult:
        yield ClusterHeader(id="header")
        with ContentSwitcher(initial=self.initial_view, id="views") as self._switcher:
            yield from self._views.values()
        yield self._command_bar
        yield Footer()

    def on_mount(self) -> None:
        self._command_bar.display = False
        self.active_view.table.focus()
        self.start_refresh(stream=self.stream)
        self.set_interval(1.0, self._tick)

    def on_unmount(self) -> None:
        self.stop_refresh()
        self.backend.close()

    def now(self) -> float:
        return self.clock()

    @property
    def readonly(self) -> bool:
        return self.state.readonly

    @property
    def refresh_interval(self) -> float:
        return self.state.refresh_interval

    @refresh_interval.setter
    def refresh_interval(self, seconds: float) -> None:
        self.state.refresh_interval = seconds

    @property
    def streaming(self) -> bool:
        return self.state.streaming

    @streaming.setter
    def streaming(self, connected: bool) -> None:
        self.state.streaming = connected

    @property
    def views(self) -> dict[str, ResourceView]:
        return self._views

    @property
    def active_view(self) -> ResourceView:
        return self._views[self._switcher.current or "nodes"]

    def jobs_query(self) -> dict:
        return self._views["jobs"].server_query()

    # -- showing data -----------------------------------------------------------------------

    def _tick(self) -> None:
        self._show_headers()

    def _show_headers(self) -> None:
        now = self.now()
        for screen in self.screen_stack:
            for header in screen.query(ClusterHeader):
                header.show(self.state, now)

    def data_changed(self, source: str) -> None:
        """A source answered (or failed): redraw what shows it; hidden views redraw when shown.
        The header shows nothing of the events (a busy cluster streams dozens a second)."""
        if source != "events":
            self._show_headers()
        now = self.now()
        for kind, sources in VIEW_SOURCES.items():
            if source in sources:
                self._dirty.add(kind)
        view = self.active_view
        if view.KIND in self._dirty and view.drawable():  # else it stays dirty: drawn when it can be
            self._dirty.discard(view.KIND)
            view.show(self.state, now)
        if source in ("nodes", "events", "jobs"):
            for screen in self.screen_stack[1:]:
                if isinstance(screen, DetailScreen):
                    screen.show(self.state, now)

    def switch_view(self, kind: str) -> None:
        self._switcher.current = kind
        view = self.active_view
        self._dirty.discard(kind)
        view.show(self.state, self.now())
        view.table.focus()

    def _filter_changed(self, view: ResourceView) -> None:
        view.show(self.state, self.now())
        if isinstance(view, JobsView) and view.server_query() != self._jobs_query_sent:
            self.fetch("jobs")

    def query_for(self, source: str):
        if source == "jobs":
            self._jobs_query_sent = self.jobs_query()
        return super().query_for(source)

    def show_jobs(self, query: str) -> None:
        """The jobs view, filtered (a queue's or a team's jobs)."""
        view = self._views["jobs"]
        view.filter = query
        self.switch_view("jobs")
        self._filter_changed(view)

    def open_node(self, name: str) -> None:
        """A node's GPUs (nothing when the node is not in the cluster)."""
        if self.state.node(name) is not None:
            self.push_screen(NodeScreen(name, self.state, self.now))

    def open_job(self, job_id: int) -> None:
        self.push_screen(JobScreen(job_id, self.backend, self.state, self.now))

    # -- what widgets and screens ask for ---------------------------------------------------

    @on(OpenNode)
    def _open_node(self, message: OpenNode) -> None:
        self.open_node(message.name)

    @on(OpenJob)
    def _open_job(self, message: OpenJob) -> None:
        self.open_job(message.job_id)

    @on(ShowJobs)
    def _show_jobs(self, message: ShowJobs) -> None:
        self.show_jobs(message.query)

    @on(FilterChanged)
    def _on_filter_changed(self, message: FilterChanged) -> None:
        self._filter_changed(message.view)

    @on(ActionRequested)
    def _on_action_requested(self, message: ActionRequested) -> None:
        self.request_action(message.action, message.targets)

    @on(CommandBar.Command)
    def _on_command(self, message: CommandBar.Command) -> None:
        view = self.active_view
        if message.mode == "/":
            view.filter = message.text.strip()
            self._filter_changed(view)
            view.table.focus()
            return
        what, arg = resolve_command(message.text)
        view.table.focus()
        if what == "view":
            self.switch_view(arg)
        elif what == "quit":
            self.exit()
        elif what == "help":
            self.action_help()
        elif what == "submit":
            self.action_request("submit")
        elif what == "node":
            self.open_node(arg)
        elif what == "job" and arg.isdigit():
            self.open_job(int(arg))
        elif message.text.strip():
            self.notify(f"no view {message.text.strip()!r}: try :nodes, :jobs, :queues or :events",
                        severity="warning")

    @on(CommandBar.Left)
    def _on_command_bar_left(self, message: CommandBar.Left) -> None:
        view = self.active_view
        if message.mode == "/" and view.filter:
            view.filter = ""
            self._filter_changed(view)
        view.table.focus()

    @on(Input.Changed, "#command-bar")
    def _on_filter_typed(self, event: Input.Changed) -> None:
        bar = self._command_bar
        if bar.mode == "/" and bar.display:
            view = self.active_view
            view.filter = event.value.strip()
            self._filter_changed(view)

    # -- keys (bindings, palette and help all come from tui.actions) ------------------------

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        return actions.allowed(action, parameters, self.readonly)

    def action_command(self) -> None:
        if isinstance(self.screen, Screen) and self.screen is self.screen_stack[0]:
            self._command_bar.open(":")

    def action_filter(self) -> None:
        if self.screen is self.screen_stack[0]:
            self._command_bar.open("/", self.active_view.filter)

    def action_help(self) -> None:
        self.push_screen(HelpScreen(self.readonly))

    def action_view(self, kind: str) -> None:
        self.switch_view(kind)

    def action_clear(self) -> None:
        view = self.active_view
        if view.filter:
            view.filter = ""
            self._filter_changed(view)
        elif view.table.marks:
            view.table.clear_marks()
            view.update_title()

    def action_slower(self) -> None:
        self.refresh_interval = min(60.0, self.refresh_interval + 1)
        self.notify(f"refresh every {self.refresh_interval:g}s")

    def action_faster(self) -> None:
        self.refresh_interval = max(0.5, self.refresh_interval - 1)
        self.notify(f"refresh every {self.refresh_interval:g}s")

    def action_refresh_now(self) -> None:
        for source in ("cluster", "nodes", "jobs", "queues", "events"):
            self.fetch(source)

    def action_request(self, action: str, screen: Screen | None = None) -> None:
        """A verb from an app-wide key or the palette: on the screen's own job or node, else on
        the marked or selected rows of the view of that noun."""
        noun = actions.BY_ID[action].noun
        self.request_action(action, self._targets(noun, screen or self.screen))

    def _targets(self, noun: str, screen: Screen) -> list:
        if noun == "job" and isinstance(screen, JobScreen):
            return [screen.job_id]
        if noun == "node" and isinstance(screen, NodeScreen):
            return [screen.node_name]
        return self._views[f"{noun}s"].targets(noun) if noun else []

    def _scopes(self, screen: Screen) -> set[str]:
        if isinstance(screen, NodeScreen):
            return {"main", "table", "node"}
        if isinstance(screen, JobScreen):
            return {"main", "job"}
        if screen is self.screen_stack[0]:
            return {"main", "table", self.active_view.KIND}
        return {"main"}

    def palette_actions(self, screen: Screen) -> list[Action]:
        """What the command palette offers on `screen` (see ActionCommands)."""
        return actions.palette(self._scopes(screen), self.readonly)

    def run_palette_action(self, action: Action, screen: Screen) -> None:
        """Run what was chosen in the palette where its keys would have run it."""
        if action.verb:
            self.action_request(action.id, screen)
            return
        here = set(action.where)
        if "main" in here:
            namespace = self
        elif here & {"node", "job"}:
            namespace = screen
        elif here & set(self._views):
            namespace = self._views[next(iter(here & set(self._views)))]
        else:
            namespace = self.active_view.table
        self.call_later(self.run_action, action.action, namespace)

    # -- verbs ------------------------------------------------------------------------------

    def request_action(self, verb: str, targets: list) -> None:
        """Ask what must be asked (confirm, reason, priority, the form), then act."""
        if self.readonly:
            self.notify("read-only session: actions are off (started with --readonly)",
                        severity="warning")
            return
        if verb == "submit":
            self.push_screen(SubmitScreen(), lambda spec: spec and self.perform("submit", [spec]))
            return
        spec = actions.BY_ID[verb]
        if not targets:
            self.notify(f"no {spec.noun} selected", severity="warning")
            return
        if verb == "priority":
            listed = ", ".join(map(str, targets[:8]))
            self.push_screen(
                PromptScreen(f"New priority for {len(targets)} job(s): {listed}",
                             "integer, higher runs first", integer=True),
                lambda value: value and self.perform("priority", targets, priority=int(value)))
        elif spec.confirm:
            self.push_screen(
                ConfirmScreen(verb, spec.noun, targets, need_reason=verb == "drain"),
                lambda result: result is not None and self.perform(verb, targets, **result))
        else:
            self.perform(verb, targets)

    @work(thread=True, exit_on_error=False, group="actions")
    def perform(self, verb: str, targets: list, **kwargs) -> None:
        done, failures = verbs.run(self.backend, verb, targets, **kwargs)
        self.post_message(ActionDone(verb, done, failures))

    @on(ActionDone)
    def _on_action_done(self, message: ActionDone) -> None:
        if not self.screen_stack:  # the app closed while the daemon answered
            return
        verb, done, failures = message.verb, message.done, message.failures
        if failures:
            self.notify(verbs.refusal(verb, failures), severity="error", title="daemon refused",
                        timeout=10)
        if done:
            self.notify(verbs.success(verb, done))
            for view in self.views.values():
                if not view.is_mounted or not view.query(KeyedTable):  # torn down, or not built yet
                    continue
                if view.table.marks:
                    view.table.clear_marks()
                    view.update_title()
        for source in AFFECTS[actions.BY_ID[verb].noun or "job"]:
            self.soon(source)
        if isinstance(self.screen, JobScreen):
            self.screen.fetch_job()


def run_tui(url: str, token: str, readonly: bool = False, refresh: float = 2.0) -> None:
    """Open the TUI on the daemon at `url` (what `trainyard tui` and `trainyard demo` call)."""
    from tui.backend import HttpBackend

    TrainyardApp(HttpBackend(url, token), readonly=readonly, refresh=refresh).run()
