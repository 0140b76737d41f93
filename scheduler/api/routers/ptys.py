"""/v1/jobs/{id}/pty: a terminal in a running job over a WebSocket (`srun --pty`, `salloc`).

Binary frames carry the terminal's bytes both ways; text frames carry JSON control messages:
`{"resize": [rows, cols]}` from the client, `{"exit": rc, "reason": "..."}` from the daemon just
before it closes. A refused open answers plain HTTP (401, 403, 404, 409, 422, 501, 503) with the
error model's `{"detail": ...}`, so clients tell why without speaking WebSocket.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Annotated

from fastapi import APIRouter, Path, Query, WebSocket, WebSocketDisconnect
from fastapi.exceptions import WebSocketRequestValidationError
from fastapi.responses import JSONResponse

from ...daemon.errors import DomainError
from ...daemon.ptys import PtyExit, PtySession
from ..errors import STATUS, field_message
from ..schemas import MAX_ID

router = APIRouter(tags=["jobs"])
Size = Annotated[int, Query(ge=1, le=4096)]


def _status(e: DomainError) -> int:
    return 501 if e.kind == "not_implemented" else STATUS.get(e.kind, 409)


@router.websocket("/v1/jobs/{job_id}/pty")
async def job_pty(ws: WebSocket, job_id: Annotated[int, Path(ge=1, le=MAX_ID)],
                  rank: Annotated[int, Query(ge=0, le=4096)] = 0, rows: Size = 24, cols: Size = 80,
                  argv: Annotated[list[Annotated[str, Query(max_length=4096)]] | None,
                                  Query(max_length=256)] = None,
                  term: Annotated[str, Query(max_length=64, pattern=r"^[A-Za-z0-9._+-]*$")] = "",
                  cwd: Annotated[str, Query(max_length=4096, pattern=r"^(/[^\x00]*)?$")] = ""):
    """Open a terminal running `argv` (default: the owner's shell) in rank `rank` of a RUNNING
    job, as the job's owner with its environment, starting in `cwd` where the node has it (else
    the job's directory); the job's owner or an operator (audited)."""
    d = ws.app.state.daemon
    peer = ws.client.host if ws.client else ""
    scheme, _, token = ws.headers.get("authorization", "").partition(" ")
    who = d.tokens.authenticate(token.strip(), peer) if scheme.lower() == "bearer" and token.strip() \
        else None
    if who is None:
        await _deny(ws, 401, "missing or invalid bearer token: set TRAINYARD_TOKEN or run "
                             "`trainyard token create`")
        return
    try:
        session = await d.ptys.open(who, job_id, rank, argv, rows, cols, term, cwd)
    except DomainError as e:
        status = _status(e)
        if status == 403:
            with contextlib.suppress(Exception):  # auditing never turns a refusal into an error
                d.store.audit(who.user, "api.refused", ws.url.path[:200],
                              {"status": 403, "method": "GET", "why": str(e)[:300]}, peer)
        await _deny(ws, status, str(e), e.field)
        return
    try:
        await ws.accept()
        await _relay(ws, session)
    finally:
        session.close()


async def refuse_invalid(ws: WebSocket, exc: WebSocketRequestValidationError) -> None:
    """A WebSocket open with bad parameters answers 422 naming them, as every route does."""
    errors = list(exc.errors())
    await _deny(ws, 422, "; ".join(field_message(e) for e in errors),
                next((str(e["loc"][-1]) for e in errors if e.get("loc")), None))


async def _deny(ws: WebSocket, status: int, detail: str, field: str | None = None) -> None:
    await ws.send_denial_response(JSONResponse({"detail": detail, "field": field}, status_code=status))


async def _relay(ws: WebSocket, session: PtySession) -> None:
    """Copy both ways until the terminal ends (then tell how) or the client goes away."""

    async def to_client() -> None:
        while True:
            item = await session.next()
            if isinstance(item, PtyExit):
                await ws.send_text(json.dumps({"exit": item.rc, "reason": item.reason}))
                await ws.close()
                return
            await ws.send_bytes(item.data)
            session.delivered(item.offset)

    async def from_client() -> None:
        while True:
            msg = await ws.receive()
            if msg["type"] == "websocket.disconnect":
                return
            if msg.get("bytes"):
                session.write(msg["bytes"])
            elif msg.get("text"):
                try:
                    rows, cols = json.loads(msg["text"])["resize"]
                    session.resize(max(1, min(int(rows), 4096)), max(1, min(int(cols), 4096)))
                except (ValueError, KeyError, TypeError):
                    await ws.send_text(json.dumps({"error": "control messages are "
                                                   "{\"resize\": [rows, cols]}"}))

    tasks = [asyncio.create_task(to_client()), asyncio.create_task(from_client())]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, WebSocketDisconnect, RuntimeError, Exception):
                await t
