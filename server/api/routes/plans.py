"""A job's batch plans: the current one (polled by workers) and the history."""

from __future__ import annotations

from fastapi import APIRouter, Path, Query, Request, Response
from fastapi.concurrency import run_in_threadpool
from sqlalchemy.orm import Session, sessionmaker

from agent.wire import PlanOut
from server.api.deps import SessionDep, Viewer
from server.services import plans

router = APIRouter(prefix="/jobs", tags=["plans"])
JobId = Path(ge=1, le=2**31 - 1)


@router.get(
    "/{job_id}/plan",
    response_model=PlanOut,
    responses={304: {"description": "The plan is still `known_version`."}},
)
async def current_plan(
    request: Request,
    _: Viewer,
    job_id: int = JobId,
    known_version: int | None = Query(None, ge=0, le=2**31 - 1),
) -> Response:
    """The plan in force; with `known_version` equal to it, an empty 304.

    Workers poll this every second, so it is served from a cache that the commit of a new
    plan clears; only a miss touches the database."""
    cache = request.app.state.caches.plans
    hit: tuple[int, bytes] | None = cache.get(job_id)
    if hit is None:
        hit = await run_in_threadpool(_load_current, request.app.state.sessions, job_id)
        cache.put(job_id, hit)
    version, body = hit
    if known_version is not None and version == known_version:
        return Response(status_code=304)
    return Response(body, media_type="application/json")


def _load_current(sessions: sessionmaker[Session], job_id: int) -> tuple[int, bytes]:
    with sessions() as session:
        plan = plans.current(session, job_id)
        return plan.version, PlanOut.model_validate(plan).model_dump_json().encode()


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
