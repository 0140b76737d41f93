"""Helpers shared by the routers."""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse

from ...daemon.views import json_bytes


class Json(JSONResponse):
    """A response already in JSON: list endpoints return thousands of dicts, and FastAPI's
    jsonable_encoder would walk each of them in Python before json.dumps does the same.
    Rendered by orjson (GET /v1/nodes on 1,000 nodes is ~3 MB of telemetry); NaN and infinity
    become null, as JSON has no such numbers."""

    def render(self, content: Any) -> bytes:
        return json_bytes(content)
