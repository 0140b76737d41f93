"""Modal dialogs: the one confirm screen for destructive actions, prompts, the submit form, help."""

from __future__ import annotations

import shlex

from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Grid, Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, Static

MAX_LISTED = 15


class ConfirmScreen(ModalScreen[dict | None]):
    """Lists the targets of a destructive action; Enter confirms, Esc cancels. Drain asks why."""

    BINDINGS = [Binding("escape", "dismiss_none", "Cancel")]

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

    def action_dismiss_none(self) -> None:
        self.dismiss(None)


class PromptScreen(ModalScreen[str | None]):
    """Asks for one value (a new priority); Enter applies, Esc cancels."""

    BINDINGS = [Binding("escape", "dismiss_none", "Cancel")]

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

    def action_dismiss_none(self) -> None:
        self.dismiss(None)


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

    BINDINGS = [
        Binding("escape", "dismiss_none", "Cancel"),
        Binding("ctrl+s", "submit", "Submit"),
    ]

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

    def action_submit(self) -> None:
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
        self.action_submit()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        event.stop()
        if event.button.id == "submit":
            self.action_submit()
        else:
            self.dismiss(None)

    def action_dismiss_none(self) -> None:
        self.dismiss(None)


KEYS = [
    ("everywhere", [
        (":", "switch view — :nodes :jobs :queues :events (Tab completes), :q quits"),
        ("/", "filter rows; key:value (state:, user:, queue:) filters on the daemon; !word excludes"),
        ("?", "this help"), ("esc", "back / clear filter and marks"),
        ("enter", "drill down: node → its GPUs; job → spec, allocation, events, log;"),
        ("", "queue or team → its jobs; event → its job or node; GPU → its job"),
        ("space", "mark row"), ("ctrl+a", "mark all visible rows (again: unmark)"),
        ("ctrl+p", "command palette: every action"), ("n", "submit a job (form)"),
        ("+ / -", "refresh slower / faster"), ("ctrl+r", "refresh now"), ("q", "quit"),
    ]),
    ("jobs", [
        ("C", "cancel (confirm)"), ("R", "requeue (confirm)"), ("h / r", "hold / release"),
        ("p", "change priority"), ("a", "show all jobs / only active ones"),
    ]),
    ("nodes", [("D", "drain with a reason (confirm)"), ("u", "resume")]),
    ("job", [("f", "follow / pause the log"), ("/", "search the log (esc clears)")]),
]


def keys_table() -> Table:
    table = Table(show_header=False, box=None, padding=(0, 2))
    table.add_column(style="bold cyan", no_wrap=True)
    table.add_column()
    for section, keys in KEYS:
        table.add_row(Text(section, style="bold underline"), "")
        for key, what in keys:
            table.add_row(key, what)
    return table


class HelpScreen(ModalScreen[None]):
    BINDINGS = [Binding("escape,question_mark,q", "dismiss_none", "Close")]

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="dialog", classes="help"):
            yield Static(keys_table())
            yield Label(Text("destructive verbs are capitals; --readonly hides every action",
                             style="dim"))

    def action_dismiss_none(self) -> None:
        self.dismiss(None)
