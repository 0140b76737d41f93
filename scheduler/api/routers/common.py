"""Helpers shared by the routers."""

from __future__ import annotations

from fastapi.responses import JSONResponse


class Json(JSONResponse):
    """A response already in JSON: list endpoints return thousands of dicts, and FastAPI's
    jsonable_encoder would walk each of them in Python before json.dumps does the same."""
