"""The four main views (nodes, jobs, queues, events) and the cluster header above them."""

from __future__ import annotations

from typing import Any

from rich.text import Text
from textual import on
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import Static

from tui import actions
from tui import format as fmt
from tui.components.table import KeyedTable
from tui.messages import ActionRequested, FilterChanged, OpenJob, OpenNode, ShowJobs
from tui.state import ClusterState

JOB_PAGE = 2000  # rows asked of the daemon for the jobs table; filter to narrow beyond that


class Verbs:
    """For a view or screen that says which jobs or nodes it means: a verb key posts
    `ActionRequested` with them, and nothing that changes the cluster runs under --readonly."""

    readonly: bool

    def targets(self, noun: str) -> list:
        """The marked rows, else the row under the cursor (or the screen's own job or node)."""
        raise NotImplementedError

    def action_request(self, action: str) -> None:
        self.post_message(ActionRequested(action, self.targets(actions.BY_ID[action].noun)))

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        return actions.allowed(action, parameters, self.readonly)


# the daemon's event loop lag (p99 of the last minute) from which the header says it is busy: a
# daemon with room lags a few milliseconds; at 50 its submissions' p99 is past 50 ms
BUSY_LAG_MS = 50.0


class ClusterHeader(Static):
    """Cluster name, who you are, whether the data is live, and the totals."""

    shown: Text | None = None  # what it shows: redrawn only when that changes

    def show(self, state: ClusterState, now: float) -> None:
        c = state.cluster
        text = Text()
        text.append(" trainyard ", style="bold reverse")
        text.append(f" {c.get('name') or '…'} ", style="bold")
        me = state.me
        if me:
            text.append(f" {me.get('user')}@{me.get('role')} ", style="dim")
        if state.readonly:
            text.append(" READONLY ", style="bold black on yellow")
        last = state.fetched_at.get("cluster")
        if last is None:
            error = state.errors.get("cluster")
            if error:
                text.append(" ✖ unreachable ", style="bold red")
            else:
                text.append(" ○ connecting… ", style="yellow")
        else:
            age = max(0.0, now - last)
            if age <= state.stale_after:
                text.append(" ● live " + ("(stream)" if state.streaming else "(polling)"),
                            style="green")
            else:
                text.append(f" ◌ stale {fmt.duration(age)} ", style="bold red")
        for problem in c.get("problems") or ():  # the daemon's own, e.g. job output it cannot store
            text.append(f"  ⚠ {problem}", style="bold red")
        lag = c.get("loop_lag_p99_ms") or 0
        if lag >= BUSY_LAG_MS:  # every request and agent report waits that long: `trainyard diag`
            text.append(f"  ⚠ daemon busy: its loop lags {lag:.0f} ms (p99)", style="bold yellow")
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
        if text != self.shown:  # a busy cluster's sources answer several times a second
            self.shown = text
            self.update(text)


class ResourceView(Verbs, Vertical):
    """One table of resources with a k9s-style title: kind, visible/total, filter."""

    KIND = ""
    COLUMNS: list[tuple[str, int]] = []

    def __init__(self, readonly: bool = False, **kwargs: Any) -> None:
        super().__init__(id=self.KIND, classes="view", **kwargs)
        self.readonly = readonly
        self.filter = ""
        self.total = 0

    def compose(self) -> ComposeResult:
        yield KeyedTable(self.COLUMNS, id=f"{self.KIND}-table")

    @property
    def table(self) -> KeyedTable:
        return self.query_one(KeyedTable)

    def drawable(self) -> bool:
        """Whether the view's table is there to draw on: a source can answer before the view
        is composed (at the app's start) or after its widgets went (at the app's exit)."""
        return bool(self.query(KeyedTable))

    def items(self, state: ClusterState) -> dict[str, Any]:
        """What the view lists, keyed by id, in display order."""
        raise NotImplementedError

    def cells(self, item: Any, now: float) -> tuple:
        """One item's row."""
        raise NotImplementedError

    def targets(self, noun: str) -> list:
        return self.selected()

    @on(KeyedTable.MarksChanged)
    def _marks_changed(self, event: KeyedTable.MarksChanged) -> None:
        event.stop()
        self.update_title()

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


class NodesView(ResourceView):
    KIND = "nodes"
    COLUMNS = [("NAME", 14), ("POOL", 12), ("STATE", 13), ("GPUS", 14), ("UTIL", 4),
               ("GPU MEM", 13), ("TEMP", 4), ("POWER", 6), ("RUNTIME", 7), ("REASON", 22),
               ("LABELS", 24)]
    BINDINGS = actions.bindings("nodes")

    def items(self, state: ClusterState) -> dict[str, Any]:
        nodes = sorted(state.nodes, key=lambda n: n.get("name", ""))
        return {n["name"]: n for n in nodes if n.get("name")}

    def cells(self, item: Any, now: float) -> tuple:
        return fmt.node_cells(item)

    @on(KeyedTable.RowChosen)
    def _open(self, event: KeyedTable.RowChosen) -> None:
        event.stop()
        self.post_message(OpenNode(event.key))


