"""Drill-down screens: a node's GPUs with sparklines, and a job with its spec, events and log."""

from __future__ import annotations

import shlex
import time
from collections.abc import Callable
from typing import Any

from rich.table import Table
from rich.text import Text
from textual import on, work
from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.screen import Screen
from textual.widgets import Footer, Input, Log, Static

from tui import actions
from tui import format as fmt
from tui.backend import Backend, BackendError, BackendUnreachable
from tui.components.table import KeyedTable
from tui.components.views import ClusterHeader, Verbs
from tui.messages import Fetched, FetchFailed, OpenJob
from tui.state import ClusterState

LOG_LINES_KEPT = 5000


class DetailScreen(Verbs, Screen):
    """A drill-down screen: shows the cluster state it is given when mounted, and again whenever
    the app calls `show` with fresh data."""

    def __init__(self, state: ClusterState, clock: Callable[[], float]) -> None:
        super().__init__()
        self.state = state
        self.clock = clock
        self.readonly = state.readonly

    def on_mount(self) -> None:
        self.show(self.state, self.clock())

    def show(self, state: ClusterState, now: float) -> None:
        self.query_one(ClusterHeader).show(state, now)


class NodeScreen(DetailScreen):
    """One row per GPU: utilisation and memory over the last minutes, temperature, power, errors,
    and the job on it. Enter on a GPU opens its job."""

    BINDINGS = actions.bindings("node")
    COLUMNS = [("GPU", 3), ("UTIL", 4), ("UTIL HISTORY", 30), ("MEM", 11),
               ("MEM HISTORY", 30), ("TEMP", 4), ("POWER", 9), ("ERRORS", 12), ("JOB", 7)]

    def __init__(self, name: str, state: ClusterState, clock: Callable[[], float]) -> None:
        super().__init__(state, clock)
        self.node_name = name
        self.node: dict | None = None

    def compose(self) -> ComposeResult:
        yield ClusterHeader(id="header")
        with Vertical(id="node-body", classes="view"):
            yield Static(id="node-info")
            yield KeyedTable(self.COLUMNS, id="gpus-table")
        yield Footer()

    def on_mount(self) -> None:
        self.query_one("#node-body").border_title = f" node {self.node_name} "
        super().on_mount()

    def show(self, state: ClusterState, now: float) -> None:
        super().show(state, now)
        node = self.node = state.node(self.node_name)
        info = self.query_one("#node-info", Static)
        if node is None:
            info.update(Text(f"node {self.node_name} is not in the cluster any more", style="red"))
            return
        text = Text()
        text.append(f"{node.get('name')}  ", style="bold")
        text.append_text(fmt.state_text(node.get("state"), fmt.NODE_STATE_STYLE))
        if node.get("reason"):
            text.append(f"  ({node['reason']})", style="yellow")
        text.append(f"\npool {node.get('pool') or '-'}  provider {node.get('provider') or '-'}  "
                    f"{node.get('user') or ''}@{node.get('address') or '-'}:{node.get('port') or 22}  "
                    f"{node.get('gpu_model') or '-'} × {node.get('gpus_total', '-')}  "
                    f"cpus {node.get('cpus', '-')}  mem {fmt.gib(node.get('mem_mb'))}G")
        telemetry = node.get("telemetry") or {}
        text.append(f"\nlabels {fmt.labels_text(node.get('labels')) or '-'}  "
                    f"telemetry {fmt.ago(telemetry.get('time'), now)}", style="dim")
        gate = node.get("health_checks") or {}
        if gate.get("status"):  # the health gate: how the node's last checks went, check by check
            style = {"passed": "green", "failed": "red"}.get(gate["status"], "yellow")
            text.append("\nhealth gate ", style="dim")
            text.append(gate["status"], style=style)
            for c in gate.get("checks") or ():
                text.append(f"  {c.get('check')}: {c.get('result')}",
                            style="red" if c.get("result") == "fail" else "dim")
        fencing = node.get("fencing") or {}
        if fencing:
            text.append(f"\nfencing {fencing.get('cgroup') or 'none'}"
                        + ("" if fencing.get("devices") else "  GPUs NOT fenced")
                        + (f"  ({fencing['reason']})" if fencing.get("reason") else ""),
                        style="dim" if fencing.get("devices") else "yellow")
        info.update(text)
        rows = {}
        for gpu in telemetry.get("gpus") or []:
            util, mem = state.history.series(self.node_name, gpu.get("index"))
            rows[str(gpu.get("index"))] = fmt.gpu_cells(gpu, util, mem, spark_width=30)
        self.query_one(KeyedTable).sync(rows)

    @on(KeyedTable.RowChosen)
    def _open(self, event: KeyedTable.RowChosen) -> None:
        event.stop()
        for gpu in ((self.node or {}).get("telemetry") or {}).get("gpus") or []:
            if str(gpu.get("index")) == event.key and gpu.get("job_id") is not None:
                self.post_message(OpenJob(int(gpu["job_id"])))

    def targets(self, noun: str) -> list:
        return [self.node_name]

    def action_back(self) -> None:
        self.dismiss()


