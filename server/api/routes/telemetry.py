"""Per-iteration timings: batched, idempotent ingest and reads."""

from __future__ import annotations

from fastapi import APIRouter, Path, Query, Request

from agent.wire import Role, TelemetryAck, TelemetryBatch, TelemetryOut
from server.api.deps import Authenticated, SessionDep, Viewer
from server.db import transaction
from server.live import telemetry_stored
from server.services import jobs, telemetry

router = APIRouter(prefix="/jobs", tags=["telemetry"])
JobId = Path(ge=1, le=2**31 - 1)


@router.post("/{job_id}/telemetry")
def ingest(
    batch: TelemetryBatch, request: Request, principal: Authenticated, job_id: int = JobId
) -> TelemetryAck:
    """Store timings; rows already stored for (job, rank, iteration) are skipped, not duplicated."""
    if principal.role is not Role.AGENT:
        principal.require(Role.ADMIN)
    # The hot write path: the body is already validated; hold the writer lock only for the
    # database work, not while the request is parsed.
    with request.app.state.write_lock, transaction(request.app.state.sessions) as session:
        job = jobs.get(session, job_id)
        jobs.check_agent_may_write(session, principal, job)
        accepted, duplicates = telemetry.ingest(session, job, batch)
    telemetry_stored(request.app, job_id, accepted)  # wake the job's live dashboard streams
    metrics = request.app.state.metrics
    metrics.telemetry_records.inc(accepted)
    metrics.telemetry_duplicates.inc(duplicates)
    return TelemetryAck(accepted=accepted, duplicates=duplicates)


@router.get("/{job_id}/telemetry")
def read(
    session: SessionDep,
    _: Viewer,
    job_id: int = JobId,
    since_iteration: int = Query(0, ge=0, le=10**12),
    rank: int | None = Query(None, ge=0, le=10_000),
    limit: int = Query(10_000, ge=1, le=100_000),
) -> list[TelemetryOut]:
    """Timings from `since_iteration` on, ordered by iteration and rank."""
    jobs.get(session, job_id)
    rows = telemetry.window(
        session, job_id, since_iteration=since_iteration, rank=rank, limit=limit
    )
    return [TelemetryOut.model_validate(r) for r in rows]
