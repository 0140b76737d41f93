"""The trainyard TUI: nodes, GPUs, queues and jobs, live, with k9s-style keys."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from functools import partial

from textual import work
from textual.app import App, ComposeResult, SystemCommand
from textual.binding import Binding
from textual.screen import Screen
from textual.widgets import ContentSwitcher, Footer, Input

from tui.backend import Backend, BackendError, BackendUnreachable
from tui.components.command_bar import CommandBar, resolve_command
from tui.components.detail import JobScreen, NodeScreen
from tui.components.dialogs import ConfirmScreen, HelpScreen, PromptScreen, SubmitScreen
from tui.components.views import (
    MUTATING,
    ClusterHeader,
    EventsView,
    JobsView,
    NodesView,
    QueuesView,
    ResourceView,
)
from tui.messages import ActionDone
from tui.refresh import AFFECTS, RefreshMixin
from tui.state import ClusterState

# verb -> (noun, needs the confirm screen, backend method)
VERBS = {
    "cancel": ("job", True, "cancel"),
    "requeue": ("job", True, "requeue"),
    "hold": ("job", False, "hold"),
    "release": ("job", False, "release"),
    "priority": ("job", False, "set_priority"),
    "drain": ("node", True, "drain_node"),
    "resume": ("node", False, "resume_node"),
}
PAST = {"cancel": "cancelled", "requeue": "requeued", "hold": "held", "release": "released",
        "priority": "reprioritised", "drain": "drained", "resume": "resumed"}
VIEW_SOURCES = {"nodes": ("nodes",), "jobs": ("jobs",), "queues": ("queues", "jobs"),
                "events": ("events",)}


class TrainyardApp(RefreshMixin, App):
    CSS_PATH = "app.tcss"
    TITLE = "trainyard"
    BINDINGS = [
        Binding("colon", "command", "View", key_display=":"),
        Binding("slash", "filter", "Filter", key_display="/"),
        Binding("question_mark", "help", "Help", key_display="?"),
        Binding("escape", "back", "Back", show=False),
        Binding("n", "submit", "Submit"),
        Binding("plus", "slower", "Slower refresh", show=False),
        Binding("minus", "faster", "Faster refresh", show=False),
        Binding("ctrl+r", "refresh_now", "Refresh", show=False),
        Binding("q", "quit", "Quit"),
    ]

    def __init__(self, backend: Backend, readonly: bool = False, refresh: float = 2.0,
                 clock: Callable[[], float] = time.time, stream: bool = True,
                 view: str = "nodes") -> None:
        super().__init__()
        self.backend = backend
        self.readonly = readonly
        self.refresh_interval = refresh
        self.clock = clock
        self.stream = stream
        self.initial_view = view
        self.state = ClusterState()
        self._dirty: set[str] = set()
        self._jobs_query_sent: dict | None = None
        # Kept by reference: App.query_one looks at the top screen, which may be a dialog.
        self._views: dict[str, ResourceView] = {
            v.KIND: v for v in (NodesView(), JobsView(), QueuesView(), EventsView())}
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
    def stale_after(self) -> float:
        return max(3 * self.refresh_interval, 5.0)

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
                header.show(self.state, now, self.stale_after, self.streaming, self.readonly)

    def data_changed(self, source: str) -> None:
        """A source answered (or failed): redraw what shows it; hidden views redraw when shown."""
        self._show_headers()
        now = self.now()
        for kind, sources in VIEW_SOURCES.items():
            if source in sources:
                self._dirty.add(kind)
        active = self.active_view.KIND
        if active in self._dirty:
            self._dirty.discard(active)
            self.active_view.show(self.state, now)
        if source in ("nodes", "events", "jobs"):
            for screen in self.screen_stack[1:]:
                if isinstance(screen, (NodeScreen, JobScreen)):
                    screen.show(self.state, now)

    def switch_view(self, kind: str) -> None:
        self._switcher.current = kind
        view = self.active_view
        self._dirty.discard(kind)
        view.show(self.state, self.now())
        view.table.focus()

    def filter_changed(self, view: ResourceView) -> None:
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
        self.filter_changed(view)

    def open_node(self, name: str) -> None:
        self.push_screen(NodeScreen(name))

    def open_job(self, job_id: int) -> None:
        self.push_screen(JobScreen(job_id))

    # -- keys -------------------------------------------------------------------------------

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        return not (action in MUTATING and self.readonly)

    def action_command(self) -> None:
        if isinstance(self.screen, Screen) and self.screen is self.screen_stack[0]:
            self._command_bar.open(":")

    def action_filter(self) -> None:
        if self.screen is self.screen_stack[0]:
            self._command_bar.open("/", self.active_view.filter)

    def action_help(self) -> None:
        self.push_screen(HelpScreen())

    def action_back(self) -> None:
        view = self.active_view
        if view.filter:
            view.filter = ""
            self.filter_changed(view)
        elif view.table.marks:
            view.table.clear_marks()
            view.update_title()

    def action_submit(self) -> None:
        self.request_action("submit", [])

    def action_slower(self) -> None:
        self.refresh_interval = min(60.0, self.refresh_interval + 1)
        self.notify(f"refresh every {self.refresh_interval:g}s")

    def action_faster(self) -> None:
        self.refresh_interval = max(0.5, self.refresh_interval - 1 if self.refresh_interval > 1 else 0.5)
        self.notify(f"refresh every {self.refresh_interval:g}s")

    def action_refresh_now(self) -> None:
        for source in ("cluster", "nodes", "jobs", "queues", "events"):
            self.fetch(source)

    def on_command_bar_command(self, message: CommandBar.Command) -> None:
        view = self.active_view
        if message.mode == "/":
            view.filter = message.text.strip()
            self.filter_changed(view)
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
            self.action_submit()
        elif what == "node":
            self.open_node(arg)
        elif what == "job" and arg.isdigit():
            self.open_job(int(arg))
        elif message.text.strip():
            self.notify(f"no view {message.text.strip()!r}: try :nodes, :jobs, :queues or :events",
                        severity="warning")

    def on_command_bar_left(self, message: CommandBar.Left) -> None:
        view = self.active_view
        if message.mode == "/" and view.filter:
            view.filter = ""
            self.filter_changed(view)
        view.table.focus()

    def on_input_changed(self, event: Input.Changed) -> None:
        bar = event.input
        if isinstance(bar, CommandBar) and bar.mode == "/" and bar.display:
            view = self.active_view
            view.filter = event.value.strip()
            self.filter_changed(view)

    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        yield from super().get_system_commands(screen)
        for kind in ("nodes", "jobs", "queues", "events"):
            yield SystemCommand(f"View: {kind}", f"Switch to the {kind} view (:{kind})",
                                partial(self.switch_view, kind))
        yield SystemCommand("Filter", "Filter the rows of this view (/)", self.action_filter)
        yield SystemCommand("Help", "Keys and views (?)", self.action_help)
        yield SystemCommand("Refresh now", "Fetch everything again (ctrl+r)", self.action_refresh_now)
        if self.readonly:
            return
        yield SystemCommand("Submit job", "Open the submit form (n)", self.action_submit)
        if isinstance(screen, JobScreen):
            jobs = lambda: [screen.job_id]  # noqa: E731
        else:
            jobs = lambda: [int(k) for k in self._views["jobs"].selected()]  # noqa: E731
        nodes = (lambda: [screen.node_name]) if isinstance(screen, NodeScreen) else (
            lambda: self._views["nodes"].selected())
        for verb, (noun, confirm, _) in VERBS.items():
            targets = jobs if noun == "job" else nodes
            key = {"cancel": "C", "requeue": "R", "hold": "h", "release": "r", "priority": "p",
                   "drain": "D", "resume": "u"}[verb]
            yield SystemCommand(
                f"{verb.capitalize()} {noun}s",
                f"{verb.capitalize()} the marked or selected {noun}s ({key})"
                + (", after a confirm" if confirm else ""),
                lambda verb=verb, targets=targets: self.request_action(verb, targets()))

    # -- actions ----------------------------------------------------------------------------

    def request_action(self, verb: str, targets: list) -> None:
        """Ask what must be asked (confirm, reason, priority, the form), then act."""
        if self.readonly:
            self.notify("read-only session: actions are off (started with --readonly)",
                        severity="warning")
            return
        if verb == "submit":
            self.push_screen(SubmitScreen(), lambda spec: spec and self.perform("submit", [spec]))
            return
        noun, confirm, _ = VERBS[verb]
        if not targets:
            self.notify(f"no {noun} selected", severity="warning")
            return
        if verb == "priority":
            self.push_screen(
                PromptScreen(f"New priority for {len(targets)} job(s): {', '.join(map(str, targets[:8]))}",
                             "integer, higher runs first", integer=True),
                lambda value: value and self.perform("priority", targets, priority=int(value)))
        elif confirm:
            self.push_screen(
                ConfirmScreen(verb, noun, targets, need_reason=verb == "drain"),
                lambda result: result is not None and self.perform(verb, targets, **result))
        else:
            self.perform(verb, targets)

    @work(thread=True, exit_on_error=False, group="actions")
    def perform(self, verb: str, targets: list, **kwargs) -> None:
        done, failures = [], {}
        for target in targets:
            try:
                if verb == "submit":
                    done.append(self.backend.submit(target).get("id"))
                    continue
                method = getattr(self.backend, VERBS[verb][2])
                if verb == "priority":
                    method(target, kwargs["priority"])
                elif verb == "drain":
                    method(target, kwargs["reason"])
                else:
                    method(target)
                done.append(target)
            except (BackendError, BackendUnreachable) as exc:
                failures[target if verb != "submit" else "submit"] = getattr(exc, "detail", None) or str(exc)
            except Exception as exc:
                failures[target if verb != "submit" else "submit"] = f"{type(exc).__name__}: {exc}"
        self.post_message(ActionDone(verb, done, failures))

    def on_action_done(self, message: ActionDone) -> None:
        verb, done, failures = message.verb, message.done, message.failures
        if failures:
            first_target, first = next(iter(failures.items()))
            more = f" (and {len(failures) - 1} more refused)" if len(failures) > 1 else ""
            where = "" if verb == "submit" else f" {first_target}"
            self.notify(f"{verb}{where} refused: {first}{more}", severity="error",
                        title="daemon refused", timeout=10)
        if done:
            if verb == "submit":
                self.notify(f"submitted job {', '.join(map(str, done))}")
            else:
                self.notify(f"{PAST[verb]} {', '.join(map(str, done[:10]))}"
                            + (f" and {len(done) - 10} more" if len(done) > 10 else ""))
            for view in self.views.values():
                if view.table.marks:
                    view.table.clear_marks()
                    view.update_title()
        noun = "job" if verb == "submit" else VERBS[verb][0]
        for source in AFFECTS[noun]:
            self.soon(source)
        if isinstance(self.screen, JobScreen):
            self.screen.fetch_job()


def run_tui(url: str, token: str, readonly: bool = False, refresh: float = 2.0) -> None:
    """Open the TUI on the daemon at `url` (what `trainyard tui` and `trainyard demo` call)."""
    from tui.backend import HttpBackend

    TrainyardApp(HttpBackend(url, token), readonly=readonly, refresh=refresh).run()