class JobScreen(DetailScreen):
    """A job: spec and allocation, its events, and a live log tail with follow/pause and search.
    It fetches the job and its log itself, on the backend it is given."""

    BINDINGS = actions.bindings("job")

    def __init__(self, job_id: int, backend: Backend, state: ClusterState,
                 clock: Callable[[], float]) -> None:
        super().__init__(state, clock)
        self.job_id = job_id
        self.backend = backend
        self.job: dict | None = None
        self.log_offset = 0
        self.log_lines: list[str] = []
        self.partial = ""
        self.follow = True
        self.search = ""
        self.unseen = 0
        self._log_inflight = False
        self._job_inflight = False

    def compose(self) -> ComposeResult:
        yield ClusterHeader(id="header")
        with Horizontal(id="job-top"):
            yield Static(id="job-spec", classes="view")
            yield Static(id="job-events", classes="view")
        with Vertical(id="job-log-box", classes="view"):
            yield Log(id="job-log", max_lines=LOG_LINES_KEPT)
            yield Input(placeholder="search the log (enter keeps, esc clears)", id="log-search")
        yield Footer()

    def on_mount(self) -> None:
        self.query_one("#job-spec").border_title = f" job {self.job_id} "
        self.query_one("#job-events").border_title = " events "
        self.query_one("#log-search").display = False
        self._update_log_title()
        super().on_mount()
        self.fetch_job()
        self.fetch_log()

    # -- data -------------------------------------------------------------------------------

    def fetch_job(self) -> None:
        if not self._job_inflight:
            self._job_inflight = True
            self._get("job", lambda b: b.job(self.job_id))

    def fetch_log(self) -> None:
        if not self._log_inflight:
            self._log_inflight = True
            offset = self.log_offset
            self._get("log", lambda b: b.log(self.job_id, offset=offset))

    @work(thread=True, exit_on_error=False)
    def _get(self, source: str, call: Any) -> None:
        try:
            data = call(self.backend)
        except (BackendError, BackendUnreachable) as exc:
            self.post_message(FetchFailed(source, getattr(exc, "detail", str(exc))))
        except Exception as exc:  # a bug or a broken answer: keep the screen alive, say it
            self.post_message(FetchFailed(source, f"{type(exc).__name__}: {exc}"))
        else:
            self.post_message(Fetched(source, data, time.time()))

    def on_fetched(self, message: Fetched) -> None:
        message.stop()
        if message.source == "job":
            self._job_inflight = False
            self.job = message.data
            self.show(self.state, self.clock())
            self.set_timer(self.state.refresh_interval, self.fetch_job)
        elif message.source == "log":
            self._log_inflight = False
            text, offset = message.data
            self.log_offset = offset
            self._add_log(text)
            self.set_timer(1.0, self.fetch_log)

    def on_fetch_failed(self, message: FetchFailed) -> None:
        message.stop()
        if message.source == "job":
            self._job_inflight = False
            self.query_one("#job-spec", Static).update(Text(message.error, style="red"))
            self.set_timer(self.state.refresh_interval, self.fetch_job)
        else:
            self._log_inflight = False
            self.set_timer(2.0, self.fetch_log)

    def _add_log(self, text: str) -> None:
        if not text:
            return
        text = self.partial + text
        lines = text.split("\n")
        self.partial = lines.pop()
        self.log_lines.extend(lines)
        if len(self.log_lines) > LOG_LINES_KEPT:
            del self.log_lines[: len(self.log_lines) - LOG_LINES_KEPT]
        if self.follow:
            log = self.query_one(Log)
            shown = [ln for ln in lines if self._matches(ln)]
            if shown:
                log.write_lines(shown)
        else:
            self.unseen += len(lines)
        self._update_log_title()

    def _matches(self, line: str) -> bool:
        return not self.search or self.search.lower() in line.lower()

    def _redraw_log(self) -> None:
        log = self.query_one(Log)
        log.clear()
        log.write_lines([ln for ln in self.log_lines if self._matches(ln)])
        log.scroll_end(animate=False, immediate=False)
        self.unseen = 0
        self._update_log_title()

    def _update_log_title(self) -> None:
        title = " log ● following " if self.follow else f" log ‖ paused ({self.unseen} new lines) "
        if self.search:
            n = sum(1 for ln in self.log_lines if self._matches(ln))
            title += f"/{self.search} ({n} matching) "
        self.query_one("#job-log-box").border_title = title

    # -- view -------------------------------------------------------------------------------

    def show(self, state: ClusterState, now: float) -> None:
        super().show(state, now)
        job = self.job or next((j for j in state.jobs if j.get("id") == self.job_id), None)
        if job is None:
            return
        spec = Table.grid(padding=(0, 1))
        spec.add_column(style="dim", no_wrap=True)
        spec.add_column()
        spec.add_row("name", job.get("name") or "-")
        spec.add_row("user / queue", f"{job.get('user')} / {job.get('queue')}")
        state_line = fmt.job_state_text(job)
        if job.get("reason"):
            state_line.append(f"  {job['reason']}", style="yellow")
        if job.get("reason_detail"):
            state_line.append(f" ({job['reason_detail']})", style="yellow")
        if job.get("exit_code") is not None:
            state_line.append(f"  exit {job['exit_code']}")
        spec.add_row("state", state_line)
        spec.add_row("resources", f"{job.get('gpus') or 0} GPUs × {job.get('nodes') or 1} nodes, "
                                  f"{job.get('cpus') or '-'} CPUs, mem {job.get('mem') or '-'}")
        limit = job.get("time_limit")
        spec.add_row("priority / limit", f"{job.get('priority', '-')} / "
                                         f"{fmt.duration(limit) if limit else '-'}")
        command = job.get("command")
        spec.add_row("command", shlex.join(command) if isinstance(command, list) else str(command or "-"))
        if job.get("image"):  # a container job: what was asked for, and the digest the nodes ran
            spec.add_row("image", job["image"] + (f"  {job['image_digest']}" if job.get("image_digest") else ""))
        spec.add_row("submitted", f"{fmt.clock(job.get('submit_time'))} ({fmt.ago(job.get('submit_time'), now)})")
        spec.add_row("started / ended", f"{fmt.clock(job.get('start_time'))} / {fmt.clock(job.get('end_time'))}")
        if job.get("estimated_start"):
            basis = job.get("estimated_start_basis")
            spec.add_row("estimated start", fmt.clock(job["estimated_start"]) + (f" (from {basis})" if basis else ""))
        if job.get("prediction_basis"):  # what history says it will run, and on what it is based
            spec.add_row("predicted run time", job["prediction_basis"])
        allocation = job.get("allocation") or []
        spec.add_row("allocation", "\n".join(
            f"{a.get('node')}: GPUs {','.join(str(g) for g in a.get('gpus') or [])}"
            for a in allocation) or "-")
        self.query_one("#job-spec", Static).update(spec)
        targets = {f"job/{self.job_id}", f"job:{self.job_id}", str(self.job_id)}
        mine = [e for e in state.events if str(e.get("target")) in targets
                or (e.get("detail") or {}).get("job_id") == self.job_id][-12:]
        events = Text()
        for e in mine:
            events.append(f"{fmt.clock(e.get('time'))} ", style="dim")
            events.append(f"{e.get('action')} ", style="bold")
            events.append(f"{e.get('actor') or ''} ")
            detail = e.get("detail") or {}
            if isinstance(detail, dict):
                events.append(" ".join(f"{k}={v}" for k, v in detail.items()), style="dim")
            events.append("\n")
        self.query_one("#job-events", Static).update(events or Text("no events yet", style="dim"))

    # -- actions ----------------------------------------------------------------------------

    def action_back(self) -> None:
        search = self.query_one("#log-search", Input)
        if search.display or self.search:
            search.display = False
            search.value = ""
            self.search = ""
            self._redraw_log()
            return
        self.dismiss()

    def action_follow(self) -> None:
        self.follow = not self.follow
        if self.follow:
            self._redraw_log()
        self._update_log_title()

    def action_search(self) -> None:
        search = self.query_one("#log-search", Input)
        search.display = True
        search.focus()

    def on_input_changed(self, event: Input.Changed) -> None:
        if event.input.id == "log-search":
            self.search = event.value
            self._redraw_log()

    def on_input_submitted(self, event: Input.Submitted) -> None:
        if event.input.id == "log-search":
            event.input.display = False
            self.query_one(Log).focus()

    def targets(self, noun: str) -> list:
        return [self.job_id]
