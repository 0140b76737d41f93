"""One error model for every refusal, the map from domain errors to HTTP, and its OpenAPI entries."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..daemon import DomainError

STATUS = {"invalid": 422, "not_found": 404, "forbidden": 403, "conflict": 409, "unavailable": 503,
          "not_leader": 503, "refused": 409,
          "throttled": 429}


class ErrorBody(BaseModel):
    """Every error answer: one line for people, and the field it concerns when there is one."""

    detail: str = Field(description="what was wrong, with the value, and what to do instead")
    field: str | None = Field(default=None, description="the request field the error concerns")


_TEXT = {400: "Bad request", 401: "Missing or unknown bearer token", 403: "The role or ownership does not allow this",
         404: "No such job, node or token", 405: "Method not allowed", 409: "The target's state does not allow this",
         422: "A value cannot be used (the message names the field)",
         429: "The caller has used their share of the daemon's reads for now (Retry-After)",
         503: "A node cannot be reached now, or this daemon stands by (Retry-After; the detail names "
              "the leader)"}


def responses(*codes: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI entries for the error codes a route can answer (400, 401, 422 and 503 are on every
    route: a body that is not JSON, a missing or unknown token, a value that cannot be used, a
    standby daemon or an unreachable node)."""
    return {c: {"model": ErrorBody, "description": _TEXT[c]} for c in sorted({400, 401, 422, 503, *codes})}


def allowed_methods(app, scope) -> list[str]:
    """Every method served at this path (Starlette's own 405 names only the first route's): those
    of the most specific path that matches it (`/v1/nodes/import` is not `/v1/nodes/{name}`)."""
    from starlette.routing import Match

    by_path: dict[str, set[str]] = {}
    for route in app.router.routes:
        match, _ = route.matches({**scope, "method": "\x00"})
        if match == Match.PARTIAL and getattr(route, "methods", None):
            by_path.setdefault(route.path, set()).update(route.methods)
    if not by_path:
        return []
    methods = by_path[min(by_path, key=lambda path: path.count("{"))]
    if "GET" in methods:
        methods.add("HEAD")
    return sorted(methods)


def field_message(err: dict) -> str:
    loc = [str(x) for x in err.get("loc", ()) if x not in ("body", "query", "path", "header")]
    where = ".".join(loc)
    msg = str(err.get("msg", "invalid")).removeprefix("Value error, ")
    got = err.get("input")
    shown = ""
    if isinstance(got, str | int | float) and not isinstance(got, bool):
        text = repr(got)
        shown = f" (got {text[:80]}{'...' if len(text) > 80 else ''})"
    return f"{where}: {msg}{shown}" if where else f"{msg}{shown}"


def _first_field(errors: list[dict]) -> str | None:
    for e in errors:
        loc = [str(x) for x in e.get("loc", ()) if x not in ("body", "query", "path", "header")]
        if loc:
            return loc[0]
    return None


def install(app: FastAPI, on_refused) -> None:
    """Exception handlers: every refusal answers ErrorBody; 401/403 are audited by on_refused."""

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        errors = list(exc.errors())
        detail = "; ".join(field_message(e) for e in errors)
        try:
            detail.encode("utf-8")
        except UnicodeEncodeError:
            detail = detail.encode("utf-8", "backslashreplace").decode("utf-8")
        return JSONResponse({"detail": detail, "field": _first_field(errors)}, status_code=422)

    @app.exception_handler(DomainError)
    async def _domain(request: Request, exc: DomainError):
        status = STATUS.get(exc.kind, 409)
        if status == 403:
            on_refused(request, status, str(exc))
        headers = {"Retry-After": "1"} if exc.kind == "not_leader" else None
        if exc.kind == "throttled":
            headers = {"Retry-After": str(exc.retry_after_s)}
        return JSONResponse({"detail": str(exc), "field": exc.field}, status_code=status, headers=headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        if exc.status_code in (401, 403):
            on_refused(request, exc.status_code, str(exc.detail))
        headers = dict(getattr(exc, "headers", None) or {})
        detail = str(exc.detail)
        if exc.status_code == 405:
            allowed = allowed_methods(app, request.scope)
            headers["Allow"] = ", ".join(allowed)
            detail = f"{request.method} is not allowed on {request.url.path}; allowed: {', '.join(allowed)}"
        return JSONResponse({"detail": detail, "field": None}, status_code=exc.status_code, headers=headers)
