"""Storing one telemetry post (``POST /api/v1/jobs/{id}/telemetry``, a raw route): who may
post, the store (``AppContext.paths``: grouped by the writer thread, or alone), and what a
stored post sets off."""

from __future__ import annotations

from contract.agent import TelemetryAck, TelemetryBatch
from contract.enums import Role
from server.context import AppContext
from server.live import telemetry_stored
from server.services import telemetry
from server.services.tokens import Principal


async def store(
    context: AppContext, job_id: int, batch: TelemetryBatch, principal: Principal
) -> TelemetryAck:
    """Store the batch's rows (an agent: ranks on its host; a worker credential: its own rank;
    else admin); raises ``EvenflowError`` for a refusal."""
    if principal.role not in (Role.AGENT, Role.WORKER):
        principal.require(Role.ADMIN)
    accepted, duplicates = await context.paths.telemetry(telemetry.Post(job_id, batch, principal))
    # wake the job's live dashboard streams
    telemetry_stored(context.telemetry_notifier, job_id, accepted)
    if batch.urgent:
        context.wake_controller(job_id)
    metrics = context.metrics
    metrics.telemetry_records.inc(accepted)
    metrics.telemetry_duplicates.inc(duplicates)
    return TelemetryAck(accepted=accepted, duplicates=duplicates)
