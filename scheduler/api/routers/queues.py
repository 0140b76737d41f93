"""/v1/queues and /v1/teams: queues (Slurm partitions) and teams (accounts with quotas)."""

from __future__ import annotations

from fastapi import APIRouter

from ..deps import DaemonDep, Who
from ..errors import responses
from ..schemas import QueueRead, TeamRead
from .common import Json

router = APIRouter(prefix="/v1", tags=["queues"])


@router.get("/queues", response_model=list[QueueRead], responses=responses())
async def queues(d: DaemonDep, who: Who):
    return Json(d.overview.queues())


@router.get("/teams", response_model=list[TeamRead], responses=responses())
async def teams(d: DaemonDep, who: Who):
    """Per team: quota (nominal, borrowing and lending limits, cohort), GPUs in use, decayed
    fair-share usage, pending and running jobs — like Slurm's sshare with Kueue's quotas."""
    return Json(d.overview.teams())
