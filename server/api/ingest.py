"""Storing one telemetry post: shared by the gate's fast path and the route.

``POST /api/v1/jobs/{id}/telemetry`` is most of a fleet's requests after steady heartbeats
(one per host and job every 2 s). The gate (``server.api.gate``) answers a well-formed one
itself, without routing, dependencies and the endpoint's wrapping, and passes any other (a body
that does not parse) to the route, which answers in the same words as for every other request.
Both store it here.
"""

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
    # Stored with the other posts that arrive together, in one transaction (no database slot
    # or worker thread of this request's own: the writer's thread does the work).
    post = telemetry.Post(job_id, batch, principal)
    accepted, duplicates = await context.telemetry_writer.store(post)
    # wake the job's live dashboard streams
    telemetry_stored(context.telemetry_notifier, job_id, accepted)
    if batch.urgent:
        context.wake_controller(job_id)
    metrics = context.metrics
    metrics.telemetry_records.inc(accepted)
    metrics.telemetry_duplicates.inc(duplicates)
    return TelemetryAck(accepted=accepted, duplicates=duplicates)
