"""The four main views (nodes, jobs, queues, events) and the cluster header above them."""

from __future__ import annotations

from typing import Any

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.widgets import DataTable, Static

from tui import format as fmt
from tui.components.table import KeyedTable
from tui.state import ClusterState

# Actions that change the cluster: hidden and refused under --readonly.
MUTATING = {"cancel", "requeue", "hold", "release", "priority", "drain", "resume", "submit"}

JOB_PAGE = 2000  # rows asked of the daemon for the jobs table; filter to narrow beyond that


JOB_ACTION_BINDINGS = [
    Binding("C", "cancel", "Cancel"),
    Binding("R", "requeue", "Requeue"),
    Binding("h", "hold", "Hold"),
    Binding("r", "release", "Release"),
    Binding("p", "priority", "Priority"),
]
NODE_ACTION_BINDINGS = [
    Binding("D", "drain", "Drain"),
    Binding("u", "resume", "Resume"),
]


class JobActions:
    """The job verbs for a view or screen that says which jobs it means."""

    def job_targets(self) -> list[int]:
        raise NotImplementedError

    def action_cancel(self) -> None:
        self.app.request_action("cancel", self.job_targets())

    def action_requeue(self) -> None:
        self.app.request_action("requeue", self.job_targets())

    def action_hold(self) -> None:
        self.app.request_action("hold", self.job_targets())

    def action_release(self) -> None:
        self.app.request_action("release", self.job_targets())

    def action_priority(self) -> None:
        self.app.request_action("priority", self.job_targets())


class NodeActions:
    """The node verbs for a view or screen that says which nodes it means."""

    def node_targets(self) -> list[str]:
        raise NotImplementedError

    def action_drain(self) -> None:
        self.app.request_action("drain", self.node_targets())

    def action_resume(self) -> None:
        self.app.request_action("resume", self.node_targets())


class ClusterHeader(Static):
    """Cluster name, who you are, whether the data is live, and the totals."""

    def show(self, state: ClusterState, now: float, stale_after: float, stream: bool,
             readonly: bool) -> None:
        c = state.cluster
        text = Text()
        text.append(" trainyard ", style="bold reverse")
        text.append(f" {c.get('name') or '…'} ", style="bold")
        me = state.me
        if me:
            text.append(f" {me.get('user')}@{me.get('role')} ", style="dim")
        if readonly:
            text.append(" READONLY ", style="bold black on yellow")
        last = state.fetched_at.get("cluster")
        if last is None:
            error = state.errors.get("cluster")
            text.append(" ○ connecting… " if not error else " ✖ unreachable ", style="yellow" if not error else "bold red")
        else:
            age = max(0.0, now - last)
            if age <= stale_after:
                text.append(" ● live " + ("(stream)" if stream else "(polling)"), style="green")
            else:
                text.append(f" ◌ stale {fmt.duration(age)} ", style="bold red")
        text.append("\n")
        text.append(" nodes ", style="dim")
        text.append(f"{c.get('nodes_up', '-')}/{c.get('nodes_total', '-')} up")
        text.append("   GPUs ", style="dim")
        used, total = c.get("gpus_used"), c.get("gpus_total")
        text.append_text(fmt.bar(used, total, 12))
        text.append(" busy")
        text.append("   jobs ", style="dim")
        text.append(f"{c.get('jobs_running', '-')} running", style="green")
        text.append(" / ")
        text.append(f"{c.get('jobs_pending', '-')} pending", style="yellow")
        error = next(iter(state.errors.values()), None)
        if error:
            text.append(f"   {error}", style="red")
        self.update(text)


