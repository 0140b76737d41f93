"""Modal dialogs: the one confirm screen for destructive actions, prompts, the submit form, help."""

from __future__ import annotations

import shlex

from rich.console import Group
from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Grid, Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, Static

from tui import actions

MAX_LISTED = 15


class ConfirmScreen(ModalScreen[dict | None]):
    """Lists the targets of a destructive action; Enter confirms, Esc cancels. Drain asks why."""

    BINDINGS = actions.bindings("dialog", only=["dismiss"])

    def __init__(self, verb: str, noun: str, targets: list, need_reason: bool = False) -> None:
        super().__init__()
        self.verb = verb
        self.noun = noun
        self.targets = list(targets)
        self.need_reason = need_reason

    def compose(self) -> ComposeResult:
        n = len(self.targets)
        listed = [str(t) for t in self.targets[:MAX_LISTED]]
        if n > MAX_LISTED:
            listed.append(f"… and {n - MAX_LISTED} more")
        with Vertical(id="dialog", classes="confirm"):
            yield Label(Text(f"{self.verb.capitalize()} {n} {self.noun}{'s' if n != 1 else ''}?",
                             style="bold"), id="confirm-title")
            yield Static("\n".join(f"  • {t}" for t in listed), id="confirm-targets")
            if self.need_reason:
                yield Input(placeholder="reason (required)", id="reason")
            yield Label("", id="confirm-error")
            with Horizontal(classes="buttons"):
                yield Button(self.verb.capitalize(), variant="error", id="confirm")
                yield Button("Cancel", id="cancel")

    def on_mount(self) -> None:
        self.query_one("#reason" if self.need_reason else "#confirm").focus()

    def _confirm(self) -> None:
        result: dict = {}
        if self.need_reason:
            reason = self.query_one("#reason", Input).value.strip()
            if not reason:
                self.query_one("#confirm-error", Label).update(
                    Text("a reason is required: say why, e.g. 'XID 79 on GPU 3'", style="red"))
                return
            result["reason"] = reason
        self.dismiss(result)

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        self._confirm()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        event.stop()
        if event.button.id == "confirm":
            self._confirm()
        else:
            self.dismiss(None)


class PromptScreen(ModalScreen[str | None]):
    """Asks for one value (a new priority); Enter applies, Esc cancels."""

    BINDINGS = actions.bindings("dialog", only=["dismiss"])

    def __init__(self, title: str, placeholder: str = "", value: str = "",
                 integer: bool = False) -> None:
        super().__init__()
        self.title_text = title
        self.placeholder = placeholder
        self.value = value
        self.integer = integer

    def compose(self) -> ComposeResult:
        with Vertical(id="dialog"):
            yield Label(Text(self.title_text, style="bold"))
            yield Input(self.value, placeholder=self.placeholder, id="prompt",
                        type="integer" if self.integer else "text")
            yield Label("", id="prompt-error")

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        value = event.value.strip()
        if not value:
            self.query_one("#prompt-error", Label).update(Text("a value is required", style="red"))
            return
        self.dismiss(value)


SUBMIT_FIELDS = [
    # (id, label, placeholder, integer)
    ("command", "command", "python train.py --epochs 3", False),
    ("name", "name", "job name", False),
    ("queue", "queue", "default", False),
    ("gpus", "GPUs per node", "1", True),
    ("nodes", "nodes", "1", True),
    ("cpus", "CPUs", "4", True),
    ("mem", "memory", "16G", False),
    ("time_limit", "time limit", "1:00:00", False),
    ("priority", "priority", "", True),
]


def spec_from_form(values: dict[str, str]) -> dict:
    """The POST /v1/jobs body from the submit form's fields; empty fields are left out."""
    spec: dict = {}
    for field_id, _, _, integer in SUBMIT_FIELDS:
        value = values.get(field_id, "").strip()
        if not value:
            continue
        if field_id == "command":
            spec["command"] = shlex.split(value)
        elif integer:
            spec[field_id] = int(value)
        else:
            spec[field_id] = value
    return spec


class SubmitScreen(ModalScreen[dict | None]):
    """The submit form: a command and the resources it needs; ctrl+s or Submit sends it."""

    BINDINGS = actions.bindings("dialog")

    def compose(self) -> ComposeResult:
        with Vertical(id="dialog", classes="submit"):
            yield Label(Text("Submit a job", style="bold"))
            with Grid(id="submit-grid"):
                for field_id, label, placeholder, integer in SUBMIT_FIELDS:
                    yield Label(label)
                    yield Input(placeholder=placeholder, id=f"f-{field_id}",
                                type="integer" if integer else "text")
            yield Label("", id="submit-error")
            with Horizontal(classes="buttons"):
                yield Button("Submit", variant="primary", id="submit")
                yield Button("Cancel", id="cancel")

    def action_send(self) -> None:
        values = {f: self.query_one(f"#f-{f}", Input).value for f, *_ in SUBMIT_FIELDS}
        error = self.query_one("#submit-error", Label)
        try:
            spec = spec_from_form(values)
        except ValueError as exc:
            error.update(Text(f"cannot read the form: {exc}", style="red"))
            return
        if not spec.get("command"):
            error.update(Text("a command is required, e.g. python train.py", style="red"))
            return
        self.dismiss(spec)

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        self.action_send()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        event.stop()
        if event.button.id == "submit":
            self.action_send()
        else:
            self.dismiss(None)


def keys_table(readonly: bool = False) -> Table:
    """Every key of the action registry, by where it applies, in two columns."""
    sections = actions.help_sections(readonly)
    half = sum(len(rows) + 1 for _, rows in sections) / 2
    columns: list[list[Table]] = [[]]
    size = 0
    for section, keys in sections:
        size += len(keys) + 1
        if size > half and len(columns) == 1 and columns[0]:
            columns.append([])
        table = Table(show_header=False, box=None, padding=(0, 1), expand=True, title=section,
                      title_style="bold underline", title_justify="left")
        table.add_column(style="bold cyan", no_wrap=True, width=11)
        table.add_column(ratio=1)
        for key, what in keys:
            table.add_row(Text(key), Text(what))
        columns[-1].append(table)
    grid = Table.grid(padding=(0, 3), expand=True)
    for _ in columns:
        grid.add_column(ratio=1)
    grid.add_row(*(Group(*tables) for tables in columns))
    return grid


class HelpScreen(ModalScreen[None]):
    BINDINGS = actions.bindings("help")

    def __init__(self, readonly: bool = False) -> None:
        super().__init__()
        self.readonly = readonly

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="dialog", classes="help"):
            yield Static(keys_table(self.readonly))
            yield Label(Text("verbs act on the marked rows, else the row under the cursor; "
                             "capitals are destructive; --readonly hides every verb", style="dim"))

    def action_close(self) -> None:
        self.dismiss(None)
