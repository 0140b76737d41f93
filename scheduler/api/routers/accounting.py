"""/v1/accounting: the job history as sacct reads it, and sreport-like usage with cost and waste."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Query

from ... import models as m
from ...daemon import Invalid
from ..deps import DaemonDep, Who
from ..errors import responses
from .common import AcceptEncoding, Json, body_response
from .jobs import JobIds, job_ids

router = APIRouter(prefix="/v1/accounting", tags=["accounting"])
Epoch = Annotated[float | None, Query(ge=0, le=1e11, description="seconds since the epoch")]


@router.get("/jobs", responses=responses(403, 429))
async def accounting_jobs(d: DaemonDep, who: Who, start: Epoch = None, end: Epoch = None,
                          user: Annotated[str | None, Query(max_length=64)] = None,
                          state: Annotated[str | None, Query(max_length=400)] = None,
                          limit: Annotated[int, Query(ge=1, le=1_000_000)] = 100_000,
                          ids: JobIds = None, accept_encoding: AcceptEncoding = None):
    """Jobs that existed in [start, end) (default: the last 24 hours), oldest first, with what
    sacct shows; users see their own, operators anybody's. With `ids`, at any time unless
    `start` is given (sacct -j). Gzip-compressed for a client that asks for it."""
    states = frozenset(x.strip().upper() for x in (state or "").split(",") if x.strip())
    bad = states - set(m.JOB_STATES)
    if bad:
        raise Invalid(f"state: unknown job state {sorted(bad)[0]!r}; one of {', '.join(m.JOB_STATES)}",
                      "state")
    q = d.accounting.sacct(who, start, end, user, states, limit, job_ids(ids))
    return body_response(*await d.sacct_page(who, q, accept_encoding))


@router.get("/report", responses=responses(403))
async def accounting_report(d: DaemonDep, who: Who, start: Epoch = None, end: Epoch = None,
                            by: Literal["user", "account", "queue"] = "account"):
    """Allocated GPU-hours, idle GPU-hours (under [accounting] idle_threshold_pct) and cost per
    user, account (team) or queue over [start, end); operators only."""
    return Json(d.accounting.report(who, by, start, end))
