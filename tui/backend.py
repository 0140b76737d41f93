"""The TUI's view of the daemon: a protocol, and the real backend over the shared HTTP client."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol


class BackendError(Exception):
    """The daemon refused a request; `detail` is its message for people."""

    def __init__(self, detail: str, status: int = 400):
        super().__init__(detail)
        self.detail = detail
        self.status = status


class BackendUnreachable(Exception):
    """The daemon could not be reached."""


class Backend(Protocol):
    """Everything the TUI asks of the daemon. Calls block; the app runs them in worker threads."""

    url: str

    def me(self) -> dict: ...
    def cluster(self) -> dict: ...
    def nodes(self) -> list[dict]: ...
    def node(self, name: str) -> dict: ...
    def jobs(self, all: bool = False, state: str | None = None, user: str | None = None,
             queue: str | None = None, limit: int | None = None) -> list[dict]: ...
    def job(self, job_id: int) -> dict: ...
    def queues(self) -> list[dict]: ...
    def teams(self) -> list[dict]: ...
    def events(self, since: int = 0, limit: int = 200) -> list[dict]: ...
    def stream_events(self, since: int = 0) -> Iterator[dict]: ...
    def log(self, job_id: int, offset: int = 0) -> tuple[str, int]: ...
    def submit(self, spec: dict) -> dict: ...
    def cancel(self, job_id: int) -> dict: ...
    def hold(self, job_id: int) -> dict: ...
    def release(self, job_id: int) -> dict: ...
    def requeue(self, job_id: int) -> dict: ...
    def set_priority(self, job_id: int, priority: int) -> dict: ...
    def drain_node(self, name: str, reason: str) -> dict: ...
    def resume_node(self, name: str) -> dict: ...
    def close(self) -> None: ...


class HttpBackend:
    """The real backend: the shared `scheduler.client.Client`, with its errors translated."""

    def __init__(self, url: str, token: str, timeout: float = 10.0):
        from scheduler import client as client_mod

        self._mod = client_mod
        # a read refused for the user's share of the daemon's reads (429) comes back at once, as
        # an error the view shows: the fetch is re-armed with a back-off instead of a worker
        # sleeping through Retry-After (it would hold the TUI's exit)
        self.client = client_mod.Client(url, token, timeout=timeout, throttle_wait_s=0)
        self.url = url

    def _call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        try:
            return getattr(self.client, name)(*args, **kwargs)
        except self._mod.ApiError as exc:
            raise BackendError(str(getattr(exc, "detail", exc)), getattr(exc, "status", 400)) from exc
        except self._mod.Unreachable as exc:
            raise BackendUnreachable(str(exc) or f"cannot reach {self.url}") from exc

    def me(self) -> dict:
        return self._call("me")

    def cluster(self) -> dict:
        return self._call("cluster")

    def nodes(self) -> list[dict]:
        return self._call("nodes")

    def node(self, name: str) -> dict:
        return self._call("node", name)

    def jobs(self, all=False, state=None, user=None, queue=None, limit=None) -> list[dict]:
        return self._call("jobs", all=all, state=state, user=user, queue=queue, limit=limit)

    def job(self, job_id: int) -> dict:
        return self._call("job", job_id)

    def queues(self) -> list[dict]:
        return self._call("queues")

    def teams(self) -> list[dict]:
        """Per team: quota, cohort, fair-share shares and decayed usage, GPUs in use, jobs."""
        return self._call("teams")

    def events(self, since: int = 0, limit: int = 200) -> list[dict]:
        # the TUI's 0 means "nothing seen yet": start from the newest, not the start of the trail
        return self._call("events", since=since or None, limit=limit)

    def stream_events(self, since: int = 0) -> Iterator[dict]:
        try:
            yield from self.client.stream_events(since=since or None)
        except self._mod.ApiError as exc:
            raise BackendError(str(getattr(exc, "detail", exc)), getattr(exc, "status", 400)) from exc
        except self._mod.Unreachable as exc:
            raise BackendUnreachable(str(exc) or f"cannot reach {self.url}") from exc

    def log(self, job_id: int, offset: int = 0) -> tuple[str, int]:
        return self._call("log", job_id, offset=offset)

    def submit(self, spec: dict) -> dict:
        return self._call("submit", spec)

    def cancel(self, job_id: int) -> dict:
        return self._call("cancel", job_id)

    def hold(self, job_id: int) -> dict:
        return self._call("hold", job_id)

    def release(self, job_id: int) -> dict:
        return self._call("release", job_id)

    def requeue(self, job_id: int) -> dict:
        return self._call("requeue", job_id)

    def set_priority(self, job_id: int, priority: int) -> dict:
        return self._call("set_priority", job_id, priority)

    def drain_node(self, name: str, reason: str) -> dict:
        return self._call("drain_node", name, reason)

    def resume_node(self, name: str) -> dict:
        return self._call("resume_node", name)

    def close(self) -> None:
        close = getattr(self.client, "close", None)
        if close:
            close()
