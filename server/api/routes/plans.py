"""A job's batch plans: the current one (polled by workers) and the history."""

from __future__ import annotations

from fastapi import APIRouter, Path, Query, Request, Response
from fastapi.concurrency import run_in_threadpool
from sqlalchemy.orm import Session, sessionmaker

from agent.wire import ModelOut, PlanOut
from server.api.deps import SessionDep, Viewer
from server.services import jobs, plans, rebalancer

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


@router.get("/{job_id}/models")
def worker_models(session: SessionDep, _: Viewer, job_id: int = JobId) -> list[ModelOut]:
    """Each worker's performance model, fitted from its recent telemetry."""
    job = jobs.get(session, job_id)
    out = []
    for rank, fit in enumerate(rebalancer.fits(session, job)):
        model = None if fit is None else (fit.model or fit.guess)
        out.append(
            ModelOut(
                rank=rank,
                identifiable=bool(fit and fit.identifiable),
                per_sample_ms=model.per_sample_ms if model else None,
                intercept_ms=model.intercept_ms if model else None,
                floor_ms=model.floor_ms if model else None,
                r2=fit.r2 if fit else None,
                relative_rmse=fit.relative_rmse if fit else None,
                observations=fit.observations if fit else 0,
                distinct_batch_sizes=fit.distinct_batch_sizes if fit else 0,
                reason=fit.reason if fit else "no iteration with samples reported yet",
            )
        )
    return out


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
