"""Helpers shared by the routers."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import Header, Response
from fastapi.responses import JSONResponse

from ...daemon.views import json_bytes

# the client's Accept-Encoding, for the listings that may be sent compressed
AcceptEncoding = Annotated[str | None, Header(include_in_schema=False)]


class Json(JSONResponse):
    """A response already in JSON: list endpoints return thousands of dicts, and FastAPI's
    jsonable_encoder would walk each of them in Python before json.dumps does the same.
    Rendered by orjson (GET /v1/nodes on 1,000 nodes is ~3 MB of telemetry); NaN and infinity
    become null, as JSON has no such numbers."""

    def render(self, content: Any) -> bytes:
        return json_bytes(content)


def body_response(body: bytes, gzipped: bool) -> Response:
    """A listing's answer from its encoded body (`scheduler.daemon.views.encoded`)."""
    if gzipped:
        return Response(body, media_type="application/json",
                        headers={"Content-Encoding": "gzip", "Vary": "Accept-Encoding"})
    return Response(body, media_type="application/json", headers={"Vary": "Accept-Encoding"})