class JobsView(ResourceView):
    KIND = "jobs"
    COLUMNS = [("ID", 7), ("NAME", 16), ("USER", 8), ("QUEUE", 9), ("STATE", 10),
               ("REASON", 20), ("GPUS", 5), ("SUBMITTED", 11), ("WAITED", 8), ("RUNTIME", 8)]
    BINDINGS = actions.bindings("jobs")

    def __init__(self, readonly: bool = False, **kwargs: Any) -> None:
        super().__init__(readonly, **kwargs)
        self.show_all = False

    def server_keys(self) -> tuple[str, ...]:
        return ("state", "user", "queue", "team")  # team: filtered here, not by the daemon

    def server_query(self) -> dict:
        """What to ask the daemon for: the page, finished jobs or not, and key:value filters."""
        server, _ = fmt.parse_filter(self.filter, self.server_keys())
        query: dict = {"all": self.show_all, "limit": JOB_PAGE}
        if "state" in server and server["state"] not in fmt.STATE_FILTERS:
            query["state"] = server["state"].upper()
        for key in ("user", "queue"):
            if key in server:
                query[key] = server[key]
        return query

    def items(self, state: ClusterState) -> dict[str, Any]:
        jobs = sorted(state.jobs, key=lambda j: j.get("id") or 0, reverse=True)
        server, _ = fmt.parse_filter(self.filter, self.server_keys())
        in_state = fmt.STATE_FILTERS.get(server.get("state", ""))
        if in_state is not None:  # held, starting/configuring: in either vocabulary
            jobs = [j for j in jobs if in_state(j)]
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

    @on(KeyedTable.RowChosen)
    def _open(self, event: KeyedTable.RowChosen) -> None:
        event.stop()
        self.post_message(OpenJob(int(event.key)))

    def targets(self, noun: str) -> list:
        return [int(k) for k in self.selected()]

    def action_toggle_all(self) -> None:
        self.show_all = not self.show_all
        self.post_message(FilterChanged(self))


class QueuesView(ResourceView):
    """Queues from the daemon, and per team its quota, fair share and jobs (from /v1/teams)."""

    KIND = "queues"
    COLUMNS = [("QUEUE", 14), ("STATE", 8), ("PRIORITY", 8), ("PENDING", 8), ("RUNNING", 8),
               ("GPUS / QUOTA", 16), ("FAIR SHARE", 10), ("WHY PENDING", 30)]
    TEAM_COLUMNS = [("TEAM", 14), ("COHORT", 10), ("GPUS / QUOTA", 18), ("BORROW", 6),
                    ("LEND", 6), ("SHARES", 6), ("USAGE GPU-H", 11), ("RUNNING", 7),
                    ("PENDING", 7)]

    per_user = True  # the teams table lists users until the daemon's /v1/teams answered

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
        reasons = fmt.pending_reasons(state.jobs)
        return {q["name"]: {**q, "pending_reasons": reasons.get(q["name"], "")}
                for q in state.queues if q.get("name")}

    def cells(self, item: Any, now: float) -> tuple:
        return fmt.queue_cells(item)

    @on(KeyedTable.RowChosen)
    def _open(self, event: KeyedTable.RowChosen) -> None:
        """Enter on a queue or a team: its jobs (queue: a daemon-side filter on the jobs view;
        team: the jobs the daemon charges to it, by account or by member)."""
        event.stop()
        if event.table.id == "queues-table":
            self.post_message(ShowJobs(f"queue:{event.key}"))
        elif self.per_user:  # the fallback rows are users, not teams
            self.post_message(ShowJobs(f"user:{event.key}"))
        else:
            self.post_message(ShowJobs(f"team:{event.key}"))

    def show(self, state: ClusterState, now: float) -> None:
        super().show(state, now)
        _, terms = fmt.parse_filter(self.filter)
        self.per_user = state.teams is None
        if self.per_user:
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

    @on(KeyedTable.RowChosen)
    def _open(self, event: KeyedTable.RowChosen) -> None:
        """Enter on an event: open what it is about (a job by id, a node by name)."""
        event.stop()
        target = str(self.table.get_cell(event.key, "TARGET"))
        name = target.split("/", 1)[-1].split(":", 1)[-1]
        self.post_message(OpenJob(int(name)) if name.isdigit() else OpenNode(name))
