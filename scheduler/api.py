"""The HTTP API under /v1 (FastAPI): every call authenticated, role-checked, validated, audited."""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Annotated, Any, Literal

from fastapi import Depends, FastAPI, HTTPException, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from sqlalchemy import insert, update
from sqlalchemy import select as sa_select
from sqlmodel import Session, col, select

from . import models as m
from .auth import hash_token, may_act_on_job, role_at_least
from .daemon import Daemon, Refused, event_json, job_key, job_view_row
from .jobspec import check_env_names, parse_mem, parse_time
from .models import Event, Job, Node, Queue, Token
from .nodes import (
    NodeError,
    SshTarget,
    fetch_host_key,
    fingerprint,
    is_pinned,
    pin_host_key,
    probe,
    unpin_host_key,
)
from .planner import depends_on, parse_array, parse_dependency

NAME_RE = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$"
MAX_ARRAY_TASKS = 10000


# ---------------------------------------------------------------------------- request models
class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class JobSubmit(Strict):
    command: list[str] | None = None
    script: str | None = None
    name: str | None = Field(default=None, max_length=200)
    queue: str = "default"
    gpus: int = Field(default=0, ge=0, le=1024)
    gpu_type: str | None = None
    nodes: int = Field(default=1, ge=1, le=4096)
    cpus: int = Field(default=1, ge=1, le=4096)
    mem: str | int | None = None
    time_limit: str | int | None = None
    priority: int = Field(default=0, ge=-10000, le=10000)
    retries: int = Field(default=0, ge=0, le=100)
    after: int | str | None = None
    array: str | None = None
    constraint: dict[str, str] | str | None = None
    exclusive: bool = False
    nice: int = Field(default=0, ge=-10000, le=10000)
    account: str | None = Field(default=None, pattern=NAME_RE)
    env: dict[str, str] = Field(default_factory=dict)
    workdir: str | None = None
    hold: bool = False

    @model_validator(mode="after")
    def one_of_command_or_script(self):
        if (self.command is None) == (self.script is None):
            raise ValueError("give exactly one of 'command' (a list of arguments) or 'script' (text)")
        if self.command is not None and (not self.command or not self.command[0]):
            raise ValueError("'command' must not be empty")
        if self.script is not None and not self.script.strip():
            raise ValueError("'script' must not be empty")
        return self

    @field_validator("mem")
    @classmethod
    def _mem(cls, v):
        return None if v is None else parse_mem(v)

    @field_validator("time_limit")
    @classmethod
    def _time(cls, v):
        return None if v is None else parse_time(v)

    @field_validator("env")
    @classmethod
    def _env(cls, v):
        check_env_names(v)
        return v

    @field_validator("workdir")
    @classmethod
    def _workdir(cls, v):
        if v is not None and not v.startswith("/"):
            raise ValueError(f"workdir {v!r} must be an absolute path on the node")
        return v

    @field_validator("after")
    @classmethod
    def _after(cls, v):
        return None if v is None else parse_dependency(str(v))

    @field_validator("array")
    @classmethod
    def _array(cls, v):
        if v is None:
            return None
        indices, _limit = parse_array(v)
        if len(indices) > MAX_ARRAY_TASKS:
            raise ValueError(f"array {v!r} has {len(indices)} tasks; at most {MAX_ARRAY_TASKS} per request")
        return v

    @field_validator("constraint")
    @classmethod
    def _constraint(cls, v):
        if v is None or isinstance(v, dict):
            return v or None
        out = {}
        for part in v.split(","):
            k, sep, val = part.strip().partition("=")
            if not sep or not k:
                raise ValueError(f"constraint {v!r}: expected LABEL=VALUE[,LABEL=VALUE...], e.g. rack=r1")
            out[k] = val
        return out


class JobPatch(Strict):
    priority: int = Field(ge=-10000, le=10000)


class NodeAdd(Strict):
    name: str = Field(pattern=NAME_RE)
    address: str = Field(min_length=1, max_length=253)
    port: int = Field(default=22, ge=1, le=65535)
    user: str = Field(default="trainyard", min_length=1, max_length=64)
    key_path: str | None = None
    agent_dir: str = ".trainyard"
    accept_new_host_key: bool = False
    gpus: int | None = Field(default=None, ge=0, le=64)
    gpu_model: str | None = None
    pool: str = "default"
    provider: Literal["aws", "onprem"] = "onprem"
    labels: dict[str, str] = Field(default_factory=dict)
    probe: bool = True  # connect once before registering


