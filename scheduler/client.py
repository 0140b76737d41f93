"""The HTTP client of the daemon's API, shared by the CLI and the TUI."""

from __future__ import annotations

import json
import os
import tomllib
from collections.abc import Iterator
from typing import Any

import httpx

from .config import client_config_path


class ApiError(Exception):
    """The daemon refused the request; `detail` is its message for people."""

    def __init__(self, status: int, detail: str):
        super().__init__(detail)
        self.status = status
        self.detail = detail


class Unreachable(Exception):
    """The daemon could not be reached."""


class NotConfigured(Exception):
    """No daemon URL or token is configured."""


def load_settings() -> tuple[str, str]:
    url = os.environ.get("TRAINYARD_URL", "")
    token = os.environ.get("TRAINYARD_TOKEN", "")
    if url and token:
        return url, token
    path = client_config_path()
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        data = {}
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise NotConfigured(f"cannot read {path}: {e}") from None
    url = url or data.get("url", "")
    token = token or data.get("token", "")
    if not url or not token:
        raise NotConfigured(
            f"no daemon configured: set TRAINYARD_URL and TRAINYARD_TOKEN, or start `trainyard daemon` "
            f"once on this machine (it writes {path})"
        )
    return url, token


class Client:
    def __init__(self, url: str, token: str, timeout: float = 10.0):
        self.url = url.rstrip("/")
        self._http = httpx.Client(
            base_url=self.url, timeout=timeout,
            headers={"Authorization": f"Bearer {token}", "User-Agent": "trainyard-client"},
        )

    @classmethod
    def from_env(cls, timeout: float = 10.0) -> Client:
        return cls(*load_settings(), timeout=timeout)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _call(self, method: str, path: str, **kw) -> Any:
        try:
            r = self._http.request(method, path, **kw)
        except httpx.TransportError as e:
            raise Unreachable(f"cannot reach the daemon at {self.url}: {e or type(e).__name__}") from None
        if r.status_code >= 400:
            try:
                detail = r.json().get("detail", r.text)
            except ValueError:
                detail = r.text or r.reason_phrase
            if not isinstance(detail, str):
                detail = json.dumps(detail)
            raise ApiError(r.status_code, detail)
        return r.json()

    # identity and cluster
    def me(self) -> dict:
        return self._call("GET", "/v1/me")

    def cluster(self) -> dict:
        return self._call("GET", "/v1/cluster")

    # jobs
    def jobs(self, all: bool = False, state: str | None = None, user: str | None = None,
             queue: str | None = None, limit: int | None = None) -> list[dict]:
        params: dict[str, Any] = {"all": all}
        for k, v in (("state", state), ("user", user), ("queue", queue), ("limit", limit)):
            if v is not None:
                params[k] = v
        return self._call("GET", "/v1/jobs", params=params)

    def job(self, job_id: int) -> dict:
        return self._call("GET", f"/v1/jobs/{job_id}")

    def submit(self, spec: dict) -> dict:
        return self._call("POST", "/v1/jobs", json=spec)

    def _action(self, job_id: int, action: str) -> dict:
        return self._call("POST", f"/v1/jobs/{job_id}/{action}")

    def cancel(self, job_id: int) -> dict:
        return self._action(job_id, "cancel")

    def hold(self, job_id: int) -> dict:
        return self._action(job_id, "hold")

    def release(self, job_id: int) -> dict:
        return self._action(job_id, "release")

    def requeue(self, job_id: int) -> dict:
        return self._action(job_id, "requeue")

    def set_priority(self, job_id: int, priority: int) -> dict:
        return self._call("PATCH", f"/v1/jobs/{job_id}", json={"priority": priority})

    def log_page(self, job_id: int, offset: int = 0, rank: int = 0, limit: int = 65536) -> dict:
        """{"data", "next", "state", "node"}: the job's output from `offset`, read from its node."""
        return self._call("GET", f"/v1/jobs/{job_id}/log", params={"offset": offset, "rank": rank, "limit": limit})

    def log(self, job_id: int, offset: int = 0, rank: int = 0) -> tuple[str, int]:
        r = self.log_page(job_id, offset, rank)
        return r["data"], r["next"]

    # nodes
    def nodes(self) -> list[dict]:
        return self._call("GET", "/v1/nodes")

    def node(self, name: str) -> dict:
        return self._call("GET", f"/v1/nodes/{name}")

    def add_node(self, spec: dict) -> dict:
        return self._call("POST", "/v1/nodes", json=spec, timeout=60)

    def import_nodes(self, inventory: list[dict]) -> list[dict]:
        return self._call("POST", "/v1/nodes/import", json=inventory, timeout=600)

    def drain_node(self, name: str, reason: str) -> dict:
        return self._call("POST", f"/v1/nodes/{name}/drain", json={"reason": reason})

    def resume_node(self, name: str) -> dict:
        return self._call("POST", f"/v1/nodes/{name}/resume")

    def remove_node(self, name: str, force: bool = False) -> dict:
        return self._call("DELETE", f"/v1/nodes/{name}", params={"force": force})

    def fault_node(self, name: str, gpu: int, kind: str, value=None) -> dict:
        return self._call("POST", f"/v1/nodes/{name}/fault", json={"gpu": gpu, "kind": kind, "value": value})

    def node_bootstrap(self, name: str, phase: str, detail: str = "") -> dict:
        return self._call("POST", f"/v1/nodes/{name}/bootstrap", json={"phase": phase, "detail": detail})

    # queues, tokens, events
    def queues(self) -> list[dict]:
        return self._call("GET", "/v1/queues")

    def teams(self) -> list[dict]:
        return self._call("GET", "/v1/teams")

    def create_token(self, user: str, role: str) -> dict:
        return self._call("POST", "/v1/tokens", json={"user": user, "role": role})

    def tokens(self) -> list[dict]:
        return self._call("GET", "/v1/tokens")

    def revoke_token(self, token_id: int) -> dict:
        return self._call("DELETE", f"/v1/tokens/{token_id}")

    def events(self, since: int = 0, limit: int = 200) -> list[dict]:
        return self._call("GET", "/v1/events", params={"since": since, "limit": limit})

    def stream_events(self, since: int = 0) -> Iterator[dict]:
        """Server-sent events from /v1/events, as dicts; blocks; ends when the daemon goes."""
        headers = {"Accept": "text/event-stream"}
        try:
            with self._http.stream("GET", "/v1/events", params={"since": since}, headers=headers,
                                   timeout=httpx.Timeout(10.0, read=60.0)) as r:
                if r.status_code >= 400:
                    r.read()
                    raise ApiError(r.status_code, r.json().get("detail", r.text))
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        yield json.loads(line[6:])
        except httpx.TransportError as e:
            raise Unreachable(f"event stream from {self.url} ended: {e or type(e).__name__}") from None