class ResourceView(Vertical):
    """One table of resources with a k9s-style title: kind, visible/total, filter."""

    KIND = ""
    COLUMNS: list[tuple[str, int]] = []

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(id=self.KIND, classes="view", **kwargs)
        self.filter = ""
        self.total = 0

    def compose(self) -> ComposeResult:
        yield KeyedTable(self.COLUMNS, id=f"{self.KIND}-table")

    @property
    def table(self) -> KeyedTable:
        return self.query_one(KeyedTable)

    def items(self, state: ClusterState) -> dict[str, Any]:
        """What the view lists, keyed by id, in display order."""
        raise NotImplementedError

    def cells(self, item: Any, now: float) -> tuple:
        """One item's row."""
        raise NotImplementedError

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        return not (action in MUTATING and self.app.readonly)

    def show(self, state: ClusterState, now: float) -> None:
        items = self.items(state)
        self.total = len(items)
        _, terms = fmt.parse_filter(self.filter, self.server_keys())

        def make(item: Any) -> tuple:
            return self.cells(item, now)

        if terms:  # a filter reads every row's text; only then are all rows computed
            rows = {k: make(v) for k, v in items.items()}
            self.table.sync({k: c for k, c in rows.items()
                             if fmt.match_filter(fmt.row_text(c), terms)})
        else:
            self.table.sync(items, make)
        self.update_title()

    def server_keys(self) -> tuple[str, ...]:
        return ()

    def update_title(self) -> None:
        shown = self.table.row_count
        title = f" {self.KIND} [{shown}/{self.total}]"
        if self.filter:
            title += f" /{self.filter}"
        if self.table.marks:
            title += f" ● {len(self.table.marks)} marked"
        self.border_title = title + " "

    def selected(self) -> list[str]:
        return self.table.selected()


class NodesView(NodeActions, ResourceView):
    KIND = "nodes"
    COLUMNS = [("NAME", 14), ("POOL", 12), ("STATE", 13), ("GPUS", 14), ("UTIL", 4),
               ("GPU MEM", 13), ("TEMP", 4), ("POWER", 6), ("REASON", 22), ("LABELS", 24)]
    BINDINGS = NODE_ACTION_BINDINGS

    def node_targets(self) -> list[str]:
        return self.selected()

    def items(self, state: ClusterState) -> dict[str, Any]:
        nodes = sorted(state.nodes, key=lambda n: n.get("name", ""))
        return {n["name"]: n for n in nodes if n.get("name")}

    def cells(self, item: Any, now: float) -> tuple:
        return fmt.node_cells(item)

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        event.stop()
        self.app.open_node(event.row_key.value)


class JobsView(JobActions, ResourceView):
    KIND = "jobs"
    COLUMNS = [("ID", 7), ("NAME", 16), ("USER", 8), ("QUEUE", 9), ("STATE", 10),
               ("REASON", 20), ("GPUS", 5), ("SUBMITTED", 11), ("WAITED", 8), ("RUNTIME", 8)]
    BINDINGS = [*JOB_ACTION_BINDINGS, Binding("a", "toggle_all", "All/active")]

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.show_all = False

    def server_keys(self) -> tuple[str, ...]:
        return ("state", "user", "queue", "team")  # team: filtered here, not by the daemon

    def server_query(self) -> dict:
        """What to ask the daemon for: the page, finished jobs or not, and key:value filters."""
        server, _ = fmt.parse_filter(self.filter, self.server_keys())
        query: dict = {"all": self.show_all, "limit": JOB_PAGE}
        if "state" in server:
            query["state"] = server["state"].upper()
        for key in ("user", "queue"):
            if key in server:
                query[key] = server[key]
        return query

    def items(self, state: ClusterState) -> dict[str, Any]:
        jobs = sorted(state.jobs, key=lambda j: j.get("id") or 0, reverse=True)
        server, _ = fmt.parse_filter(self.filter, self.server_keys())
        team = server.get("team")
        if team is not None:  # the daemon's mapping: account, else the user's team, else default
            members = state.user_teams()
            jobs = [j for j in jobs if fmt.team_of(j, members).lower() == team]
        return {str(j["id"]): j for j in jobs if j.get("id") is not None}

    def cells(self, item: Any, now: float) -> tuple:
        return fmt.job_cells(item, now)

    def update_title(self) -> None:
        super().update_title()
        scope = "all" if self.show_all else "active"
        extra = f"({scope}"
        if self.total >= JOB_PAGE:
            extra += f", first {JOB_PAGE}: filter to narrow"
        self.border_title = self.border_title.rstrip() + f" {extra}) "

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        event.stop()
        self.app.open_job(int(event.row_key.value))

    def job_targets(self) -> list[int]:
        return [int(k) for k in self.selected()]

    def action_toggle_all(self) -> None:
        self.show_all = not self.show_all
        self.app.filter_changed(self)