class DrainBody(Strict):
    reason: str = Field(min_length=1, max_length=500)


class FaultBody(Strict):
    gpu: int = Field(ge=0, le=63)
    kind: Literal["xid", "ecc_dbe", "temp", "off_bus", "clear"]
    value: int | float | None = None


class BootstrapBody(Strict):
    phase: Literal["start", "done", "failed"]
    detail: str = ""


class TokenCreate(Strict):
    user: str = Field(pattern=NAME_RE)
    role: Literal["admin", "operator", "user"]


class Principal(BaseModel):
    user: str
    role: str
    address: str


# ---------------------------------------------------------------------------- views
def job_json(j: Job) -> dict[str, Any]:
    return {
        "id": j.id, "name": j.name, "user": j.user, "queue": j.queue, "state": j.state, "reason": j.reason,
        "command": j.command, "script": j.script is not None, "gpus": j.gpus, "gpu_type": j.gpu_type,
        "nodes": j.nodes, "cpus": j.cpus, "mem": j.mem_mb, "time_limit": j.time_limit_s,
        "priority": j.priority, "retries": j.retries, "failures": j.failures, "attempt": j.attempt,
        "dependency": j.dependency or None, "array_job_id": j.array_parent, "array_task_id": j.array_task_id,
        "constraint": j.constraint, "exclusive": j.exclusive, "nice": j.nice, "account": j.account or None,
        "env": j.env, "workdir": j.workdir, "submit_time": j.submit_time, "start_time": j.start_time,
        "end_time": j.end_time, "exit_code": j.exit_code, "estimated_start": j.estimated_start,
        "allocation": [{"node": a["node"], "gpus": a["gpus"]} for a in j.allocation],
    }


def node_json(d: Daemon, n: Node, used: dict[str, int]) -> dict[str, Any]:
    connected = d.connected(n.name)
    reason = n.reason
    if not connected and n.name in d.link_error and not reason:
        reason = d.link_error[n.name]
    return {
        "name": n.name, "address": n.address, "port": n.port, "user": n.user, "pool": n.pool,
        "provider": n.provider, "state": n.state, "reason": reason, "connected": connected,
        "gpu_model": n.gpu_model, "gpus_total": n.gpus_total, "gpus_used": used.get(n.name, 0),
        "cpus": n.cpus, "mem_mb": n.mem_mb, "labels": n.labels, "last_seen": n.last_seen,
        "simulated": n.simulated, "agent_dir": n.agent_dir,
        "telemetry": d.telemetry.get(n.name, {"time": None, "gpus": []}),
        "excluded_gpus": {str(g): why for g, why in d.excluded_gpus.get(n.name, {}).items()},
    }


def field_message(err: dict) -> str:
    loc = [str(x) for x in err.get("loc", ()) if x not in ("body", "query", "path")]
    where = ".".join(loc)
    msg = err.get("msg", "invalid").removeprefix("Value error, ")
    got = err.get("input")
    shown = "" if isinstance(got, dict | list) or got is None else f" (got {got!r})"
    return f"{where}: {msg}{shown}" if where else f"{msg}{shown}"


class Json(JSONResponse):
    """A response already in JSON: list endpoints return thousands of dicts, and FastAPI's
    jsonable_encoder would walk each of them in Python before json.dumps does the same."""


# ---------------------------------------------------------------------------- authentication
async def principal(request: Request) -> Principal:
    """Who is calling: the bearer token's user and role (tokens are looked up by their hash)."""
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token:
        raise HTTPException(401, "missing bearer token: set TRAINYARD_TOKEN or run `trainyard token create`",
                            headers={"WWW-Authenticate": "Bearer"})
    digest = hash_token(token.strip())
    cache = request.app.state.token_cache
    hit = cache.get(digest)
    if hit is None:
        with Session(request.app.state.daemon.engine) as s:
            row = s.exec(select(Token).where(Token.token_hash == digest)).first()
        if row is None:
            raise HTTPException(401, "invalid token: it is unknown to this daemon",
                                headers={"WWW-Authenticate": "Bearer"})
        hit = cache[digest] = (row.user, row.role)
    return Principal(user=hit[0], role=hit[1], address=request.client.host if request.client else "")


