"""Training metrics of a job: the global loss and user-logged values, in and out."""

from __future__ import annotations

from fastapi import APIRouter, Query

from contract.agent import MetricAck, MetricBatch
from contract.base import MAX_METRIC_NAMES
from contract.dashboard import MetricsOut
from contract.enums import Role
from server.api.bodies import JSONRoute
from server.api.deps import Authenticated, PathId, SessionDep, Viewer
from server.api.statuses import declare
from server.services import job_metrics, jobs

router = APIRouter(prefix="/jobs", tags=["metrics"], route_class=JSONRoute)

_NAME = r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}"
NAMES_PATTERN = rf"^{_NAME}(,{_NAME}){{0,{MAX_METRIC_NAMES - 1}}}$"


@router.post("/{job_id}/metrics", responses=declare(409))
def ingest(
    batch: MetricBatch, session: SessionDep, principal: Authenticated, job_id: PathId
) -> MetricAck:
    """Store metric points (an agent: ranks on its host; a worker credential: its own rank;
    else admin; 409 once the job has ended); points already stored for (job, name, rank,
    iteration) are skipped, not duplicated: the first value wins."""
    if principal.role not in (Role.AGENT, Role.WORKER):
        principal.require(Role.ADMIN)
    accepted, duplicates = job_metrics.ingest(session, job_id, batch, principal)
    return MetricAck(accepted=accepted, duplicates=duplicates)


@router.get("/{job_id}/metrics")
def read(
    session: SessionDep,
    _: Viewer,
    job_id: PathId,
    points: int = Query(500, ge=10, le=10_000),
    names: str | None = Query(None, max_length=9000, pattern=NAMES_PATTERN),
    rank: int | None = Query(None, ge=0, le=10_000),
) -> MetricsOut:
    """At most `points` points per (metric, rank), each the mean of a bucket of iterations;
    only the comma-separated `names` and the `rank` when given."""
    job = jobs.get(session, job_id)
    wanted = names.split(",") if names is not None else None
    return job_metrics.downsampled(session, job, points=points, names=wanted, rank=rank)
