"""The one registry of the TUI's actions: keys, command palette and help all come from it."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from textual.binding import Binding

# Where an action applies. "main" is the app itself (every screen); "table" any keyed table;
# "nodes", "jobs", "queues", "events" the main views; "node" and "job" the drill-down screens;
# the rest are dialogs and the command bar.
SCOPES = {
    "main": "everywhere",
    "table": "tables",
    "jobs": "jobs",
    "nodes": "nodes",
    "node": "node (its GPUs)",
    "job": "job (spec, events, log)",
    "bar": "command bar (: and /)",
    "dialog": "confirm, prompt and submit form",
    "help": "this help",
}
ROLES = ("user", "operator", "admin")

# Textual key names as a person reads them (help screen); the footer uses Textual's own display.
KEY_NAMES = {"colon": ":", "slash": "/", "question_mark": "?", "plus": "+", "minus": "-",
             "escape": "esc", "enter": "enter", "space": "space", "tab": "tab"}


@dataclass(frozen=True)
class Action:
    """One thing a person can do: its keys, what it says, where it applies, what it needs."""

    id: str  # the Textual action (`action_<id>`), or the verb sent to the daemon
    title: str  # the footer's label
    help: str  # the help screen's line
    keys: str = ""  # Textual key names, comma-separated; "" when only the palette offers it
    where: tuple[str, ...] = ("main",)
    noun: str = ""  # "job" or "node": a verb on the marked rows, else the row under the cursor
    confirm: bool = False  # destructive: the confirm screen lists the targets first
    changes: bool = False  # changes the cluster: hidden and refused under --readonly
    role: str = "user"  # the least role the daemon accepts ("user": on their own jobs)
    done: str = ""  # what the notification says afterwards ("cancelled 4, 5")
    command: str = ""  # the palette's title, when it differs from `title`
    call: str = ""  # the Textual action string, when it differs from `id`
    footer: bool = True  # shown in the footer
    palette: bool = True  # offered by the command palette (ctrl+p)
    bound: bool = True  # False: the key belongs to a Textual widget (Enter selects a row)
    key_display: str | None = None

    @property
    def verb(self) -> bool:
        """Sent to the daemon through one path: readonly check, targets, confirm, then the call."""
        return self.changes

    @property
    def action(self) -> str:
        """The Textual action string a binding or the palette runs."""
        if self.verb:
            return f"request('{self.id}')"
        return self.call or self.id

    @property
    def palette_title(self) -> str:
        return self.command or (f"{self.title} {self.noun}s" if self.noun else self.title)

    @property
    def palette_help(self) -> str:
        key = f" ({keys_text(self.keys)})" if self.keys else ""
        extra = ", after a confirm" if self.confirm else ""
        need = f"; needs {self.role}" if self.role != "user" else ""
        return f"{self.help}{key}{extra}{need}"


def _verb(id: str, title: str, noun: str, keys: str, done: str, help: str, *,
          confirm: bool = False, role: str = "user", where: tuple[str, ...] = ()) -> Action:
    return Action(id, title, help, keys, where=where or (f"{noun}s", noun), noun=noun,
                  confirm=confirm, changes=True, role=role, done=done)


# In footer order within each scope: the focused table's keys, then the view's, then the app's.
ACTIONS: tuple[Action, ...] = (
    Action("mark", "Mark", "mark the row", "space", where=("table",), palette=False),
    Action("mark_all", "Mark all", "mark all visible rows (again: unmark)", "ctrl+a",
           where=("table",), palette=False),
    Action("select", "Open", "drill down: node → its GPUs, GPU → its job, job → spec, events, "
           "log; queue or team → its jobs; event → its job or node", "enter",
           where=("table",), bound=False, footer=False, palette=False),
    Action("back", "Back", "back (in a log search: clear it first)", "escape",
           where=("node", "job")),
    Action("follow", "Follow/pause", "follow / pause the log", "f",
           where=("job",)),
    Action("search", "Search log", "search the log (esc clears)", "slash", where=("job",)),
    _verb("cancel", "Cancel", "job", "C", "cancelled", "cancel", confirm=True),
    _verb("requeue", "Requeue", "job", "R", "requeued", "requeue", confirm=True),
    _verb("hold", "Hold", "job", "h", "held", "hold (pending jobs)"),
    _verb("release", "Release", "job", "r", "released", "release (held jobs)"),
    _verb("priority", "Priority", "job", "p", "reprioritised",
          "change priority (raising it needs an operator)"),
    Action("toggle_all", "All/active", "show all jobs / only active ones", "a", where=("jobs",),
           command="Jobs: all / active"),
    _verb("drain", "Drain", "node", "D", "drained", "drain with a reason", confirm=True,
          role="operator"),
    _verb("resume", "Resume", "node", "u", "resumed", "resume", role="operator"),
    Action("command", "View", "switch view: :nodes :jobs :queues :events (tab completes); "
           ":job ID, :node NAME; :q quits", "colon", key_display=":", palette=False),
    Action("filter", "Filter", "filter rows (survives refresh): all words match, !word "
           "excludes; state: user: queue: team: by key",
           "slash", key_display="/"),
    Action("help", "Help", "keys and views", "question_mark", key_display="?"),
    Action("clear", "Clear", "clear the filter, then the marks", "escape", footer=False,
           palette=False),
    Action("submit", "Submit", "submit a job (form)", "n", changes=True, done="submitted",
           command="Submit job"),
    Action("slower", "Slower refresh", "refresh less often", "plus", footer=False),
    Action("faster", "Faster refresh", "refresh more often", "minus", footer=False),
    Action("refresh_now", "Refresh", "fetch everything again", "ctrl+r", footer=False,
           command="Refresh now"),
    Action("command_palette", "Palette", "command palette: every action", "ctrl+p",
           bound=False, palette=False),
    Action("quit", "Quit", "quit", "q", palette=False),
    *(Action(f"view_{kind}", kind, f"switch to the {kind} view (:{kind})", call=f"view('{kind}')",
             command=f"View: {kind}", footer=False)
      for kind in ("nodes", "jobs", "queues", "events")),
    Action("complete", "Complete", "accept the completion", "tab", where=("bar",), footer=False,
           palette=False),
    Action("leave", "Leave", "leave (a filter is cleared)", "escape", where=("bar",),
           footer=False, palette=False),
    Action("send", "Submit", "send the submit form", "ctrl+s",
           where=("dialog",), palette=False),
    Action("dismiss", "Cancel", "close, doing nothing (enter confirms)", "escape",
           where=("dialog",), palette=False),
    Action("close", "Close", "close this help", "escape,question_mark,q", where=("help",),
           palette=False),
)
BY_ID = {a.id: a for a in ACTIONS}
VIEWS = ("nodes", "jobs", "queues", "events")


def keys_text(keys: str) -> str:
    """`escape,question_mark` → `esc / ?`."""
    return " / ".join(KEY_NAMES.get(k, k) for k in keys.split(",") if k)


def bindings(scope: str, only: Iterable[str] | None = None) -> list[Binding]:
    """The key bindings of one scope, in registry order (`only`: just these action ids)."""
    wanted = set(only) if only is not None else None
    return [Binding(a.keys, a.action, a.title, show=a.footer, key_display=a.key_display)
            for a in ACTIONS
            if scope in a.where and a.keys and a.bound and (wanted is None or a.id in wanted)]


def allowed(action: str, parameters: tuple[object, ...], readonly: bool) -> bool:
    """Whether a Textual action may run (and its key show): nothing that changes the cluster
    under --readonly. Used as `check_action` by the app, the views and the screens."""
    if not readonly:
        return True
    if action == "request" and parameters:
        spec = BY_ID.get(str(parameters[0]))
    else:
        spec = BY_ID.get(action)
    return not (spec is not None and spec.changes)


def palette(scopes: Iterable[str], readonly: bool) -> list[Action]:
    """What the command palette offers where `scopes` apply: everything there, every verb
    (on the views' marked rows when the screen has none of its own), and the views."""
    here = set(scopes)
    return [a for a in ACTIONS if a.palette and (here & set(a.where) or a.verb)
            and not (readonly and a.changes)]


def help_sections(readonly: bool = False) -> list[tuple[str, list[tuple[str, str]]]]:
    """(section title, [(keys, what)]) for the help screen; each action under its first scope."""
    rows: dict[str, list[tuple[str, str]]] = {scope: [] for scope in SCOPES}
    for a in ACTIONS:
        if not a.keys or (readonly and a.changes):
            continue
        extra = " (confirm)" if a.confirm else ""
        need = f" ({a.role})" if a.role != "user" else ""
        rows[a.where[0]].append((keys_text(a.keys), f"{a.help}{extra}{need}"))
    return [(SCOPES[scope], lines) for scope, lines in rows.items() if lines]
