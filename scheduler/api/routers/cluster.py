"""Who am I, the cluster at a glance, liveness, and Prometheus metrics."""

from __future__ import annotations

import asyncio
import ipaddress
from typing import Annotated
from urllib.parse import urlsplit

from fastapi import APIRouter, Path, Request
from fastapi.responses import Response

from ...daemon import NotFound
from ...metrics import SD_CONTENT_TYPE, TEXT_CONTENT_TYPE
from ..deps import DaemonDep, Who
from ..errors import ErrorBody, responses
from ..schemas import NAME_RE, ClusterRead, Health, Me
from .common import Json

router = APIRouter(tags=["cluster"])


@router.get("/v1/me", response_model=Me, responses=responses())
async def me(who: Who):
    return {"user": who.user, "role": who.role}


@router.get("/v1/cluster", response_model=ClusterRead, responses=responses())
async def cluster(request: Request, d: DaemonDep, who: Who):
    out = d.overview.cluster(request.app.version)
    out["problems"] = [p for p in (d.logstore.problem,) if p]  # e.g. job output that cannot be stored
    out["role"] = d.leadership.role
    p99 = d.diag.lag.p99(need=100)  # a p99 once there are 100 samples (10 s) to take it of
    out["loop_lag_p99_ms"] = None if p99 is None else round(p99 * 1000, 3)
    return Json(out)


@router.get("/v1/diag", responses=responses())
async def diag(d: DaemonDep, who: Who):
    """The daemon's own load, as Slurm's sdiag shows the controller's (`trainyard diag`,
    `ty-sdiag`): its event loop's lag, the scheduling cycles, the jobs it took in and ended, the
    agents' messages and the API's requests, since it started or since the last reset. An
    operator also sees each user's requests."""
    return Json(d.diag_report(who))


@router.post("/v1/diag/reset", responses=responses(403))
async def diag_reset(d: DaemonDep, who: Who):
    """Start the counts and worst cases again from now (operators; `sdiag --reset`)."""
    return Json(d.diag_reset(who))


@router.get("/healthz", response_model=Health)
async def healthz(d: DaemonDep):
    """Liveness (no token), and which daemon leads: `role` is leader or standby (with why). The
    leader also says how many of its nodes' SSH links are up (`nodes_connected` of `nodes`):
    after a takeover, how far the new leader is in reconnecting the agents."""
    lead = d.leadership
    out = {"ok": True, "role": lead.role, "url": d.url, "epoch": lead.epoch or None,
           "reason": lead.reason or None}
    if lead.postgres and not lead.leading:
        out["leader"] = (await asyncio.to_thread(lead.leader)).get("url")
    elif lead.leading:
        out["leader"] = d.url
        out["nodes"] = len(d.links.names())
        out["nodes_connected"] = d.links.connected_count()
    return out


@router.get("/metrics", response_class=Response,
            responses={200: {"content": {"text/plain": {}}, "description": "Prometheus text format"}})
async def metrics(d: DaemonDep):
    """The scheduler's own metrics (no token, like any Prometheus target)."""
    return Response(d.metrics.render(), media_type=TEXT_CONTENT_TYPE)


@router.get("/metrics/http_sd", response_class=Response,
            responses={200: {"content": {"application/json": {}},
                             "description": "Prometheus HTTP service discovery: one target per node"}})
async def metrics_http_sd(request: Request, d: DaemonDep):
    """One scrape target per node, so every GPU series carries `instance` = the node. The agents
    report their GPUs to the leader alone, so on PostgreSQL the targets are at the leader's
    advertised address (when it listens on a definite one), whichever daemon is asked: given
    both daemons, Prometheus finds the same targets twice and scrapes each once, at the leader."""
    host, scheme = request.headers.get("host") or request.url.netloc, request.url.scheme
    lead = d.leadership
    if lead.postgres:
        url = d.url if lead.leading else (await asyncio.to_thread(lead.leader)).get("url")
        leader = urlsplit(url or "")
        if leader.hostname and not ip_address_unspecified(leader.hostname):
            host, scheme = leader.netloc, leader.scheme
    return Response(d.metrics.http_sd(host, scheme), media_type=SD_CONTENT_TYPE)


def ip_address_unspecified(host: str) -> bool:
    """0.0.0.0 or ::, which a daemon listening on every interface advertises."""
    try:
        return ipaddress.ip_address(host).is_unspecified
    except ValueError:
        return False  # a host name


@router.get("/metrics/nodes/{name}", response_class=Response,
            responses={200: {"content": {"text/plain": {}}, "description": "one node's GPUs, as dcgm-exporter"},
                       404: {"model": ErrorBody, "description": "no such node"},
                       422: {"model": ErrorBody, "description": "not a node name"}})
async def metrics_node(name: Annotated[str, Path(pattern=NAME_RE)], d: DaemonDep):
    body = d.metrics.render_node(name)
    if body is None:
        raise NotFound(f"node {name!r} does not exist; `trainyard nodes` lists them", "name")
    return Response(body, media_type=TEXT_CONTENT_TYPE)