Who = Annotated[Principal, Depends(principal)]


# ---------------------------------------------------------------------------- the app
def create_app(daemon: Daemon) -> FastAPI:
    app = FastAPI(title="trainyard", version="0.1.0", docs_url=None, redoc_url=None)
    app.state.daemon = daemon
    app.state.token_cache = {}

    @app.exception_handler(RequestValidationError)
    async def _validation(_req: Request, exc: RequestValidationError):
        return JSONResponse({"detail": "; ".join(field_message(e) for e in exc.errors())}, status_code=422)

    @app.exception_handler(Refused)
    async def _refused(_req: Request, exc: Refused):
        return JSONResponse({"detail": str(exc)}, status_code=exc.status)

    def need(p: Principal, role: str, what: str) -> None:
        if not role_at_least(p.role, role):
            raise HTTPException(403, f"{what} needs the {role} role; {p.user} is {p.role}")

    def get_job(s: Session, job_id: int) -> Job:
        job = s.get(Job, job_id)
        if job is None:
            raise HTTPException(404, f"job {job_id} does not exist")
        return job

    def get_node(s: Session, name: str) -> Node:
        node = s.get(Node, name)
        if node is None:
            raise HTTPException(404, f"node {name!r} does not exist; `trainyard nodes` lists them")
        return node

    # ---------------------------------------------------------------- identity and cluster
    @app.get("/v1/me")
    async def me(p: Who):
        return {"user": p.user, "role": p.role}

    @app.get("/v1/cluster")
    async def cluster(p: Who):
        with Session(daemon.engine) as s:
            nodes = s.exec(select(Node)).all()
            used = daemon.gpu_usage(s)
            counts = daemon.job_counts(s)
        by_state: dict[str, int] = {}
        for state, _q, n in counts:
            by_state[state] = by_state.get(state, 0) + n
        return {
            "name": daemon.config.cluster_name, "version": app.version,
            "nodes_total": len(nodes), "nodes_up": sum(n.state == m.UP for n in nodes),
            "gpus_total": sum(n.gpus_total for n in nodes), "gpus_used": sum(used.values()),
            "jobs_running": by_state.get(m.RUNNING, 0) + by_state.get(m.STARTING, 0),
            "jobs_pending": by_state.get(m.PENDING, 0) + by_state.get(m.HELD, 0),
            "jobs_by_state": by_state,
        }

    # ---------------------------------------------------------------- jobs
    @app.get("/v1/jobs")
    async def list_jobs(
        p: Who,
        all: bool = False,
        state: Annotated[list[str] | None, Query()] = None,
        user: str | None = None,
        queue: str | None = None,
        limit: int = Query(default=5000, ge=1, le=100000),
    ):
        t = Job.__table__.c
        q = sa_select(Job.__table__)  # plain rows: a listing of thousands need not build ORM objects
        if state:
            states = {x.upper() for part in state for x in part.split(",")}
            bad = states - set(m.JOB_STATES)
            if bad:
                raise HTTPException(422, f"state: unknown job state {sorted(bad)[0]!r}; "
                                         f"one of {', '.join(m.JOB_STATES)}")
            q = q.where(t.state.in_(states))
        elif not all:
            q = q.where(t.state.in_(m.ACTIVE_STATES | m.WAITING_STATES))
        if user:
            q = q.where(t.user == user)
        if queue:
            q = q.where(t.queue == queue)
        q = q.order_by(t.id.desc() if all else t.id).limit(limit)
        with daemon.engine.connect() as conn:
            return Json([job_json(SimpleNamespace(**r._mapping)) for r in conn.execute(q)])

    @app.post("/v1/jobs", status_code=201)
    async def submit(body: JobSubmit, p: Who):
        if body.priority > 0:
            need(p, "operator", "a positive --priority")
        now = time.time()
        with daemon.tx() as s:
            queue = s.get(Queue, body.queue)
            if queue is None:
                names = ", ".join(q.name for q in s.exec(select(Queue)).all())
                raise HTTPException(422, f"queue: unknown queue {body.queue!r}; queues: {names}")
            check_fits(s, body)
            limit = body.time_limit or queue.default_time_limit_s or daemon.policy.default_time_limit_s
            limit = int(limit) if limit else None
            if queue.max_time_limit_s and limit and limit > queue.max_time_limit_s:
                raise HTTPException(422, f"time_limit: {limit}s is over queue {queue.name!r}'s maximum "
                                         f"of {queue.max_time_limit_s}s")
            for dep in depends_on(body.after or ""):
                if s.get(Job, dep) is None:
                    raise HTTPException(422, f"after: job {dep} does not exist")
            if body.nice < 0:
                need(p, "operator", "a negative --nice")
            name = body.name or (os.path.basename(body.command[0]) if body.command else "script")
            tasks, limit_tasks = parse_array(body.array) if body.array else ((None,), None)
            # Core inserts: submission is the API's hot path, and ORM objects cost more than rows
            values = dict(
                name=name, user=p.user, queue=queue.name,
                state=m.HELD if body.hold else m.PENDING, reason="Held" if body.hold else "",
                command=body.command, script=body.script, gpus=body.gpus, gpu_type=body.gpu_type,
                nodes=body.nodes, cpus=body.cpus, mem_mb=body.mem or 0, time_limit_s=limit,
                priority=body.priority, retries=body.retries, attempt=0, failures=0,
                dependency=body.after or "", env=body.env, workdir=body.workdir, submit_time=now,
                eligible_time=now, constraint=body.constraint or {}, exclusive=body.exclusive,
                nice=body.nice, account=body.account or "", allocation=[], kill_reason="",
                attained_gpu_s=0.0, array_task_id=tasks[0], array_parent=None,
                array_limit=limit_tasks if body.array else None,
            )
            table = Job.__table__
            first = s.execute(insert(table), values).inserted_primary_key[0]
            if body.array:
                values["array_parent"] = first
                s.execute(update(table).where(table.c.id == first).values(array_parent=first))
                if len(tasks) > 1:
                    s.execute(insert(table), [{**values, "array_task_id": t} for t in tasks[1:]])
            job = SimpleNamespace(id=first, start_time=None, end_time=None, exit_code=None,
                                  estimated_start=None, **values)
            jobs = tasks
            daemon.record(s, p.user, "job.submit", str(job.id),
                          {"queue": job.queue, "gpus": job.gpus, "nodes": job.nodes, "state": job.state,
                           "tasks": len(jobs) if body.array else None}, p.address)
        if not body.hold:
            daemon.wake()
        return JSONResponse(job_json(job), status_code=201)

    def check_fits(s: Session, body: JobSubmit) -> None:
        sizes = sorted(s.exec(select(Node.gpus_total, Node.name)).all(), reverse=True)
        if not sizes:
            return  # nothing registered yet: the job waits for nodes
        if body.gpus > sizes[0][0]:
            raise HTTPException(422, f"gpus: {body.gpus} GPUs per node is more than any node has "
                                     f"(largest: {sizes[0][0]} on {sizes[0][1]}); use --nodes to spread the job")
        enough = sum(1 for g, _ in sizes if g >= body.gpus)
        if body.nodes > enough:
            raise HTTPException(422, f"nodes: {body.nodes} nodes with {body.gpus} GPUs each requested, "
                                     f"but the cluster has only {enough} such nodes")

    @app.get("/v1/jobs/{job_id}")
    async def get_one(job_id: int, p: Who):
        with Session(daemon.engine) as s:
            return Json(job_json(get_job(s, job_id)))

    @app.patch("/v1/jobs/{job_id}")
    async def patch_job(job_id: int, body: JobPatch, p: Who):
        with daemon.tx() as s:
            job = get_job(s, job_id)
            if not may_act_on_job(p.user, p.role, job.user):
                raise HTTPException(403, f"job {job_id} belongs to {job.user}; only they or an operator may change it")
            if body.priority > job.priority:
                need(p, "operator", "raising a job's priority")
            old, job.priority = job.priority, body.priority
            s.add(job)
            daemon.record(s, p.user, "job.priority", str(job_id), {"from": old, "to": body.priority}, p.address)
        daemon.wake()
        return job_json(job)

    @app.post("/v1/jobs/{job_id}/{action}")
    async def job_action(job_id: int, action: Literal["cancel", "hold", "release", "requeue"], p: Who):
        with daemon.tx() as s:
            job = get_job(s, job_id)
            if not may_act_on_job(p.user, p.role, job.user):
                raise HTTPException(403, f"job {job_id} belongs to {job.user}; {p.user} ({p.role}) may only "
                                         f"{action} their own jobs")
            apply_action(s, job, action, p)
            daemon.record(s, p.user, f"job.{action}", str(job_id), {"state": job.state}, p.address)
        daemon.wake()
        return job_json(job)

    def apply_action(s: Session, job: Job, action: str, p: Principal) -> None:
        st = job.state
        if action == "cancel":
            if st in m.WAITING_STATES:
                job.end_time = time.time()
                daemon.set_state(s, job, m.CANCELLED, f"cancelled by {p.user}", actor=p.user)
            elif st in m.ACTIVE_STATES:
                daemon.kill(s, job, "cancel")
            else:
                raise Refused(f"job {job.id} is already {st}; nothing to cancel")
        elif action == "hold":
            if st != m.PENDING:
                raise Refused(f"job {job.id} is {st}; only PENDING jobs can be held")
            daemon.set_state(s, job, m.HELD, "Held", actor=p.user)
        elif action == "release":
            if st != m.HELD:
                raise Refused(f"job {job.id} is {st}, not HELD; nothing to release")
            daemon.set_state(s, job, m.PENDING, "", actor=p.user)
        elif action == "requeue":
            if st in m.ACTIVE_STATES:
                daemon.kill(s, job, "requeue")
            elif st in m.FINAL_STATES:
                job.end_time = None
                daemon.requeue(s, job, f"requeued by {p.user}")
            else:
                raise Refused(f"job {job.id} is {st}; it is already waiting to run")

    @app.get("/v1/jobs/{job_id}/log")
    async def job_log(job_id: int, p: Who, offset: int = Query(0, ge=0), rank: int = Query(0, ge=0),
                      limit: int = Query(65536, ge=1, le=4 * 2**20)):
        with Session(daemon.engine) as s:
            job = get_job(s, job_id)
        if not job.allocation:
            return {"data": "", "next": offset, "state": job.state, "node": None}
        if rank >= len(job.allocation):
            raise HTTPException(422, f"rank: job {job_id} has ranks 0..{len(job.allocation) - 1}")
        node = job.allocation[rank]["node"]
        link = daemon.links.get(node)
        if link is None:
            raise HTTPException(503, f"node {node} is not known to the daemon any more; the log stayed there")
        try:
            reply = await link.request({"op": "log", "key": job_key(job), "offset": offset, "limit": limit})
        except NodeError as e:
            raise HTTPException(503, f"cannot read the log from {node}: {e}") from None
        return {"data": reply.get("data", ""), "next": reply.get("next", offset), "state": job.state,
                "node": node}

    # ---------------------------------------------------------------- nodes
    @app.get("/v1/nodes")
    async def list_nodes(p: Who):
        with Session(daemon.engine) as s:
            used = daemon.gpu_usage(s)
            return Json([node_json(daemon, n, used) for n in s.exec(select(Node).order_by(Node.name)).all()])

    @app.get("/v1/nodes/{name}")
    async def get_node_one(name: str, p: Who):
        with Session(daemon.engine) as s:
            return Json(node_json(daemon, get_node(s, name), daemon.gpu_usage(s)))

    @app.post("/v1/nodes", status_code=201)
    async def add_node(body: NodeAdd, p: Who):
        need(p, "admin", "adding a node")
        return await register_node(body, p)

    async def register_node(body: NodeAdd, p: Principal) -> dict:
        with Session(daemon.engine) as s:
            if s.get(Node, body.name) is not None:
                raise HTTPException(409, f"node {body.name!r} already exists; `trainyard node remove` it first")
        key_path = body.key_path or str(daemon.key_path)
        if body.key_path and not Path(body.key_path).is_file():
            raise HTTPException(422, f"key_path: {body.key_path!r} is not a file on the daemon's host")
        pinned_now = False
        if not is_pinned(daemon.known_hosts, body.address, body.port):
            try:
                key = await fetch_host_key(body.address, body.port, daemon.config.connect_timeout_s)
            except NodeError as e:
                raise HTTPException(422, f"node {body.name}: {e}") from None
            if not body.accept_new_host_key:
                raise HTTPException(422, f"node {body.name}: host key of {body.address}:{body.port} is not "
                                         f"known ({key.get_algorithm()} {fingerprint(key)}); check it and "
                                         "re-run with --accept-new-host-key to pin it")
            pin_host_key(daemon.known_hosts, body.address, body.port, key)
            pinned_now = True
        target = SshTarget(body.name, body.address, body.port, body.user, key_path, body.agent_dir,
                           body.gpus or 0, body.gpu_model or "")
        if body.probe:
            try:
                await probe(target, daemon.ssh_settings)
            except NodeError as e:
                if pinned_now:  # leave nothing half-registered
                    unpin_host_key(daemon.known_hosts, body.address, body.port)
                raise HTTPException(422, f"node {body.name}: {e}") from None
        with daemon.tx() as s:
            node = Node(name=body.name, address=body.address, port=body.port, user=body.user,
                        key_path=body.key_path, agent_dir=body.agent_dir, pool=body.pool,
                        provider=body.provider, gpu_model=body.gpu_model or "", gpus_total=body.gpus or 0,
                        labels=body.labels, state=m.DOWN, reason="connecting", created_at=time.time())
            s.add(node)
            daemon.record(s, p.user, "node.add", body.name,
                          {"address": body.address, "port": body.port, "host_key_pinned": pinned_now}, p.address)
        daemon.start_link(node)
        with Session(daemon.engine) as s:
            return node_json(daemon, s.get(Node, body.name), {})

    @app.post("/v1/nodes/import", status_code=201)
    async def import_nodes(body: list[dict[str, Any]], p: Who):
        need(p, "admin", "importing nodes")
        results = []
        for i, item in enumerate(body):
            try:
                req = NodeAdd(
                    name=item.get("name"), address=item.get("address"), port=item.get("ssh_port", 22),
                    user=item.get("ssh_user", "trainyard"), pool=item.get("pool", "default"),
                    provider=item.get("provider", "onprem"), gpus=item.get("gpu_count"),
                    gpu_model=item.get("gpu_model"), labels=item.get("labels") or {},
                    accept_new_host_key=bool(item.get("accept_new_host_key", False)),
                )
            except Exception as e:
                results.append({"name": item.get("name"), "ok": False, "error": f"entry {i}: {e}"})
                continue
            try:
                results.append({"name": req.name, "ok": True, "node": await register_node(req, p)})
            except HTTPException as e:
                results.append({"name": req.name, "ok": False, "error": e.detail})
        return results

    @app.delete("/v1/nodes/{name}")
    async def remove_node(name: str, p: Who, force: bool = False):
        need(p, "admin", "removing a node")
        with daemon.tx() as s:
            node = get_node(s, name)
            active = daemon.active_jobs_on(s, name)
            if active and not force:
                ids = ", ".join(str(j.id) for j in active[:10])
                raise Refused(f"node {name} runs jobs {ids}; drain it and wait, or remove with --force")
            for job in active:  # forced: their runs there are lost to us (requeued if retries allow)
                job.kill_reason, job.reason = "node_fail", f"node {name} removed by {p.user}"
                daemon.signal_job(job, "KILL")
                daemon.finish(s, job, {a["node"]: (None, True) for a in job.allocation})
            s.delete(node)
            shared = s.exec(select(Node).where(Node.address == node.address, Node.port == node.port,
                                               Node.name != name)).first()
            if shared is None:  # a reinstalled host must be able to come back with a new key
                unpin_host_key(daemon.known_hosts, node.address, node.port)
            daemon.record(s, p.user, "node.remove", name, {"forced": bool(active)}, p.address)
        await daemon.stop_link(name)
        return {"name": name, "removed": True}

    @app.post("/v1/nodes/{name}/drain")
    async def drain(name: str, body: DrainBody, p: Who):
        need(p, "operator", "draining a node")
        with daemon.tx() as s:
            node = get_node(s, name)
            daemon.drain(s, node, body.reason, p.user, p.address)
            used = daemon.gpu_usage(s)
        return node_json(daemon, node, used)

    @app.post("/v1/nodes/{name}/resume")
    async def resume(name: str, p: Who):
        need(p, "operator", "resuming a node")
        with daemon.tx() as s:
            node = get_node(s, name)
            if node.state == m.UP:
                raise Refused(f"node {name} is already UP")
            node.state = m.UP if daemon.connected(name) else m.DOWN
            node.reason = "" if node.state == m.UP else "connecting"
            s.add(node)
            daemon.record(s, p.user, "node.resume", name, {"state": node.state}, p.address)
            used = daemon.gpu_usage(s)
        daemon.wake()
        return node_json(daemon, node, used)

    @app.post("/v1/nodes/{name}/fault")
    async def fault(name: str, body: FaultBody, p: Who):
        need(p, "operator", "injecting a GPU fault")
        with Session(daemon.engine) as s:
            node = get_node(s, name)
        if not node.simulated:
            raise Refused(f"node {name} is a real node; fault injection works only on the demo's simulated "
                          "GPUs", 409)
        try:
            reply = await daemon.inject_fault(name, body.gpu, body.kind, body.value)
        except NodeError as e:
            raise HTTPException(503, str(e)) from None
        with daemon.tx() as s:
            daemon.record(s, p.user, "node.fault", name, body.model_dump(), p.address)
        return reply

    @app.post("/v1/nodes/{name}/bootstrap")
    async def bootstrap_phase(name: str, body: BootstrapBody, p: Who):
        need(p, "operator", "bootstrapping a node")
        with daemon.tx() as s:
            node = get_node(s, name)
            if body.phase == "start":
                if daemon.active_jobs_on(s, name):
                    raise Refused(f"node {name} runs jobs; drain it before bootstrapping")
                node.state, node.reason = m.BOOTSTRAPPING, body.detail or "bootstrap running"
            elif body.phase == "done":
                node.state = m.UP if daemon.connected(name) else m.DOWN
                node.reason = "" if node.state == m.UP else "connecting"
            else:
                node.state, node.reason = m.DOWN, f"bootstrap failed: {body.detail}"[:500]
            s.add(node)
            daemon.record(s, p.user, f"node.bootstrap.{body.phase}", name, {"detail": body.detail}, p.address)
            used = daemon.gpu_usage(s)
        daemon.wake()
        return node_json(daemon, node, used)

    # ---------------------------------------------------------------- queues, tokens, events
    @app.get("/v1/queues")
    async def queues(p: Who):
        with Session(daemon.engine) as s:
            counts = daemon.job_counts(s)
            active = s.exec(select(Job).where(col(Job.state).in_(m.ACTIVE_STATES))).all()
            out = []
            for q in s.exec(select(Queue).order_by(Queue.name)).all():
                c = {st: n for st, qn, n in counts if qn == q.name}
                out.append({
                    "name": q.name, "priority": q.priority, "state": "open" if q.open else "stopped",
                    "default_time_limit": q.default_time_limit_s, "max_time_limit": q.max_time_limit_s,
                    "pending": c.get(m.PENDING, 0) + c.get(m.HELD, 0),
                    "running": c.get(m.RUNNING, 0) + c.get(m.STARTING, 0),
                    "gpus_used": sum(len(a["gpus"]) for j in active if j.queue == q.name for a in j.allocation),
                })
            return out

    @app.get("/v1/teams")
    async def teams(p: Who):
        """Per team: quota (nominal, borrowing and lending limits, cohort), GPUs in use, decayed
        fair-share usage, pending and running jobs — like Slurm's sshare with Kueue's quotas."""
        policy = daemon.policy
        with Session(daemon.engine) as s:
            rows = daemon.view_rows(s, daemon.VIEW_COLUMNS,
                                    daemon._T.state.in_(m.ACTIVE_STATES | m.WAITING_STATES))
        views = [(r[11], job_view_row(r)) for r in rows]
        running = [v for st, v in views if st in m.ACTIVE_STATES]
        usage = daemon.ledger.decayed(time.time(), running, policy.team_of)
        names = set(policy.teams) | {policy.team_of(v) for _, v in views} | {"default"}
        out = []
        for name in sorted(names):
            quota = policy.teams.get(name)
            mine = [(st, v) for st, v in views if policy.team_of(v) == name]
            out.append({
                "name": name, "cohort": quota.cohort if quota else None,
                "nominal_gpus": quota.nominal_gpus if quota else None,
                "borrowing_limit_gpus": quota.borrowing_limit_gpus if quota else None,
                "lending_limit_gpus": quota.lending_limit_gpus if quota else None,
                "fairshare_shares": quota.fairshare if quota else 1.0,
                "users": list(quota.users) if quota else [],
                "gpus_used": sum(v.gpus * len(v.allocation) for st, v in mine if st in m.ACTIVE_STATES),
                "running": sum(st in m.ACTIVE_STATES for st, _ in mine),
                "pending": sum(st in m.WAITING_STATES for st, _ in mine),
                "usage_gpu_hours": round(usage.get(f"team:{name}", 0.0) / 3600, 3),
            })
        return out

    @app.post("/v1/tokens", status_code=201)
    async def create_token(body: TokenCreate, p: Who):
        need(p, "admin", "creating tokens")
        token = daemon.create_token(body.user, body.role, p.user, p.address)
        return {"user": body.user, "role": body.role, "token": token}

    @app.get("/v1/tokens")
    async def list_tokens(p: Who):
        need(p, "admin", "listing tokens")
        with Session(daemon.engine) as s:
            return [{"id": t.id, "user": t.user, "role": t.role, "created_at": t.created_at,
                     "created_by": t.created_by} for t in s.exec(select(Token).order_by(Token.id)).all()]

    @app.delete("/v1/tokens/{token_id}")
    async def revoke_token(token_id: int, p: Who):
        need(p, "admin", "revoking tokens")
        with daemon.tx() as s:
            row = s.get(Token, token_id)
            if row is None:
                raise HTTPException(404, f"token {token_id} does not exist; `trainyard token list` shows them")
            s.delete(row)
            daemon.record(s, p.user, "token.revoke", row.user, {"token_id": token_id, "role": row.role}, p.address)
        app.state.token_cache.pop(row.token_hash, None)  # refused from the next request on
        return {"id": token_id, "user": row.user, "revoked": True}

    @app.get("/v1/events")
    async def events(request: Request, p: Who, since: int = Query(0, ge=0),
                     limit: int = Query(200, ge=1, le=10000), stream: bool = False):
        wants_stream = stream or "text/event-stream" in request.headers.get("accept", "")
        last = request.headers.get("last-event-id")
        if last and last.isdigit():
            since = int(last)
        with Session(daemon.engine) as s:
            if wants_stream or since:
                rows = s.exec(select(Event).where(col(Event.id) > since).order_by(col(Event.id)).limit(limit)).all()
            else:
                rows = list(reversed(s.exec(select(Event).order_by(col(Event.id).desc()).limit(limit)).all()))
            backlog = [event_json(e) for e in rows]
        if not wants_stream:
            return Json(backlog)
        queue: asyncio.Queue = asyncio.Queue()
        daemon.subscribers.add(queue)

        async def gen():
            seen = since
            try:
                for ev in backlog:
                    seen = ev["id"]
                    yield sse(ev)
                while True:
                    try:
                        ev = await asyncio.wait_for(queue.get(), 15)
                    except TimeoutError:
                        yield ": keepalive\n\n"
                        continue
                    if ev is None:
                        return
                    if ev["id"] is not None and ev["id"] <= seen:
                        continue
                    seen = ev["id"] or seen
                    yield sse(ev)
            finally:
                daemon.subscribers.discard(queue)

        return StreamingResponse(gen(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @app.get("/metrics")
    async def metrics():
        return Response(daemon.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/healthz")
    async def healthz():
        return {"ok": True}

    return app


def sse(ev: dict) -> str:
    return f"id: {ev['id']}\nevent: {ev['action']}\ndata: {json.dumps(ev, separators=(',', ':'))}\n\n"
