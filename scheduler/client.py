"""The HTTP client of the daemon's API, shared by the CLI and the TUI."""

from __future__ import annotations

import json
import os
import time
import tomllib
from collections.abc import Iterator
from typing import Any

import httpx

from .config import client_config_path

BULK_MAX = 10_000  # jobs per call of POST /v1/jobs/actions/<action> (the API's limit)
IDS_MAX = 1000  # ids per GET /v1/jobs?ids= or /v1/accounting/jobs?ids= (the API's limit)


def id_pages(ids) -> Iterator[str]:
    """`ids` as the `ids` parameters of GET /v1/jobs and /v1/accounting/jobs: comma-separated,
    at most IDS_MAX in each."""
    ids = list(ids)
    for first in range(0, len(ids), IDS_MAX):
        yield ",".join(map(str, ids[first:first + IDS_MAX]))


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


class BadSettings(NotConfigured):
    """A client setting is there but malformed (a URL that is not one, a token with spaces)."""


def load_settings() -> tuple[str, str]:
    """The daemon's URL and a token: TRAINYARD_URL and TRAINYARD_TOKEN, else client.toml."""
    url = os.environ.get("TRAINYARD_URL", "")
    token = os.environ.get("TRAINYARD_TOKEN", "")
    url_source, token_source = "TRAINYARD_URL", "TRAINYARD_TOKEN"
    if not (url and token):
        path = client_config_path()
        try:
            data = tomllib.loads(path.read_text())
        except FileNotFoundError:
            data = {}
        except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
            raise BadSettings(f"cannot read {path}: {e}") from None
        if not url:
            url, url_source = data.get("url", ""), f"{path}: url"
        if not token:
            token, token_source = data.get("token", ""), f"{path}: token"
        if not url or not token:
            raise NotConfigured(
                f"no daemon configured: set TRAINYARD_URL and TRAINYARD_TOKEN, or start `trainyard daemon` "
                f"once on this machine (it writes {path})"
            )
    for one in split_urls(url) if isinstance(url, str) else [url]:
        check_url(one, url_source)
    check_token(token, token_source)
    return url, token


def split_urls(url: str) -> list[str]:
    """A daemon URL, or several separated by commas: a leader and its standbys, in any order."""
    return [u.strip() for u in str(url).split(",") if u.strip()] or [str(url)]


def check_url(url: object, source: str = "daemon URL") -> None:
    """Refuse, in one line naming `source`, a daemon URL that httpx could not use."""
    example = "e.g. http://127.0.0.1:8471"
    if not isinstance(url, str):
        raise BadSettings(f"{source} = {url!r}: expected a URL as text, {example}")
    try:
        parsed = httpx.URL(url)
        port = parsed.port
        if parsed.host and ":" not in parsed.host:  # a name, not an IPv6 address
            parsed.host.encode("idna")  # what the resolver will need; fails as it would
    except (httpx.InvalidURL, ValueError) as e:
        raise BadSettings(f"{source} = {url!r} is not a valid URL ({e}); {example}") from None
    if parsed.scheme not in ("http", "https"):
        raise BadSettings(f"{source} = {url!r}: expected an http:// or https:// URL, {example}")
    if not parsed.host:
        raise BadSettings(f"{source} = {url!r} names no host; {example}")
    if port is not None and not 0 < port < 65536:
        raise BadSettings(f"{source} = {url!r}: port {port} is out of range; {example}")


def check_token(token: object, source: str = "token") -> None:
    """Tokens are printable ASCII without spaces (they travel in an HTTP header)."""
    if not isinstance(token, str) or not token.isascii() or not token.isprintable() or " " in token:
        # never echo a secret, not even a malformed one
        raise BadSettings(f"{source} is not a token: expected printable ASCII without spaces, "
                          "as `trainyard token create` prints it")


def _retry_after(r: httpx.Response) -> float | None:
    """The seconds a 429's Retry-After asks for (the daemon sends whole seconds), or None."""
    try:
        wait = float(r.headers.get("retry-after", ""))
    except ValueError:
        return None
    return wait if 0 <= wait <= 3600 else None


