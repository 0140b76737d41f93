"""/v1/nodes: list, show, add (pinning host keys), import an inventory, remove, drain, resume, faults."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Body, Depends, Path, Response
from pydantic import ValidationError

from ...daemon import Caller, DomainError, NodeRequest
from ...daemon.views import accepts_gzip
from ..deps import DaemonDep, require
from ..errors import field_message, responses
from ..schemas import (
    NAME_RE,
    BootstrapBody,
    DrainBody,
    FaultBody,
    ImportResult,
    NodeAdd,
    NodeRead,
    Removed,
)
from .common import AcceptEncoding, Json

router = APIRouter(prefix="/v1/nodes", tags=["nodes"])
NodeName = Annotated[str, Path(pattern=NAME_RE, description="the node's name")]
Admin = Annotated[Caller, Depends(require("admin", "changing the node inventory"))]
Operator = Annotated[Caller, Depends(require("operator", "draining, resuming or bootstrapping a node"))]
Anyone = Annotated[Caller, Depends(require("user", "reading nodes"))]


def _request(body: NodeAdd) -> NodeRequest:
    return NodeRequest(name=body.name, address=body.address, port=body.port, user=body.user,
                       key_path=body.key_path, agent_dir=body.agent_dir,
                       accept_new_host_key=body.accept_new_host_key, gpus=body.gpus, gpu_model=body.gpu_model,
                       pool=body.pool, provider=body.provider, labels=body.labels, probe=body.probe,
                       privilege=body.privilege)


@router.get("", response_model=list[NodeRead], responses=responses())
async def list_nodes(d: DaemonDep, who: Anyone, accept_encoding: AcceptEncoding = None):
    """Every node with its GPUs and their latest telemetry (about 7 KB a node of 8 GPUs). Sent
    gzip-compressed to a client whose Accept-Encoding admits gzip (curl --compressed, httpx and
    the trainyard CLI and TUI do): about a quarter of the bytes."""
    if accepts_gzip(accept_encoding):
        return Response(d.nodes_listing(compressed=True), media_type="application/json",
                        headers={"Content-Encoding": "gzip", "Vary": "Accept-Encoding"})
    return Response(d.nodes_listing(), media_type="application/json", headers={"Vary": "Accept-Encoding"})


@router.get("/{name}", response_model=NodeRead, responses=responses(404))
async def get_node(name: NodeName, d: DaemonDep, who: Anyone):
    return Json(d.node_views(name)[0])


@router.get("/{name}/images", responses=responses(404, 503))
async def node_images(name: NodeName, d: DaemonDep, who: Anyone) -> dict[str, Any]:
    """The node's cached container images (by digest, most recently used first) and its cache limit."""
    d.node_views(name)  # 404 for a node that does not exist
    reply = await d.links.request(name, {"op": "images"})
    return {"node": name, "runtime": reply.get("runtime", ""), "high_water": reply.get("high_water", 0),
            "images": reply.get("images", [])}


@router.post("", status_code=201, response_model=NodeRead, responses=responses(403, 409))
async def add_node(body: NodeAdd, d: DaemonDep, who: Admin):
    """Register a node: pin its host key (only with accept_new_host_key), probe SSH and python3."""
    name = await d.inventory.register(who, _request(body))
    return Json(d.node_views(name)[0], status_code=201)


@router.post("/import", status_code=201, response_model=list[ImportResult], responses=responses(403))
async def import_nodes(d: DaemonDep, who: Admin,
                       body: Annotated[list[dict[str, Any]], Body(max_length=10000)]):
    """Register every node of an inventory document; each entry succeeds or fails on its own."""
    results = []
    for i, item in enumerate(body):
        name = item.get("name") if isinstance(item.get("name"), str) else None
        try:
            req = NodeAdd(
                name=item.get("name"), address=item.get("address"), port=item.get("ssh_port", 22),
                user=item.get("ssh_user", "trainyard"), pool=item.get("pool", "default"),
                provider=item.get("provider", "onprem"), gpus=item.get("gpu_count"),
                gpu_model=item.get("gpu_model"), labels=item.get("labels") or {},
                accept_new_host_key=bool(item.get("accept_new_host_key", False)),
            )
        except ValidationError as e:
            msg = "; ".join(field_message(x) for x in e.errors())
            results.append({"name": name, "ok": False, "error": f"entry {i}: {msg}"})
            continue
        try:
            await d.inventory.register(who, _request(req))
            results.append({"name": req.name, "ok": True, "node": d.node_views(req.name)[0]})
        except DomainError as e:
            results.append({"name": req.name, "ok": False, "error": str(e)})
    return Json(results, status_code=201)


@router.delete("/{name}", response_model=Removed, responses=responses(403, 404, 409))
async def remove_node(name: NodeName, d: DaemonDep, who: Admin, force: bool = False):
    """Remove a node; one that runs jobs needs force (its jobs end NODE_FAIL, requeued if allowed)."""
    await d.inventory.remove(who, name, force)
    return {"name": name, "removed": True}


@router.post("/{name}/drain", response_model=NodeRead, responses=responses(403, 404))
async def drain_node(name: NodeName, body: DrainBody, d: DaemonDep, who: Operator):
    """No new jobs here: DRAINING while jobs run, then DRAINED."""
    d.inventory.drain(who, name, body.reason)
    return Json(d.node_views(name)[0])


@router.post("/{name}/resume", response_model=NodeRead, responses=responses(403, 404, 409))
async def resume_node(name: NodeName, d: DaemonDep, who: Operator, force: bool = False):
    """Back into service through the health gate (409 names a failed check); force skips it, audited."""
    await d.inventory.resume(who, name, force)
    return Json(d.node_views(name)[0])


@router.post("/{name}/fault", responses=responses(403, 404, 409, 503))
async def fault(name: NodeName, body: FaultBody, d: DaemonDep,
                who: Annotated[Caller, Depends(require("operator", "injecting a GPU fault"))]) -> dict[str, Any]:
    """Demo only: make a simulated GPU report an XID, an ECC error, heat, or fall off the bus."""
    return await d.inventory.inject_fault(who, name, body.model_dump())


@router.post("/{name}/bootstrap", response_model=NodeRead, responses=responses(403, 404, 409))
async def bootstrap_phase(name: NodeName, body: BootstrapBody, d: DaemonDep, who: Operator):
    """`trainyard bootstrap` reports its phases: the node is out of service while playbooks run."""
    d.inventory.bootstrap_phase(who, name, body.phase, body.detail)
    return Json(d.node_views(name)[0])
