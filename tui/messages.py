"""Typed messages: workers post these with what they fetched; only handlers touch widgets."""

from __future__ import annotations

from typing import Any

from textual.message import Message


class Fetched(Message):
    """A data source answered: `source` is cluster, nodes, jobs, queues, events or me."""

    def __init__(self, source: str, data: Any, at: float) -> None:
        super().__init__()
        self.source = source
        self.data = data
        self.at = at


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