class Client:
    """The API client. Given several daemon URLs it follows the leader: a standby's 503
    (Retry-After) or a daemon that does not answer sends the call to the next URL, for up to
    `failover_s` seconds; a request that may have reached a daemon is retried only if it is a read.
    A read refused because its user has used their share of the daemon's reads (429) is asked
    again after the Retry-After the daemon gives, for up to `throttle_wait_s` seconds."""

    def __init__(self, url: str, token: str, timeout: float = 10.0, failover_s: float = 15.0,
                 throttle_wait_s: float = 60.0):
        self.urls = [u.rstrip("/") for u in split_urls(url)]
        for one in self.urls:
            check_url(one)
        check_token(token)
        self.url = self.urls[0]
        self.failover_s = failover_s
        self.throttle_wait_s = throttle_wait_s
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

    def _request(self, method: str, path: str, **kw) -> httpx.Response:
        """One call, following the leader across `self.urls` (see the class docstring)."""
        deadline = time.monotonic() + (self.failover_s if len(self.urls) > 1 else 0)
        patience = time.monotonic() + self.throttle_wait_s
        tried = 0
        while True:
            retry, error = False, None
            try:
                r = self._http.request(method, self.url + path, **kw)
                if r.status_code == 503 and "retry-after" in r.headers and len(self.urls) > 1:
                    retry, error = True, ApiError(r.status_code, error_detail(r))
                elif r.status_code == 429 and (wait := _retry_after(r)) is not None \
                        and time.monotonic() + wait <= patience:
                    time.sleep(wait)  # nothing was done: the same daemon is asked again
                    continue
                else:
                    return r
            except (httpx.ConnectError, httpx.ConnectTimeout) as e:  # never reached a daemon
                retry, error = True, Unreachable(f"cannot reach the daemon at {self.url}: {e or type(e).__name__}")
            except httpx.TransportError as e:
                retry = method == "GET"
                error = Unreachable(f"cannot reach the daemon at {self.url}: {e or type(e).__name__}")
            except httpx.HTTPError as e:  # a reply httpx could not decode, too many redirects
                raise ApiError(0, f"bad reply from {self.url}: {e or type(e).__name__}") from None
            if not retry or len(self.urls) == 1 or time.monotonic() > deadline:
                raise error
            tried += 1
            self.url = self.urls[tried % len(self.urls)]
            if tried % len(self.urls) == 0:
                time.sleep(0.25)  # every daemon said no: a takeover is under way

    def _call(self, method: str, path: str, **kw) -> Any:
        r = self._request(method, path, **kw)
        if r.status_code >= 400:
            raise ApiError(r.status_code, error_detail(r))
        try:
            return r.json()
        except ValueError:
            raise ApiError(r.status_code, f"the reply from {self.url}{path} is not JSON "
                           f"({_excerpt(r.text) or 'empty'}); is that trainyard's daemon?") from None

    # identity and cluster
    def me(self) -> dict:
        return self._call("GET", "/v1/me")

    def cluster(self) -> dict:
        return self._call("GET", "/v1/cluster")

    def diag(self, reset: bool = False) -> dict:
        """The daemon's own load (sdiag); with `reset`, its counts start again (operators)."""
        return self._call("POST", "/v1/diag/reset") if reset else self._call("GET", "/v1/diag")

    # jobs
    def jobs(self, all: bool = False, state: str | None = None, user: str | None = None,
             queue: str | None = None, limit: int | None = None, ids: str | None = None) -> list[dict]:
        """A page of jobs (at most `limit`, the daemon's default 5,000): live ones, or with `all`
        every one newest first; `ids`: those jobs and the tasks of those arrays (comma-separated)."""
        params: dict[str, Any] = {"all": all}
        for k, v in (("state", state), ("user", user), ("queue", queue), ("limit", limit), ("ids", ids)):
            if v is not None:
                params[k] = v
        return self._call("GET", "/v1/jobs", params=params)

    def job(self, job_id: int) -> dict:
        return self._call("GET", f"/v1/jobs/{job_id}")

    def submit(self, spec: dict) -> dict:
        return self._call("POST", "/v1/jobs", json=spec)

    def _action(self, job_id: int, action: str) -> dict:
        return self._call("POST", f"/v1/jobs/{job_id}/{action}")

    def act_many(self, action: str, ids) -> dict:
        """cancel, hold, release or requeue many jobs, a call per 10,000: {"done": [ids],
        "refused": [{"id", "status", "detail"}]} (each refused one as its own call would be)."""
        ids = list(ids)
        done, refused = [], []
        for i in range(0, len(ids), BULK_MAX):
            r = self._call("POST", f"/v1/jobs/actions/{action}", json={"ids": ids[i:i + BULK_MAX]})
            done += r["done"]
            refused += r["refused"]
        return {"done": done, "refused": refused}

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

    def log_page(self, job_id: int, offset: int = 0, rank: int = 0, limit: int = 65536,
                 attempt: int | None = None) -> dict:
        """{"data", "next", "state", "node", "attempt", ...}: the job's stored output from `offset`
        (the latest run, or run `attempt`)."""
        params: dict[str, Any] = {"offset": offset, "rank": rank, "limit": limit}
        if attempt is not None:
            params["attempt"] = attempt
        return self._call("GET", f"/v1/jobs/{job_id}/log", params=params)

    def log(self, job_id: int, offset: int = 0, rank: int = 0, attempt: int | None = None) -> tuple[str, int]:
        r = self.log_page(job_id, offset, rank, attempt=attempt)
        return r["data"], r["next"]

    # nodes
    def nodes(self) -> list[dict]:
        return self._call("GET", "/v1/nodes")

    def node(self, name: str) -> dict:
        return self._call("GET", f"/v1/nodes/{name}")

    def node_images(self, name: str) -> dict:
        return self._call("GET", f"/v1/nodes/{name}/images")

    def add_node(self, spec: dict) -> dict:
        return self._call("POST", "/v1/nodes", json=spec, timeout=60)

    def import_nodes(self, inventory: list[dict]) -> list[dict]:
        return self._call("POST", "/v1/nodes/import", json=inventory, timeout=600)

    def drain_node(self, name: str, reason: str) -> dict:
        return self._call("POST", f"/v1/nodes/{name}/drain", json={"reason": reason})

    def resume_node(self, name: str, force: bool = False) -> dict:
        return self._call("POST", f"/v1/nodes/{name}/resume", params={"force": "true"} if force else None)

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

    def events(self, since: int | None = None, limit: int = 200) -> list[dict]:
        """Events after `since` (0: from the start of the trail), or the newest `limit` when None."""
        params: dict[str, Any] = {"limit": limit}
        if since is not None:
            params["since"] = since
        return self._call("GET", "/v1/events", params=params)

    def stream_events(self, since: int | None = None) -> Iterator[dict]:
        """Server-sent events from /v1/events, as dicts; blocks; ends when the daemon goes."""
        headers = {"Accept": "text/event-stream"}
        try:
            params = {} if since is None else {"since": since}
            with self._http.stream("GET", "/v1/events", params=params, headers=headers,
                                   timeout=httpx.Timeout(10.0, read=60.0)) as r:
                if r.status_code >= 400:
                    r.read()
                    raise ApiError(r.status_code, error_detail(r))
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        yield json.loads(line[6:])
        except httpx.TransportError as e:
            raise Unreachable(f"event stream from {self.url} ended: {e or type(e).__name__}") from None


def error_detail(r: httpx.Response) -> str:
    """The daemon's refusal in one line: its `detail`, FastAPI's field errors as `field: why`,
    or, for a reply that is not the API's JSON (a proxy's page, a crash), the status."""
    try:
        body = r.json()
    except ValueError:
        body = None
    detail = body.get("detail") if isinstance(body, dict) else None
    if isinstance(detail, str) and detail:
        return _excerpt(detail)
    if isinstance(detail, list) and detail:
        parts = []
        for item in detail:
            if isinstance(item, dict):
                loc = [str(p) for p in item.get("loc", ()) if p not in ("body", "query", "path")]
                msg = str(item.get("msg", item))
                parts.append(f"{'.'.join(loc)}: {msg}" if loc else msg)
            else:
                parts.append(str(item))
        return _excerpt("; ".join(parts))
    status = f"the daemon answered {r.status_code} {r.reason_phrase}".rstrip()
    text = _excerpt(r.text if detail is None else json.dumps(detail))
    return f"{status}: {text}" if text and text != r.reason_phrase else status


def _excerpt(text: str, limit: int = 300) -> str:
    """One line of at most `limit` characters."""
    line = " ".join(text.split())
    return line if len(line) <= limit else line[: limit - 3] + "..."
