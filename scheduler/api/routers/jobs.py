"""/v1/jobs: submit, list, show, change priority, cancel/hold/release/requeue, read the log."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Query

from ... import models as m
from ...daemon import Invalid, JobFilter, JobRequest
from ...daemon.jobs import SLURM_FIELDS
from ..deps import DaemonDep, Who
from ..errors import STATUS, responses
from ..schemas import (
    BULK_MAX,
    MAX_ID,
    BulkResult,
    JobIdList,
    JobPatch,
    JobRead,
    JobSubmit,
    LogChunk,
    storable,
)
from .common import AcceptEncoding, Json, body_response

router = APIRouter(prefix="/v1/jobs", tags=["jobs"])
JobId = Annotated[int, Path(ge=1, le=MAX_ID, description="the job's id")]
Name = Annotated[str | None, Query(max_length=64)]
_ONE = "|".join([*m.JOB_STATES, *(s.lower() for s in m.JOB_STATES)])
STATES_RE = f"^({_ONE})(,({_ONE}))*$"  # one state or several, comma-separated


MAX_IDS = 1000
JobIds = Annotated[str | None, Query(max_length=20_000, pattern=r"^[0-9]{1,19}(,[0-9]{1,19})*$",
                                     description=f"only these jobs and the tasks of these arrays, comma-separated "
                                     f"(at most {MAX_IDS})")]


def job_ids(text: str | None) -> frozenset[int]:
    """A query's comma-separated job ids (the pattern has checked their digits)."""
    wanted = frozenset(int(x) for x in text.split(",")) if text else frozenset()
    if len(wanted) > MAX_IDS:
        raise Invalid(f"ids: {len(wanted)} job ids; at most {MAX_IDS} per request", "ids")
    if any(i > MAX_ID for i in wanted):
        raise Invalid(f"ids: job ids are at most {MAX_ID}", "ids")
    return wanted


@router.get("", response_model=list[JobRead], responses=responses(429))
async def list_jobs(d: DaemonDep, who: Who, all: bool = False,
                    state: Annotated[list[Annotated[str, Query(pattern=STATES_RE)]] | None, Query()] = None,
                    user: Name = None, queue: Name = None,
                    limit: Annotated[int, Query(ge=1, le=100000)] = 5000,
                    ids: JobIds = None, accept_encoding: AcceptEncoding = None):
    """Jobs waiting or running (`all` for finished ones too, newest first); filter by state, user,
    queue or ids. At most `limit`: a page as long as the limit may have more after it. A long
    page is gzip-compressed for a client that asks for it (Accept-Encoding)."""
    states: set[str] = set()
    for part in state or ():
        states.update(x.strip().upper() for x in part.split(",") if x.strip())
    bad = states - set(m.JOB_STATES)
    if bad:
        raise Invalid(f"state: unknown job state {sorted(bad)[0]!r}; one of {', '.join(m.JOB_STATES)}", "state")
    for name, value in (("user", user), ("queue", queue)):
        try:
            storable(value, name)
        except ValueError as e:
            raise Invalid(str(e), name) from None
    f = JobFilter(all=all, states=frozenset(states), user=user, queue=queue, limit=limit, ids=job_ids(ids))
    return body_response(*await d.job_page(who, f, accept_encoding))


@router.post("", status_code=201, response_model=JobRead, responses=responses(403, 404, 409))
async def submit(body: JobSubmit, d: DaemonDep, who: Who):
    """Submit one job (or one array of tasks); answers the job, PENDING."""
    req = JobRequest(
        command=body.command, script=body.script, name=body.name, queue=body.queue, gpus=body.gpus,
        gpu_type=body.gpu_type, nodes=body.nodes, cpus=body.cpus, mem_mb=body.mem,
        time_limit_s=body.time_limit, priority=body.priority, retries=body.retries, dependency=body.after,
        array=body.array, constraint=body.constraint or {}, exclusive=body.exclusive, nice=body.nice,
        account=body.account, env=body.env, workdir=body.workdir, hold=body.hold,
        slurm={k: getattr(body, k) for k in SLURM_FIELDS if getattr(body, k, None) is not None},
    )
    return Json(await d.jobs.submit_grouped(who, req), status_code=201)


@router.get("/{job_id}", response_model=JobRead, responses=responses(404))
async def get_job(job_id: JobId, d: DaemonDep, who: Who):
    return Json(d.jobs.get(who, job_id))


@router.patch("/{job_id}", response_model=JobRead, responses=responses(403, 404, 409))
async def patch_job(job_id: JobId, body: JobPatch, d: DaemonDep, who: Who):
    """Change a job's priority or time limit (`scontrol update`); raising either needs the
    operator role. A running job's new time limit counts from its start, as in Slurm."""
    job = None
    if body.time_limit is not None:
        job = d.jobs.set_time_limit(who, job_id, body.time_limit)
    if body.priority is not None:
        job = d.jobs.set_priority(who, job_id, body.priority)
    return Json(job)


def _action(action: str, doc: str):
    async def act_many(body: JobIdList, d: DaemonDep, who: Who):
        result = d.jobs.act_many(who, body.ids, action)
        return Json({"done": result["done"],
                     "refused": [{"id": r["id"], "status": STATUS.get(r["kind"], 409), "detail": r["detail"]}
                                 for r in result["refused"]]})

    act_many.__doc__ = (f"{doc.split(':')[0]} many jobs in one call (at most {BULK_MAX:,}; an array's tasks, "
                        "scancel of a user's jobs): each is acted on, or refused with the status and reason "
                        "its own call would have had, and the others go on.")
    act_many.__name__ = f"{action}_jobs"
    # first: /{job_id}/<action> would take "actions" for a job id
    router.add_api_route(f"/actions/{action}", act_many, methods=["POST"], response_model=BulkResult,
                         responses=responses(), name=f"{action}_jobs")

    async def act(job_id: JobId, d: DaemonDep, who: Who):
        return Json(d.jobs.act(who, job_id, action))

    act.__doc__ = doc
    act.__name__ = f"{action}_job"
    router.add_api_route(f"/{{job_id}}/{action}", act, methods=["POST"], response_model=JobRead,
                         responses=responses(403, 404, 409), name=f"{action}_job")


_action("cancel", "Cancel: a waiting job ends CANCELLED; a running one gets SIGTERM, then SIGKILL.")
_action("hold", "Hold a PENDING job (JobHeldUser, or JobHeldAdmin when an operator holds it).")
_action("release", "Release a hold; a user cannot release an operator's hold (JobHeldAdmin).")
_action("requeue", "Requeue: a running job is stopped and waits again; a finished one runs again.")


@router.get("/{job_id}/log", response_model=LogChunk, responses=responses(403, 404, 503))
async def job_log(job_id: JobId, d: DaemonDep, who: Who,
                  offset: Annotated[int, Query(ge=0, le=MAX_ID)] = 0,
                  rank: Annotated[int, Query(ge=0, le=4096)] = 0,
                  limit: Annotated[int, Query(ge=1, le=4 * 2**20)] = 65536,
                  attempt: Annotated[int | None, Query(ge=0, le=MAX_ID)] = None):
    """A piece of the job's output (stdout and stderr of one rank) from byte `offset`, as the
    daemon stored it (the node's copy while nothing is stored yet); `attempt` defaults to the
    latest run. Users read only their own jobs' logs."""
    return Json(await d.logs.read(who, job_id, offset, rank, limit, attempt))
