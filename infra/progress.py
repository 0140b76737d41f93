"""Per-resource progress of a preview or update in the terminal (a live table), or as plain lines."""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import dataclass

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from infra.automation import InfraEvent

OP_SYMBOL = {
    "create": "+", "update": "~", "delete": "-", "replace": "+-", "create-replacement": "++",
    "delete-replaced": "--", "read": ">", "refresh": "~", "import": "=",
}
OP_STYLE = {"create": "green", "update": "yellow", "delete": "red", "replace": "magenta"}
STATUS_STYLE = {"planned": "dim", "running": "cyan", "done": "green", "failed": "bold red"}
# What the engine calls its changes in a summary, in the words of a preview and of an update.
CHANGE_WORDS = {
    "create": ("to create", "created"),
    "update": ("to update", "updated"),
    "replace": ("to replace", "replaced"),
    "delete": ("to delete", "deleted"),
    "same": ("unchanged", "unchanged"),
}


def hidden(event: InfraEvent) -> bool:
    """The stack itself, provider plugins and unchanged resources are counted, not listed."""
    return event.type == "pulumi:pulumi:Stack" or event.type.startswith("pulumi:providers:") or event.op == "same"


def summary_line(changes: Mapping[str, int], *, preview: bool) -> str:
    parts = [f"{changes[k]} {CHANGE_WORDS.get(k, (k, k))[0 if preview else 1]}" for k in CHANGE_WORDS if changes.get(k)]
    parts += [f"{n} {k}" for k, n in changes.items() if k not in CHANGE_WORDS and n]
    return "Resources: " + (", ".join(parts) if parts else "no changes")


@dataclass
class _Row:
    type: str
    name: str
    op: str
    status: str
    started: float
    ended: float | None = None


class ProgressView:
    """Call it with each InfraEvent; use it as a context manager around the operation."""

    def __init__(self, console: Console, title: str, *, preview: bool):
        self.console = console
        self.title = title
        self.preview = preview
        self.rows: dict[str, _Row] = {}
        self.changes: dict[str, int] | None = None
        self.failed: list[str] = []
        self._live: Live | None = None

    def __enter__(self) -> ProgressView:
        if self.console.is_terminal:
            self._live = Live(self._render(), console=self.console, refresh_per_second=8)
            self._live.start()
        else:
            self.console.print(self.title)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._live is not None:
            self._live.update(self._render())
            self._live.stop()
        if self.changes is not None:
            self.console.print(summary_line(self.changes, preview=self.preview))

    def __call__(self, event: InfraEvent) -> None:
        if event.kind == "summary":
            self.changes = dict(event.changes)
        elif event.kind == "diagnostic":
            if event.severity in ("error", "warning"):
                where = f"{event.name}: " if event.name else ""
                style = "red" if event.severity == "error" else "yellow"
                self.console.print(Text(f"{event.severity}: {where}{event.message}", style=style))
                if event.severity == "error":
                    self.failed.append(event.message)
        elif event.kind == "resource" and not hidden(event):
            row = self.rows.get(event.urn)
            now = time.monotonic()
            if row is None:
                row = self.rows[event.urn] = _Row(event.type, event.name, event.op, event.status, now)
            row.status = event.status
            if event.status in ("done", "failed"):
                row.ended = now
            if self._live is None and event.status in ("planned", "done", "failed"):
                self.console.print(self._line(row), highlight=False)
        if self._live is not None:
            self._live.update(self._render())

    def _line(self, row: _Row) -> str:
        took = f" {row.ended - row.started:.1f}s" if row.ended is not None and not self.preview else ""
        return f"  {OP_SYMBOL.get(row.op, row.op):>2} {row.type}  {row.name}  {row.op}  {row.status}{took}"

    def _render(self) -> Group:
        table = Table(box=None, pad_edge=False, show_header=True, header_style="bold")
        table.add_column("", width=2)
        table.add_column("type")
        table.add_column("name")
        table.add_column("op")
        table.add_column("status")
        table.add_column("time", justify="right")
        now = time.monotonic()
        for row in self.rows.values():
            elapsed = (row.ended or now) - row.started
            table.add_row(
                Text(OP_SYMBOL.get(row.op, "?"), style=OP_STYLE.get(row.op, "")),
                row.type,
                row.name,
                Text(row.op, style=OP_STYLE.get(row.op, "")),
                Text(row.status, style=STATUS_STYLE.get(row.status, "")),
                "" if self.preview else f"{elapsed:.0f}s",
            )
        return Group(Text(self.title, style="bold"), table)


class JsonLines:
    """The event stream as JSON lines on stdout, for scripts and the TUI."""

    def __init__(self, console: Console):
        self.console = console

    def __enter__(self) -> JsonLines:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def __call__(self, event: InfraEvent) -> None:
        self.console.out(json.dumps(event.to_dict()), highlight=False)
