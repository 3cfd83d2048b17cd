"""A job's batch plans: the current one (polled by workers) and the history."""

from __future__ import annotations

from fastapi import APIRouter, Path, Query, Response

from agent.wire import PlanOut
from server.api.deps import SessionDep, Viewer
from server.services import plans

router = APIRouter(prefix="/jobs", tags=["plans"])
JobId = Path(ge=1, le=2**31 - 1)


@router.get(
    "/{job_id}/plan", responses={304: {"description": "The plan is still `known_version`."}}
)
def current_plan(
    session: SessionDep,
    _: Viewer,
    response: Response,
    job_id: int = JobId,
    known_version: int | None = Query(None, ge=0, le=2**31 - 1),
) -> PlanOut | None:
    """The plan in force; with `known_version` equal to it, an empty 304."""
    plan = plans.current(session, job_id)
    if known_version is not None and plan.version == known_version:
        response.status_code = 304
        return None
    return PlanOut.model_validate(plan)


@router.get("/{job_id}/plans")
def plan_history(
    session: SessionDep,
    _: Viewer,
    job_id: int = JobId,
    limit: int = Query(100, ge=1, le=1000),
    offset: int = Query(0, ge=0, le=2**31 - 1),
) -> list[PlanOut]:
    """Every plan version, newest first, with why it was made."""
    return [
        PlanOut.model_validate(p)
        for p in plans.history(session, job_id, limit=limit, offset=offset)
    ]
