"""/v1/events: the audit trail, paged forward from any id, or streamed live (server-sent events)."""

from __future__ import annotations

import asyncio
import json
from typing import Annotated

from fastapi import APIRouter, Header, Query, Request
from fastapi.responses import StreamingResponse

from ..deps import DaemonDep, Who
from ..errors import responses
from ..schemas import MAX_ID, EventRead
from .common import AcceptEncoding, body_response

router = APIRouter(prefix="/v1", tags=["events"])
KEEPALIVE_S = 15
STREAM_CHUNK = 256  # events written to a stream at most in one send


def sse(ev: dict) -> str:
    return f"id: {ev['id']}\nevent: {ev['action']}\ndata: {json.dumps(ev, separators=(',', ':'))}\n\n"


def _last_event_id(value: str | None) -> int | None:
    """The SSE resume point; ids past the largest possible one simply have nothing after them."""
    if value is None or not value.strip():
        return None
    return min(int(value.strip()), MAX_ID)


@router.get("/events", response_model=list[EventRead],
            responses={**responses(429), 200: {"description": "events; with `stream` or Accept: text/event-stream, "
                                            "a server-sent event stream",
                                            "content": {"text/event-stream": {}}}})
async def events(request: Request, d: DaemonDep, who: Who,
                 since: Annotated[int | None, Query(ge=0, le=MAX_ID, description=
                                                    "events after this id (0: from the start); "
                                                    "omitted: the newest `limit`")] = None,
                 limit: Annotated[int, Query(ge=1, le=10000)] = 200, stream: bool = False,
                 last_event_id: Annotated[str, Header(pattern=r"^[0-9]{0,19}$",
                                                      description="resume a stream after this id")] = "",
                 accept_encoding: AcceptEncoding = None):
    wants_stream = stream or "text/event-stream" in request.headers.get("accept", "")
    resume = _last_event_id(last_event_id)
    if resume is not None:
        since = resume
    if not wants_stream:  # up to 10,000 events: never on the event loop (a long page in a reader process)
        return body_response(*await d.event_page(who, since, limit, accept_encoding))
    # subscribed before the backlog is read (off the loop: events are committed meanwhile), so
    # nothing committed during the read is missed; what is in both goes out once (by id)
    queue = d.store.subscribe()
    try:
        backlog = await d.read_off_loop(lambda: d.overview.events(since, limit), who)
    except BaseException:
        d.store.unsubscribe(queue)
        raise

    async def gen():
        seen = since or 0
        try:
            for i in range(0, len(backlog), STREAM_CHUNK):
                part = backlog[i:i + STREAM_CHUNK]
                seen = part[-1]["id"]
                yield "".join(sse(ev) for ev in part)
            while True:
                if queue.empty():
                    try:
                        first = await asyncio.wait_for(queue.get(), KEEPALIVE_S)
                    except TimeoutError:
                        yield ": keepalive\n\n"
                        continue
                else:
                    first = queue.get_nowait()
                # what else is queued goes out with it: a commit publishes its events together,
                # and one write for them costs one send to this client, not one each
                chunk, ev, ended = [], first, False
                while True:
                    if ev is None:
                        ended = True
                        break
                    if ev["id"] is None or ev["id"] > seen:
                        seen = ev["id"] or seen
                        chunk.append(sse(ev))
                    if queue.empty() or len(chunk) >= STREAM_CHUNK:
                        break
                    ev = queue.get_nowait()
                if chunk:
                    yield "".join(chunk)
                if ended:
                    return
        finally:
            d.store.unsubscribe(queue)

    return StreamingResponse(gen(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