class QueuesView(ResourceView):
    """Queues from the daemon, and per team its quota, fair share and jobs (from /v1/teams)."""

    KIND = "queues"
    COLUMNS = [("QUEUE", 14), ("STATE", 8), ("PRIORITY", 8), ("PENDING", 8), ("RUNNING", 8),
               ("GPUS / QUOTA", 16), ("FAIR SHARE", 10)]
    TEAM_COLUMNS = [("TEAM", 14), ("COHORT", 10), ("GPUS / QUOTA", 18), ("BORROW", 6),
                    ("LEND", 6), ("SHARES", 6), ("USAGE GPU-H", 11), ("RUNNING", 7),
                    ("PENDING", 7)]

    def compose(self) -> ComposeResult:
        yield KeyedTable(self.COLUMNS, id="queues-table")
        yield KeyedTable(self.TEAM_COLUMNS, id="teams-table")

    @property
    def table(self) -> KeyedTable:
        return self.query_one("#queues-table", KeyedTable)

    @property
    def teams_table(self) -> KeyedTable:
        return self.query_one("#teams-table", KeyedTable)

    def items(self, state: ClusterState) -> dict[str, Any]:
        return {q["name"]: q for q in state.queues if q.get("name")}

    def cells(self, item: Any, now: float) -> tuple:
        return fmt.queue_cells(item)

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        """Enter on a queue or a team: its jobs (queue: a daemon-side filter on the jobs view;
        team: the jobs the daemon charges to it, by account or by member)."""
        event.stop()
        if event.data_table.id == "queues-table":
            self.app.show_jobs(f"queue:{event.row_key.value}")
        elif self.app.state.teams is None:  # per-user fallback rows
            self.app.show_jobs(f"user:{event.row_key.value}")
        else:
            self.app.show_jobs(f"team:{event.row_key.value}")

    def show(self, state: ClusterState, now: float) -> None:
        super().show(state, now)
        _, terms = fmt.parse_filter(self.filter)
        if state.teams is None:
            # A daemon without /v1/teams (or none heard yet): per user, from the jobs shown.
            teams = [{"name": user, "pending": u["pending"], "running": u["running"],
                      "gpus_used": u["gpus"], "fairshare_shares": None}
                     for user, u in sorted(fmt.team_usage(state.jobs).items())]
            title = " teams (per user, from the jobs shown) "
        else:
            teams = [t for t in state.teams if t.get("name")]
            title = f" teams [{len(teams)}] "
        rows = {}
        for team in teams:
            cells = fmt.team_cells(team)
            if not terms or fmt.match_filter(fmt.row_text(cells), terms):
                rows[team["name"]] = cells
        self.teams_table.sync(rows)
        self.teams_table.border_title = title


class EventsView(ResourceView):
    KIND = "events"
    COLUMNS = [("ID", 7), ("TIME", 9), ("ACTOR", 12), ("ACTION", 16), ("TARGET", 18),
               ("DETAIL", 60)]

    def items(self, state: ClusterState) -> dict[str, Any]:
        return {str(e["id"]): e for e in reversed(state.events) if e.get("id") is not None}

    def cells(self, item: Any, now: float) -> tuple:
        return fmt.event_cells(item)

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        """Enter on an event: open what it is about (a job by id, a node by name)."""
        event.stop()
        target = str(self.table.get_cell(event.row_key.value, "TARGET"))
        name = target.split("/", 1)[-1].split(":", 1)[-1]
        if name.isdigit():
            self.app.open_job(int(name))
        elif self.app.state.node(name) is not None:
            self.app.open_node(name)
