"""Per-iteration timings: batched, idempotent ingest and reads."""

from __future__ import annotations

from fastapi import APIRouter, Query, Request

from contract.agent import TelemetryAck, TelemetryBatch
from contract.api import Page, TelemetryOut
from server.api import bodies, raw
from server.api.deps import Authenticated, Context, PagingDep, PathId, SessionDep, Viewer
from server.api.ingest import store
from server.api.statuses import declare
from server.services import jobs, telemetry

router = APIRouter(prefix="/jobs", tags=["telemetry"], route_class=bodies.JSONRoute)


@raw.post(
    "/jobs/{job_id}/telemetry",
    tags=["telemetry"],
    response_model=TelemetryAck,
    openapi_extra=bodies.documented_body(TelemetryBatch),
    responses=declare(409),
)
async def ingest(
    request: Request, context: Context, principal: Authenticated, job_id: PathId
) -> bytes:
    """Store timings (an agent: ranks on its host; a worker credential: its own rank; else
    admin; 409 once the job has ended); rows already stored for (job, rank, iteration) are skipped, not duplicated.
    An `urgent` batch (a worker's iteration time jumped) makes the control loop look at the job
    at once rather than at its next round."""
    batch = bodies.parse(TelemetryBatch, await request.body())
    ack = await store(context, job_id, batch, principal)
    return ack.model_dump_json().encode()


@router.get("/{job_id}/telemetry")
def read(
    session: SessionDep,
    _: Viewer,
    job_id: PathId,
    paging: PagingDep,
    since_iteration: int = Query(0, ge=0, le=10**12),
    rank: int | None = Query(None, ge=0, le=10_000),
) -> Page[TelemetryOut]:
    """Timings from `since_iteration` on, ordered by iteration and rank."""
    jobs.get(session, job_id)
    rows, total = telemetry.window(
        session, job_id, since_iteration=since_iteration, rank=rank, paging=paging
    )
    return Page(items=[TelemetryOut.model_validate(r) for r in rows], total=total)
