"""Typed messages: what workers fetched, and what widgets ask of the app; handlers act on them."""

from __future__ import annotations

from typing import Any

from textual.message import Message


class Fetched(Message):
    """A data source answered: `source` is cluster, nodes, jobs, queues, events or me."""

    def __init__(self, source: str, data: Any, at: float, took: float = 0.0) -> None:
        super().__init__()
        self.source = source
        self.data = data
        self.at = at
        self.took = took  # seconds the fetch took (the request and its decoding)


class FetchFailed(Message):
    """A data source did not answer; the last good data stays on screen, marked stale."""

    def __init__(self, source: str, error: str) -> None:
        super().__init__()
        self.source = source
        self.error = error


class StreamEvent(Message):
    """One event arrived on the daemon's server-sent event stream."""

    def __init__(self, event: dict) -> None:
        super().__init__()
        self.event = event


class StreamState(Message):
    """The event stream connected (True) or dropped (False)."""

    def __init__(self, connected: bool, error: str = "") -> None:
        super().__init__()
        self.connected = connected
        self.error = error


class ActionDone(Message):
    """An action (cancel, drain, ...) finished for all its targets; `failures` maps target to the
    daemon's message for the ones it refused."""

    def __init__(self, verb: str, done: list[Any], failures: dict[Any, str]) -> None:
        super().__init__()
        self.verb = verb
        self.done = done
        self.failures = failures


# -- what widgets and screens ask of the app (they never call it) ---------------------------


class ActionRequested(Message):
    """A verb from the registry (cancel, drain, submit, ...) on these targets: the marked rows,
    else the row under the cursor, else the screen's own job or node."""

    def __init__(self, action: str, targets: list[Any]) -> None:
        super().__init__()
        self.action = action
        self.targets = targets


class OpenNode(Message):
    """Drill down to a node's GPUs."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name


class OpenJob(Message):
    """Drill down to a job: spec, allocation, events, log."""

    def __init__(self, job_id: int) -> None:
        super().__init__()
        self.job_id = job_id


class ShowJobs(Message):
    """Switch to the jobs view with this filter (a queue's or a team's jobs)."""

    def __init__(self, query: str) -> None:
        super().__init__()
        self.query = query


class FilterChanged(Message):
    """A view's filter or scope changed: show it again, and ask the daemon if its query did."""

    def __init__(self, view: Any) -> None:
        super().__init__()
        self.view = view
