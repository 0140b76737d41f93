"""The bottom line for `:` commands (with completion) and `/` filters, k9s-style."""

from __future__ import annotations

from textual.message import Message
from textual.suggester import SuggestFromList
from textual.widgets import Input

from tui import actions

VIEWS = list(actions.VIEWS)
ALIASES = {"no": "nodes", "node": "nodes", "n": "nodes", "jo": "jobs", "job": "jobs", "j": "jobs",
           "qu": "queues", "queue": "queues", "ev": "events", "event": "events", "e": "events"}
COMMANDS = [*VIEWS, "quit", "help", "submit"]


def resolve_command(text: str) -> tuple[str, str]:
    """`:jo` → ('view', 'jobs'); `:job 12` → ('job', '12'); `:node gpu-01` → ('node', ...);
    `:q` → ('quit', ''); anything else → ('unknown', text)."""
    word, _, arg = text.strip().lstrip(":").partition(" ")
    word, arg = word.lower(), arg.strip()
    if word in ("job", "node") and arg:
        return word, arg
    if word in VIEWS:
        return "view", word
    if word in ALIASES:
        return "view", ALIASES[word]
    if word in ("q", "quit", "q!", "exit"):
        return "quit", ""
    if word in ("help", "?"):
        return "help", ""
    if word == "submit":
        return "submit", ""
    matches = [v for v in VIEWS if v.startswith(word)] if word else []
    if len(matches) == 1:
        return "view", matches[0]
    return "unknown", text.strip()


class CommandBar(Input):
    """Hidden until `:` or `/`; Tab accepts the completion, Enter runs, Esc leaves."""

    BINDINGS = actions.bindings("bar")

    class Command(Message):
        def __init__(self, mode: str, text: str) -> None:
            super().__init__()
            self.mode = mode
            self.text = text

    class Left(Message):
        def __init__(self, mode: str) -> None:
            super().__init__()
            self.mode = mode

    def __init__(self) -> None:
        super().__init__(id="command-bar", suggester=SuggestFromList(COMMANDS, case_sensitive=False))
        self.mode = ":"
        self._opened_with: str | None = None

    def open(self, mode: str, value: str = "") -> None:
        self.mode = mode
        self.placeholder = ("view: nodes jobs queues events (tab completes)" if mode == ":"
                            else "filter: words, !exclude, state:/user:/queue: (enter keeps)")
        self.border_title = mode
        self.value = value
        self._opened_with = value
        self.display = True
        self.focus()
        self.cursor_position = len(value)

    def on_input_changed(self, event: Input.Changed) -> None:
        # In a real terminal the key that opened the bar can arrive here too (`:` typed into
        # the bar): drop it once, so `:jo` completes as `jo` does.
        opened_with, self._opened_with = self._opened_with, None
        if opened_with is not None and event.value == opened_with + self.mode:
            event.stop()
            self.value = opened_with
            self.cursor_position = len(opened_with)

    def action_complete(self) -> None:
        if self._suggestion:
            self.value = self._suggestion
            self.cursor_position = len(self.value)

    def action_leave(self) -> None:
        self.display = False
        self.post_message(self.Left(self.mode))

    async def action_submit(self) -> None:
        self.display = False
        self.post_message(self.Command(self.mode, self.value))
