"""A lean HTTP/1.1 keep-alive client on asyncio streams, so the client costs little beside the daemon.

The benchmarks that drive thousands of requests a second share two cores with the daemon they
measure; httpx spends about a millisecond of CPU per request, which would be measured as the
daemon's. This client writes a request and reads one Content-Length response, nothing more.
"""

from __future__ import annotations

import asyncio
import json
import time
from urllib.parse import urlsplit


class Connection:
    """One keep-alive connection to the daemon's API, authenticated with a bearer token."""

    def __init__(self, url: str, token: str):
        u = urlsplit(url)
        self.host, self.port = u.hostname, u.port
        self.head = f"Host: {u.netloc}\r\nAuthorization: Bearer {token}\r\n"
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def open(self) -> Connection:
        self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        return self

    async def request(self, method: str, path: str, body: dict | None = None,
                      decode: bool = True, headers: dict[str, str] | None = None) -> tuple[int, object]:
        """(status, the decoded JSON body); with `decode=False` the body's bytes, so that a latency
        measured ends with the response's last byte and not with the client's own JSON parsing
        (stdlib json takes ~40 ms for the 3 MB node listing at 1,000 nodes). A response's body is
        returned as it came (a gzip one is not decompressed)."""
        data = json.dumps(body).encode() if body is not None else b""
        extra = f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n" if body is not None else ""
        extra += "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        raw = f"{method} {path} HTTP/1.1\r\n{self.head}{extra}\r\n".encode() + data
        self.writer.write(raw)
        status_line = await self.reader.readline()
        if not status_line and method == "GET":  # the server closed an idle keep-alive connection
            await self.close()
            await self.open()
            self.writer.write(raw)
            status_line = await self.reader.readline()
        status = int(status_line.split()[1])
        length = 0
        while (line := await self.reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.partition(b":")
            if name.lower() == b"content-length":
                length = int(value)
        payload = await self.reader.readexactly(length) if length else b""
        if not decode:
            return status, payload
        return status, json.loads(payload) if payload else None

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


async def submit_jobs(url: str, token: str, body: dict, count: int, lat: list[float] | None = None,
                      ids: list[int] | None = None) -> None:
    """POST `count` jobs of `body` one after another over one connection, each waiting for the
    answer to the one before; each answer's latency and job id into `lat` and `ids` when given.
    An answer other than 201 ends the benchmark, saying what it was."""
    c = await Connection(url, token).open()
    try:
        for _ in range(count):
            t0 = time.perf_counter()
            status, job = await c.request("POST", "/v1/jobs", body)
            if lat is not None:
                lat.append(time.perf_counter() - t0)
            if status != 201:
                raise SystemExit(f"submit answered {status}: {job}")
            if ids is not None:
                ids.append(job["id"])
    finally:
        await c.close()
